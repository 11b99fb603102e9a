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
