"""rope.gpu (kernels_ptx/rope.ptx) against the numpy reference (MODEL.md §5.4)."""

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.ops import rope
from tests.gpu import needs_gpu, report_error
from tests.numerics import assert_close, poisoned

MODEL_THETA = 1e7
# Issue 5: elementwise ops within 1e-5 relative. Two fp32 products and a sum per element; where
# they cancel the error is relative to |x|, hence the small absolute term.
ATOL, RTOL = 2e-6, 1e-5

# (T, H, D, R): the model's q and k heads; a ragged head size with R < D; R = D (no copy).
SHAPES = {"T5-H16-D256-R64": (5, 16, 256, 64), "T7-H2-D256-R64": (7, 2, 256, 64),
          "T33-H3-D60-R20": (33, 3, 60, 20), "T4-H1-D8-R8": (4, 1, 8, 8)}


def make_inputs(rng, n_tokens, n_heads, d, start=0):
    x = rng.standard_normal((n_tokens, n_heads, d)).astype(np.float32)
    positions = (start + np.arange(n_tokens)).astype(np.int64)
    return x, positions


@needs_gpu
@pytest.mark.parametrize("start", [0, 262000], ids=["start0", "start262000"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_rope_gpu(rng, shape, start):
    n_tokens, n_heads, d, rotary_dim = shape
    x, positions = make_inputs(rng, n_tokens, n_heads, d, start)
    out = poisoned(x.shape)
    assert rope.gpu(x, positions, rotary_dim, MODEL_THETA, out=out) is out
    expected = rope.reference(x, positions, rotary_dim, MODEL_THETA)
    assert_close("rope", expected, out, ATOL, RTOL)
    report_error("rope", expected, out)


@needs_gpu
def test_device_in_place(rng):
    from fermijit.jit import gpu

    x, positions = make_inputs(rng, 9, 4, 64, 100)
    x_dev = gpu.to_device("test", "x", x, np.float32)
    assert rope.gpu(x_dev, positions, 32, 1e4, out=x_dev) is x_dev
    assert_close("rope in place", rope.reference(x, positions, 32, 1e4), x_dev.get(), ATOL, RTOL)


@pytest.mark.parametrize("args", [
    lambda x, p: (x, p.astype(np.int32), 64, MODEL_THETA),
    lambda x, p: (x, p[:-1].copy(), 64, MODEL_THETA),
    lambda x, p: (x, p, 63, MODEL_THETA),
    lambda x, p: (x, p, 512, MODEL_THETA),
    lambda x, p: (x, p, 64, -1.0),
    lambda x, p: (x[0].copy(), p, 64, MODEL_THETA),
], ids=["positions-int32", "positions-short", "odd-rotary", "rotary-past-d", "negative-theta",
        "x-2d"])
def test_bad_arguments_raise(rng, args):
    x, positions = make_inputs(rng, 5, 2, 256)
    with pytest.raises(FermijitError):
        rope.gpu(*args(x, positions))
