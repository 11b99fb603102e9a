"""The forward's fp32 products (ops/fp32_rows.py): close to float64, and every output the same bits
whatever the number of rows it is computed with, its place among them, the thread count and the
ISA's tile (numpy's OpenBLAS fails the row-count test: `test_numpy_matmul_depends_on_the_rows`)."""

import numba
import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.host import blas
from fermijit.jit import cpu
from fermijit.jit.cpu import configure_threads
from fermijit.ops import fp32_rows
from tests.numerics import assert_close, poisoned

ISAS = cpu.variants_up_to(cpu.selected_isa())
# fp32 sums of K products vs float64: a few ulps of the sum of |terms| (K <= 4096).
PRODUCT_RTOL = 1e-5

SHAPES = {  # T, R, K: edges of every tile shape, K below, at and past one 16-float vector
    "T1-R1-K1": (1, 1, 1),
    "T3-R5-K15": (3, 5, 15),
    "T7-R13-K35": (7, 13, 35),
    "T21-R9-K16": (21, 9, 16),
    "T33-R64-K2048": (33, 64, 2048),
    "T12-R128-K256": (12, 128, 256),
    "T131-R67-K300": (131, 67, 300),  # tiles and edges split unevenly over the threads
}


def _inputs(rng, T, R, K):
    return (rng.standard_normal((T, K)).astype(np.float32),
            (rng.standard_normal((R, K)) / np.sqrt(K)).astype(np.float32))


def _bound(x, w):
    return PRODUCT_RTOL * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T).max()


@pytest.mark.parametrize("isa", ISAS, ids=[i.label for i in ISAS])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_matches_the_reference(rng, shape, isa):
    x, w = _inputs(rng, *shape)
    out = poisoned((shape[0], shape[1]))
    assert fp32_rows.cpu(x, w, out, isa=isa) is out
    assert_close("product", fp32_rows.reference(x, w), out, _bound(x, w), 0)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_every_output_is_the_same_bits_however_computed(rng, shape):
    """Each row alone (decode's kernel, one token, its rows split over the threads), any block of
    rows, every ISA's tile: the same bits as the whole product."""
    x, w = _inputs(rng, *shape)
    T, R = shape[:2]
    whole = fp32_rows.cpu(x, w)
    for isa in ISAS:
        assert np.array_equal(fp32_rows.cpu(x, w, isa=isa), whole), isa.label
    one = poisoned((1, R))
    for t in range(T):
        fp32_rows.decode_rows()(x[t:t + 1], w, one)
        assert np.array_equal(one[0], whole[t]), t
    for n in range(2, min(T, 3) + 1):  # a verify step's few tokens (pairs share w's loads)
        few = poisoned((n, R))
        fp32_rows.decode_rows()(x[:n], w, few)
        assert np.array_equal(few, whole[:n]), n
    for lo, hi in ((0, T // 2), (T // 3, T), (T - 1, T)):
        if hi > lo:
            assert np.array_equal(fp32_rows.cpu(x[lo:hi], w), whole[lo:hi]), (lo, hi)
    for lo, hi in ((0, R // 2), (R // 3, R)):  # a slice of w's rows (the GDN gates [b; a])
        if hi > lo:
            assert np.array_equal(fp32_rows.cpu(x, w[lo:hi]), whole[:, lo:hi]), (lo, hi)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="one CPU: nothing to compare")
@pytest.mark.parametrize("isa", ISAS, ids=[i.label for i in ISAS])
def test_the_same_bits_for_any_thread_count(rng, isa):
    x, w = _inputs(rng, 131, 67, 300)
    before = numba.get_num_threads()
    try:
        results, decode = [], []
        for n in (1, 2):
            configure_threads(n)
            results.append(fp32_rows.cpu(x, w, isa=isa))
            decode.append(poisoned((1, w.shape[0])))
            fp32_rows.decode_rows()(x[:1], w, decode[-1])  # rows split over n threads
    finally:
        configure_threads(before)
    assert np.array_equal(*results)
    assert np.array_equal(*decode) and np.array_equal(decode[0][0], results[0][0])


@pytest.mark.skipif(blas.threads() is None, reason="numpy's BLAS is not OpenBLAS")
def test_numpy_matmul_depends_on_the_rows(rng):
    """Why this kernel exists: numpy's OpenBLAS gives a row other bits in a product of other rows
    (the test above, run on np.matmul, fails); at the router's full-size shape."""
    x, w = _inputs(rng, 300, 128, 2048)
    whole = np.matmul(x, w.T)
    alone = np.concatenate([np.matmul(x[t:t + 1], w.T) for t in range(x.shape[0])])
    assert not np.array_equal(whole, alone)
    assert np.array_equal(fp32_rows.cpu(x, w), np.concatenate(
        [fp32_rows.cpu(x[t:t + 1], w) for t in range(x.shape[0])]))


def test_bad_inputs_are_one_line(rng):
    x, w = _inputs(rng, 4, 5, 32)
    with pytest.raises(FermijitError, match="w has shape"):
        fp32_rows.cpu(x, w[:, :16])
    with pytest.raises(FermijitError, match="out has shape"):
        fp32_rows.cpu(x, w, np.empty((4, 4), np.float32))
    with pytest.raises(FermijitError, match="dtype"):
        fp32_rows.cpu(x.astype(np.float64), w)
    with pytest.raises(FermijitError, match="C-contiguous"):
        fp32_rows.cpu(x[:, ::2], w[:, :16])
