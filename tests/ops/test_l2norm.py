"""l2norm.cpu against the numpy reference (MODEL.md §6.4)."""

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.ops import l2norm
from tests.numerics import assert_close, poisoned

EPS = 1e-6
# fp64 sum of squares, then two fp32 roundings per element (the scale, the product): measured
# max relative error 1.2e-7.
ATOL, RTOL = 1e-8, 1e-6

SHAPES = {  # the last one is past PARALLEL_MIN_ELEMENTS: the threaded copy of the kernel
    "H16-d128": (16, 128),
    "T7-H16-d128": (7, 16, 128),
    "T63-H4-d60": (63, 4, 60),
    "d100": (100,),
    "T40-H16-d128": (40, 16, 128),
}
SCALES = {"scale1": 1.0, "scale-rsqrt128": 128 ** -0.5}


@pytest.mark.parametrize("scale", SCALES.values(), ids=SCALES.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_l2norm(rng, shape, scale):
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 10)).astype(np.float32)
    out = poisoned(shape)
    y = l2norm.cpu(x, EPS, scale, out=out)
    assert y is out
    assert_close("l2norm", l2norm.reference(x, EPS, scale), y, ATOL, RTOL)


def test_unit_rows_and_eps_inside_the_root(rng):
    x = (rng.standard_normal((5, 3, 32))).astype(np.float32)
    x[0, 0] = 0.0
    y = l2norm.cpu(x, EPS)
    norms = np.linalg.norm(y.astype(np.float64), axis=-1)
    expected = np.ones((5, 3))
    expected[0, 0] = 0.0  # eps keeps the zero row finite: it stays zero
    assert_close("row norms", expected, norms, 1e-6, 1e-6)
    # A row of norm sqrt(eps) is scaled by 1/sqrt(2 eps): eps is added to the sum, not the norm.
    tiny = np.zeros(4, np.float32)
    tiny[0] = np.float32(np.sqrt(EPS))
    assert_close("eps in the sum", [np.sqrt(0.5), 0, 0, 0], l2norm.cpu(tiny, EPS), 1e-7, 1e-6)


def test_in_place(rng):
    x = rng.standard_normal((4, 16, 128)).astype(np.float32)
    expected = l2norm.reference(x, EPS, 0.5)
    l2norm.cpu(x, EPS, 0.5, out=x)
    assert_close("l2norm in place", expected, x, ATOL, RTOL)


def test_bad_inputs():
    x = np.zeros((4, 8), np.float32)
    with pytest.raises(FermijitError, match="dtype"):
        l2norm.cpu(x.astype(np.float64), EPS)
    with pytest.raises(FermijitError, match="contiguous"):
        l2norm.cpu(np.zeros((8, 4), np.float32).T, EPS)
    with pytest.raises(FermijitError, match="shape"):
        l2norm.cpu(x, EPS, out=np.zeros((8, 4), np.float32))
    with pytest.raises(FermijitError, match="non-empty"):
        l2norm.cpu(np.zeros((3, 0), np.float32), EPS)


# (T, Hk, dk, Hv, dv): one token, ragged heads, the default model's and the real head shapes;
# the last ones are more rows than threads.
SPLIT_SHAPES = {"T1-Hk2-dk16-Hv4-dv8": (1, 2, 16, 4, 8),
                "T9-Hk3-dk60-Hv6-dv100": (9, 3, 60, 6, 100),
                "T33-Hk4-dk64-Hv8-dv64": (33, 4, 64, 8, 64),
                "T5-Hk16-dk128-Hv32-dv128": (5, 16, 128, 32, 128)}


@pytest.mark.parametrize("shape", SPLIT_SHAPES.values(), ids=SPLIT_SHAPES.keys())
def test_split_normalises_q_and_k_and_copies_v(rng, shape):
    n_tok, hk, dk, hv, dv = shape
    mixed = (rng.standard_normal((n_tok, 2 * hk * dk + hv * dv)) * 3).astype(np.float32)
    mixed[0, :dk] = 0  # a zero head: eps keeps it zero
    q, k, v = poisoned((n_tok, hk, dk)), poisoned((n_tok, hk, dk)), poisoned((n_tok, hv, dv))
    before = mixed.copy()
    got = l2norm.split_cpu(mixed, EPS, dk ** -0.5, q, k, v)
    assert all(a is b for a, b in zip(got, (q, k, v)))
    parts = np.split(mixed, [hk * dk, 2 * hk * dk], axis=1)
    assert_close("q", l2norm.reference(parts[0].reshape(q.shape), EPS, dk ** -0.5), q, ATOL, RTOL)
    assert_close("k", l2norm.reference(parts[1].reshape(k.shape), EPS), k, ATOL, RTOL)
    np.testing.assert_array_equal(v, parts[2].reshape(v.shape))
    np.testing.assert_array_equal(mixed, before)


def test_split_bad_inputs():
    mixed = np.zeros((3, 2 * 2 * 8 + 4 * 8), np.float32)
    q, k, v = (np.zeros((3, 2, 8), np.float32), np.zeros((3, 2, 8), np.float32),
               np.zeros((3, 4, 8), np.float32))
    with pytest.raises(FermijitError, match="not q"):
        l2norm.split_cpu(np.zeros((3, 56), np.float32), EPS, 1.0, q, k, v)
    with pytest.raises(FermijitError, match="shape"):
        l2norm.split_cpu(mixed, EPS, 1.0, q[:2], k, v)
    with pytest.raises(FermijitError, match="dtype"):
        l2norm.split_cpu(mixed.astype(np.float64), EPS, 1.0, q, k, v)
    frozen = v.copy()
    frozen.flags.writeable = False
    with pytest.raises(FermijitError, match="writeable"):
        l2norm.split_cpu(mixed, EPS, 1.0, q, k, frozen)
