"""router.cpu against the numpy reference, and against torch's softmax + topk (MODEL.md §4)."""

import numba
import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.jit import omp
from fermijit.jit.cpu import configure_threads
from fermijit.ops import router
from tests.numerics import assert_close, poisoned

# Both sides compute the k exps and the sum in fp64 and round once to fp32 (measured: bitwise
# equal here); 1e-6 leaves room for a libm exp that differs from numpy's in the last fp64 bit.
ATOL, RTOL = 1e-7, 1e-6
# torch does the whole softmax in fp32, then renormalises: a few fp32 ulps.
TORCH_ATOL, TORCH_RTOL = 1e-6, 1e-5

CASES = {  # (T or None for a single [E] token, E, k)
    "E256-k8": (None, 256, 8),
    "T7-E256-k8": (7, 256, 8),
    "T33-E128-k8": (33, 128, 8),
    "T131-E128-k8": (131, 128, 8),  # past omp.ROWS_MIN: rows over the threads, odd shares
    "T5-E60-k3": (5, 60, 3),
    "T4-E10-k10": (4, 10, 10),
    "T3-E5-k1": (3, 5, 1),
}


def _logits(rng, n_tokens, n_experts):
    shape = (n_experts,) if n_tokens is None else (n_tokens, n_experts)
    return (2 * rng.standard_normal(shape)).astype(np.float32)


def _check(logits, k):
    shape = logits.shape[:-1] + (k,)
    out = (np.full(shape, -7, np.int32), poisoned(shape))
    idx, weight = router.cpu(logits, k, out=out)
    assert idx is out[0] and weight is out[1]
    expected_idx, expected_weight = router.reference(logits, k)
    np.testing.assert_array_equal(idx, expected_idx)
    assert_close("router weight", expected_weight, weight, ATOL, RTOL)
    return idx, weight


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_router(rng, case):
    n_tokens, n_experts, k = case
    logits = _logits(rng, n_tokens, n_experts)
    idx, weight = _check(logits, k)
    assert_close("weights sum to 1", np.ones(weight.shape[:-1]), weight.sum(-1, dtype=np.float64),
                 1e-6, 0)
    assert (np.diff(weight, axis=-1) <= 0).all()


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="one CPU: nothing to compare")
def test_rows_over_threads_give_each_rows_own_bits(rng):
    """A prefill call (rows over the threads) gives every row the bits of a one-row call
    (decode's), whatever the thread count."""
    logits = _logits(rng, 131, 128)
    assert logits.shape[0] >= omp.ROWS_MIN
    before = numba.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            configure_threads(n)
            results.append(_check(logits, 8))
    finally:
        configure_threads(before)
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    for t in range(logits.shape[0]):
        for a, b in zip(router.cpu(logits[t], 8), results[0]):
            np.testing.assert_array_equal(a, b[t])


def test_ties_go_to_the_lower_expert(rng):
    # Integer logits in a small range: many exact ties, inside and at the edge of the top k.
    logits = rng.integers(-3, 3, (40, 64)).astype(np.float32)
    idx, _ = _check(logits, 8)
    for row, chosen in zip(logits, idx):
        for a, b in zip(chosen[:-1], chosen[1:]):
            assert row[a] > row[b] or (row[a] == row[b] and a < b)
    flat = np.zeros(16, np.float32)
    np.testing.assert_array_equal(router.cpu(flat, 4)[0], [0, 1, 2, 3])


def test_far_apart_logits(rng):
    # Spreads whose softmax underflows to 0 outside the top: the kernel never forms the full p.
    logits = (300 * rng.standard_normal((9, 256))).astype(np.float32)
    _check(logits, 8)


def test_matches_torch_topk(rng):
    torch = pytest.importorskip("torch")
    logits = (2 * rng.standard_normal((64, 256))).astype(np.float32)  # no ties, almost surely
    p = torch.softmax(torch.from_numpy(logits), dim=-1)
    top_p, top_idx = torch.topk(p, 8, dim=-1)
    idx, weight = router.cpu(logits, 8)
    np.testing.assert_array_equal(idx, top_idx.numpy())
    assert_close("router vs torch", (top_p / top_p.sum(-1, keepdim=True)).numpy(), weight,
                 TORCH_ATOL, TORCH_RTOL)


def test_bad_inputs():
    logits = np.zeros((3, 16), np.float32)
    with pytest.raises(FermijitError, match="dtype"):
        router.cpu(logits.astype(np.float64), 4)
    with pytest.raises(FermijitError, match="contiguous"):
        router.cpu(np.zeros((16, 3), np.float32).T, 4)
    with pytest.raises(FermijitError, match=r"\[E\] or \[T, E\]"):
        router.cpu(np.zeros((2, 3, 16), np.float32), 4)
    for k in (0, 17, 2.0):
        with pytest.raises(FermijitError, match="top_k"):
            router.cpu(logits, k)
    with pytest.raises(FermijitError, match="dtype"):
        router.cpu(logits, 4, out=(np.zeros((3, 4), np.int64), np.zeros((3, 4), np.float32)))
    with pytest.raises(FermijitError, match="shape"):
        router.cpu(logits, 4, out=(np.zeros((3, 4), np.int32), np.zeros((3, 5), np.float32)))
