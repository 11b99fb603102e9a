"""rmsnorm.cpu / gated_cpu against the numpy references (MODEL.md §4)."""

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.ops import rmsnorm
from tests.numerics import assert_close, poisoned

EPS = 1e-6
# fp64 sum of squares, then a few fp32 roundings per element (scale, 1+w, products): measured
# max relative error 2.3e-7 (plain) and 2.9e-7 (gated, with expf and a division), so 1e-6.
ATOL, RTOL = 1e-7, 1e-6
GATED_ATOL, GATED_RTOL = 1e-7, 1e-6

SHAPES = {  # the last one is past PARALLEL_MIN_ELEMENTS: the threaded copy of the kernel
    "D2048": (2048,),
    "T7-D2048": (7, 2048),
    "T63-D60": (63, 60),
    "T3-H16-D256": (3, 16, 256),
    "T1-D1": (1, 1),
    "T40-D2048": (40, 2048),
}
GATED_SHAPES = {
    "Hv32-dv128": (32, 128),
    "T5-Hv32-dv128": (5, 32, 128),
    "T63-Hv3-dv60": (63, 3, 60),
    "T20-Hv32-dv128": (20, 32, 128),
}


def _inputs(rng, shape):
    x = (rng.standard_normal(shape) * rng.uniform(0.1, 10)).astype(np.float32)
    w = (0.5 * rng.standard_normal(shape[-1])).astype(np.float32)  # offsets from 1: not zero
    return x, w


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_rmsnorm(rng, shape):
    x, w = _inputs(rng, shape)
    out = poisoned(shape)
    y = rmsnorm.cpu(x, w, EPS, out=out)
    assert y is out
    assert_close("rmsnorm", rmsnorm.reference(x, w, EPS), y, ATOL, RTOL)
    assert_close("rmsnorm (allocating)", rmsnorm.reference(x, w, EPS), rmsnorm.cpu(x, w, EPS),
                 ATOL, RTOL)


def test_rmsnorm_in_place(rng):
    x, w = _inputs(rng, (5, 256))
    expected = rmsnorm.reference(x, w, EPS)
    rmsnorm.cpu(x, w, EPS, out=x)
    assert_close("rmsnorm in place", expected, x, ATOL, RTOL)


@pytest.mark.parametrize("shape", [(7, 60), (40, 2048), (512, 384), (3, 4, 64)])
def test_residual_is_the_add_then_the_norm_bit_for_bit(rng, shape):
    """residual_cpu: x += y then `cpu`, to the bit (the forward's residual stream), and against
    the reference of x + y."""
    x, w = _inputs(rng, shape)
    y = _inputs(rng, shape)[0]
    expected_x = x + y
    expected = rmsnorm.cpu(expected_x, w, EPS)
    out = poisoned(shape)
    assert rmsnorm.residual_cpu(x, y, w, EPS, out) is out
    np.testing.assert_array_equal(x, expected_x)
    np.testing.assert_array_equal(out, expected)
    assert_close("residual rmsnorm", rmsnorm.reference(expected_x, w, EPS), out, ATOL, RTOL)
    np.testing.assert_array_equal(rmsnorm.residual_cpu(x, None, w, EPS, poisoned(shape)),
                                  rmsnorm.cpu(x, w, EPS))
    with pytest.raises(FermijitError, match="apart"):
        rmsnorm.residual_cpu(x, x, w, EPS, out)
    with pytest.raises(FermijitError, match="shape"):
        rmsnorm.residual_cpu(x, y[:1], w, EPS, out)


def test_reference_is_zero_centred():
    # All-ones rows have rms 1, so y = 1 + w exactly, up to eps.
    x = np.ones((2, 8), np.float32)
    w = np.linspace(-0.5, 0.5, 8).astype(np.float32)
    assert_close("1 + w", np.broadcast_to(1 + w, x.shape), rmsnorm.reference(x, w, EPS),
                 1e-6, 1e-6)


def test_zero_row_stays_finite(rng):
    x, w = _inputs(rng, (3, 64))
    x[1] = 0.0
    y = rmsnorm.cpu(x, w, EPS, out=poisoned(x.shape))
    assert_close("zero row", rmsnorm.reference(x, w, EPS), y, ATOL, RTOL)


@pytest.mark.parametrize("shape", GATED_SHAPES.values(), ids=GATED_SHAPES.keys())
def test_gated(rng, shape):
    o, _ = _inputs(rng, shape)
    z = (3 * rng.standard_normal(shape)).astype(np.float32)
    z.flat[:2] = (-200.0, 200.0)  # expf over/underflow in the gate
    w = rng.uniform(0.2, 2.0, shape[-1]).astype(np.float32)  # plain weight
    out = poisoned(shape)
    y = rmsnorm.gated_cpu(o, z, w, EPS, out=out)
    assert y is out
    with np.errstate(over="ignore"):
        expected = rmsnorm.gated_reference(o, z, w, EPS)
    assert_close("gated rmsnorm", expected, y, GATED_ATOL, GATED_RTOL)


@pytest.mark.parametrize("into", ["o", "z"])
def test_gated_in_place(rng, into):
    """out = o or z (the forward's and gdn_step's calls) as out of place, bit for bit; rows past
    several scratch chunks (rmsnorm.GATED_CHUNK), a ragged last one."""
    shape = (3 * rmsnorm.GATED_CHUNK + 5, 2, 40)
    o, _ = _inputs(rng, shape)
    z = (3 * rng.standard_normal(shape)).astype(np.float32)
    w = rng.uniform(0.2, 2.0, shape[-1]).astype(np.float32)
    want = rmsnorm.gated_cpu(o, z, w, EPS, out=poisoned(shape))
    both = {"o": o.copy(), "z": z.copy()}
    assert rmsnorm.gated_cpu(both["o"], both["z"], w, EPS, out=both[into]) is both[into]
    assert np.array_equal(both[into], want)


def test_gated_uses_plain_weight():
    # o of rms 1 and a huge gate (silu(z) = z): y = w * z.
    o = np.ones((1, 4), np.float32)
    z = np.full((1, 4), 50.0, np.float32)
    w = np.array([0.0, 1.0, 2.0, 3.0], np.float32)
    assert_close("w * silu(z)", 50.0 * w[None], rmsnorm.gated_cpu(o, z, w, EPS), 1e-4, 1e-6)


def test_bad_inputs():
    x = np.zeros((4, 8), np.float32)
    w = np.zeros(8, np.float32)
    with pytest.raises(FermijitError, match="dtype"):
        rmsnorm.cpu(x.astype(np.float64), w, EPS)
    with pytest.raises(FermijitError, match="shape"):
        rmsnorm.cpu(x, np.zeros(7, np.float32), EPS)
    with pytest.raises(FermijitError, match="contiguous"):
        rmsnorm.cpu(np.zeros((8, 4), np.float32).T, w, EPS)
    with pytest.raises(FermijitError, match="shape"):
        rmsnorm.cpu(x, w, EPS, out=np.zeros((4, 9), np.float32))
    with pytest.raises(FermijitError, match="non-empty"):
        rmsnorm.cpu(np.zeros((4, 0), np.float32), np.zeros(0, np.float32), EPS)
    with pytest.raises(FermijitError, match="shape"):
        rmsnorm.gated_cpu(x, np.zeros((4, 7), np.float32), w, EPS)
    with pytest.raises(FermijitError, match="dtype"):
        rmsnorm.gated_cpu(x, x.astype(np.float16), w, EPS)
    with pytest.raises(FermijitError, match="Hv, dv"):
        rmsnorm.gated_cpu(w, w, w, EPS)
    with pytest.raises(FermijitError, match="contiguous"):
        rmsnorm.gated_cpu(x, x, w, EPS, out=np.zeros((4, 16), np.float32)[:, ::2])
