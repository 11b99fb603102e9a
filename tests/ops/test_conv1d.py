"""conv1d.cpu against the numpy reference (MODEL.md §6.2)."""

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.ops import conv1d
from tests.numerics import assert_close, poisoned

# K fp32 products summed (maybe fused), then fp32 expf and a division: a few ulps of the sum of
# |terms| (O(1) here), so an absolute floor; elsewhere a few ulps of y.
ATOL, RTOL = 1e-6, 1e-6

CASES = {  # (T, C, K); T1 is the decode kernel, the last is the threaded sequence kernel
    "T1-C8192-K4": (1, 8192, 4),
    "T1-C33-K2": (1, 33, 2),
    "T1-C45-K3": (1, 45, 3),      # the decode kernel's general taps (K 4 is spelled out)
    "T7-C100-K4": (7, 100, 4),
    "T63-C60-K4": (63, 60, 4),
    "T2-C33-K4": (2, 33, 4),      # fewer tokens than state columns
    "T3-C17-K2": (3, 17, 2),
    "T5-C300-K5": (5, 300, 5),
    "T3-C8192-K4": (3, 8192, 4),
}


def make_inputs(rng, n_tokens, n_channels, k):
    x = rng.standard_normal((n_tokens, n_channels)).astype(np.float32)
    w = (0.5 * rng.standard_normal((n_channels, k))).astype(np.float32)
    state = rng.standard_normal((n_channels, k - 1)).astype(np.float32)
    return x, w, state


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_conv1d(rng, case):
    x, w, state = make_inputs(rng, *case)
    expected_y, expected_state = conv1d.reference(x, w, state)
    out = poisoned(x.shape)
    y, new_state = conv1d.cpu(x, w, state, out=out)
    assert y is out and new_state is state
    assert_close("conv1d y", expected_y, y, ATOL, RTOL)
    np.testing.assert_array_equal(state, expected_state)  # copied inputs: exact


@pytest.mark.parametrize("n_tokens", [1, 7])
def test_in_place(rng, n_tokens):
    x, w, state = make_inputs(rng, n_tokens, 300, 4)
    expected_y, expected_state = conv1d.reference(x, w, state)
    y, _ = conv1d.cpu(x, w, state, out=x)
    assert y is x
    assert_close("conv1d in place", expected_y, x, ATOL, RTOL)
    np.testing.assert_array_equal(state, expected_state)


def test_zero_state_is_sequence_start(rng):
    x, w, _ = make_inputs(rng, 6, 40, 4)
    padded = np.concatenate([np.zeros((3, 40), np.float32), x])
    # With zeros before the start, output t equals output t+3 of the zero-padded sequence.
    y_padded, _ = conv1d.reference(padded, w, np.zeros((40, 3), np.float32))
    y, _ = conv1d.cpu(x, w, np.zeros((40, 3), np.float32))
    assert_close("zero state", y_padded[3:], y, ATOL, RTOL)


def test_pieces_equal_one_pass(rng):
    # Prefill in chunks, then decode token by token: the same outputs and final state as one pass.
    x, w, state0 = make_inputs(rng, 12, 96, 4)
    y_all, state_all = conv1d.reference(x, w, state0)
    state = state0.copy()
    ys = []
    for lo, hi in ((0, 5), (5, 6), (6, 8), (8, 9), (9, 12)):
        y, _ = conv1d.cpu(np.ascontiguousarray(x[lo:hi]), w, state)
        ys.append(y)
    assert_close("pieces", y_all, np.concatenate(ys), ATOL, RTOL)
    np.testing.assert_array_equal(state, state_all)


@pytest.mark.parametrize("k", [4, 3])
def test_prefill_pieces_give_one_pass_bits(rng, k):
    """Prefill passes split anywhere: each token's taps summed in one order whether they read
    the state or x, so the very bits of one pass (channels past one block, a ragged block)."""
    x, w, state0 = make_inputs(rng, 20, conv1d.CHANNEL_BLOCK + 44, k)
    state = state0.copy()
    y_all, _ = conv1d.cpu(x, w, state)
    state_all = state
    state = state0.copy()
    ys = [conv1d.cpu(np.ascontiguousarray(x[lo:hi]), w, state,
                     out=poisoned((hi - lo, x.shape[1])))[0]
          for lo, hi in ((0, 2), (2, 9), (9, 11), (11, 20))]
    np.testing.assert_array_equal(np.concatenate(ys), y_all)
    np.testing.assert_array_equal(state, state_all)


def test_reference_matches_torch_conv(rng):
    torch = pytest.importorskip("torch")
    x, w, _ = make_inputs(rng, 9, 24, 4)
    # HF: F.conv1d(x [B, C, T], w [C, 1, K], padding=K-1, groups=C)[..., :T], then SiLU.
    xt = torch.from_numpy(x.T.copy())[None]
    pre = torch.nn.functional.conv1d(xt, torch.from_numpy(w)[:, None], padding=3, groups=24)
    expected = torch.nn.functional.silu(pre[..., :9])[0].T.numpy()
    y, _ = conv1d.reference(x, w, np.zeros((24, 3), np.float32))
    assert_close("reference vs torch", expected, y, ATOL, RTOL)


def test_bad_inputs():
    x = np.zeros((3, 8), np.float32)
    w = np.zeros((8, 4), np.float32)
    state = np.zeros((8, 3), np.float32)
    with pytest.raises(FermijitError, match="dtype"):
        conv1d.cpu(x.astype(np.float64), w, state)
    with pytest.raises(FermijitError, match="shape"):
        conv1d.cpu(x, np.zeros((9, 4), np.float32), state)
    with pytest.raises(FermijitError, match="shape"):
        conv1d.cpu(x, w, np.zeros((8, 4), np.float32))
    with pytest.raises(FermijitError, match="2 taps"):
        conv1d.cpu(x, np.zeros((8, 1), np.float32), np.zeros((8, 0), np.float32))
    with pytest.raises(FermijitError, match="contiguous"):
        conv1d.cpu(x, np.zeros((4, 8), np.float32).T, state)
    with pytest.raises(FermijitError, match="2-D"):
        conv1d.cpu(x[0], w, state)
    with pytest.raises(FermijitError, match="overlap"):
        buf = np.zeros(40, np.float32)
        conv1d.cpu(buf[:24].reshape(3, 8), w, buf[16:40].reshape(8, 3))
    with pytest.raises(FermijitError, match="overlap"):
        big = np.zeros((4, 8), np.float32)
        conv1d.cpu(big[:3], w, state, out=big[1:])
    read_only = state.copy()
    read_only.flags.writeable = False
    with pytest.raises(FermijitError, match="read-only"):
        conv1d.cpu(x, w, read_only)
