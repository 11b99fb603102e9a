"""conv1d.gpu (kernels_ptx/conv1d.ptx) against the numpy reference (MODEL.md §6.2)."""

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.ops import conv1d
from tests.gpu import needs_gpu, report_error
from tests.numerics import assert_close, poisoned
from tests.ops.test_conv1d import make_inputs

# Issue 5: elementwise ops within 1e-5 relative. A 4-term fp32 sum, then silu (ex2.approx and
# a division); where the taps cancel the error is relative to the inputs, hence the atol.
ATOL, RTOL = 1e-6, 1e-5

# (T, C, K): one token (decode-sized), fewer tokens than the state (T < K-1), ragged C past
# the 256-channel block, the model's 8192 channels.
SHAPES = {"T1-C300-K4": (1, 300, 4), "T2-C64-K4": (2, 64, 4), "T37-C260-K3": (37, 260, 3),
          "T70-C8192-K4": (70, 8192, 4), "T5-C10-K2": (5, 10, 2)}


@needs_gpu
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_conv1d_gpu(rng, shape):
    x, w, state = make_inputs(rng, *shape)
    expected_y, expected_state = conv1d.reference(x, w, state)
    out = poisoned(x.shape)
    y, new_state = conv1d.gpu(x, w, state, out=out)
    assert y is out and new_state is state
    assert_close("conv1d y", expected_y, y, ATOL, RTOL)
    assert_close("conv1d state", expected_state, state, 0.0, 0.0)  # copied inputs: exact
    report_error("conv1d y", expected_y, y)


@needs_gpu
def test_device_in_place_and_in_pieces(rng):
    """A sequence in two device calls, each in place, equals one call: the state carries over."""
    from fermijit.jit import gpu

    x, w, state = make_inputs(rng, 41, 300, 4)
    expected_y, expected_state = conv1d.reference(x, w, state)
    state_dev = gpu.to_device("test", "state", state, np.float32)
    pieces = []
    for part in (x[:2], x[2:]):
        part_dev = gpu.to_device("test", "x", np.ascontiguousarray(part), np.float32)
        y, s = conv1d.gpu(part_dev, w, state_dev, out=part_dev)
        assert y is part_dev and s is state_dev
        pieces.append(y.get())
    assert_close("conv1d pieces", expected_y, np.concatenate(pieces), ATOL, RTOL)
    assert_close("conv1d state", expected_state, state_dev.get(), 0.0, 0.0)


@pytest.mark.parametrize("corrupt", [
    lambda x, w, s: (x, np.zeros((x.shape[1], 5), np.float32),
                     np.zeros((x.shape[1], 4), np.float32)),
    lambda x, w, s: (x, w, s[:, :-1].copy()),
    lambda x, w, s: (x.astype(np.float64), w, s),
    lambda x, w, s: (x, w[:-1].copy(), s),
    lambda x, w, s: (x, w, np.broadcast_to(s, s.shape)),
], ids=["5-taps", "state-wrong-width", "x-float64", "w-wrong-channels", "state-read-only"])
def test_bad_arguments_raise(rng, corrupt):
    with pytest.raises(FermijitError):
        conv1d.gpu(*corrupt(*make_inputs(rng, 5, 16, 4)))
