"""The norms (rmsnorm, its residual and gated forms, l2norm and its split form, layer_norm; CPU and
GPU) on rows whose rms spans 1e-4 .. 1e4 in one call (issue 33 item 4): the small rows are where
eps's place shows (inside the root, beside mean(x²) of 1e-8: moved outside, such a row's scale
changes ~10x), the large ones where an fp32 sum of squares would lose or overflow. The other norm
tests draw one scale in [0.1, 10] per call, where eps outside the root is within tolerance.
Tolerances are each op's own (tests/ops/test_rmsnorm.py, test_l2norm.py, test_layer_norm.py and
their GPU twins). Measured here on the CPU, max relative error: rmsnorm 2.4e-7, gated 2.8e-7,
l2norm 1.2e-7; layer_norm 4.8e-7 absolute, also on rows of mean 300 (5.9e-4 before it centred in
fp64: the fix of ops/layer_norm.py that came with this test).
"""

import numpy as np
import pytest

from fermijit.ops import l2norm, layer_norm, rmsnorm
from tests.gpu import needs_gpu, report_error
from tests.numerics import assert_close, poisoned
from tests.ops import test_l2norm as l2norm_tests
from tests.ops import test_l2norm_gpu as l2norm_gpu_tests
from tests.ops import test_layer_norm as layer_norm_tests
from tests.ops import test_rmsnorm as rmsnorm_tests
from tests.ops import test_rmsnorm_gpu as rmsnorm_gpu_tests

EPS = 1e-6
RMS = 10.0 ** np.arange(-4, 5)          # 1e-4, 1e-3, ..., 1e4: one row each
# (rows, width): serial; per-head rows; past PARALLEL_MIN_ELEMENTS (the threaded kernels)
SHAPES = {"N9-D60": (9, 60), "N18-D256": (18, 256), "N36-D2048": (36, 2048)}


def rows_of_rms(rng, shape, mean: float = 0.0) -> np.ndarray:
    """Rows [N, D] of random signs and sizes, row r scaled to rms RMS[r % 9] about `mean`
    (exactly, in float64, before the fp32 rounding)."""
    x = rng.standard_normal(shape)
    x -= x.mean(axis=-1, keepdims=True)
    x /= np.sqrt(np.mean(x * x, axis=-1, keepdims=True))
    scale = np.resize(RMS, shape[0])[:, None]
    return (mean + x * scale).astype(np.float32)


def offsets(rng, d):
    return (0.5 * rng.standard_normal(d)).astype(np.float32)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_rmsnorm(rng, shape):
    x, w = rows_of_rms(rng, shape), offsets(rng, shape[-1])
    want = rmsnorm.reference(x, w, EPS)
    assert_close("rmsnorm", want, rmsnorm.cpu(x, w, EPS, out=poisoned(shape)),
                 rmsnorm_tests.ATOL, rmsnorm_tests.RTOL)
    y = rows_of_rms(rng, shape)
    x_plus = x.copy()
    out = rmsnorm.residual_cpu(x_plus, y, w, EPS, poisoned(shape))
    assert_close("residual rmsnorm", rmsnorm.reference(x + y, w, EPS), out,
                 rmsnorm_tests.ATOL, rmsnorm_tests.RTOL)


def test_eps_is_inside_the_root():
    """A row of rms 1e-4 (mean(x²) = 1e-8, a hundredth of eps): scaled by 1/sqrt(1e-8 + eps),
    1/sqrt(1.01e-6) = 995.0; eps outside the root would give 1/(1e-4 + eps) = 9901."""
    x = np.full((1, 64), 1e-4, np.float32)
    w = np.zeros(64, np.float32)
    want = np.float64(x[0, 0]) / np.sqrt(np.float64(x[0, 0]) ** 2 + EPS)
    assert_close("rmsnorm of rms 1e-4", np.full((1, 64), want), rmsnorm.cpu(x, w, EPS),
                 0, rmsnorm_tests.RTOL)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_gated_rmsnorm(rng, shape):
    o = rows_of_rms(rng, shape).reshape(shape[0], 1, shape[1])
    z = (3 * rng.standard_normal(o.shape)).astype(np.float32)
    w = rng.uniform(0.2, 2.0, shape[-1]).astype(np.float32)
    assert_close("gated rmsnorm", rmsnorm.gated_reference(o, z, w, EPS),
                 rmsnorm.gated_cpu(o, z, w, EPS, out=poisoned(o.shape)),
                 rmsnorm_tests.GATED_ATOL, rmsnorm_tests.GATED_RTOL)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_l2norm(rng, shape):
    x = rows_of_rms(rng, shape)
    for scale in (1.0, shape[-1] ** -0.5):
        assert_close("l2norm", l2norm.reference(x, EPS, scale),
                     l2norm.cpu(x, EPS, scale, out=poisoned(shape)),
                     l2norm_tests.ATOL, l2norm_tests.RTOL)


def test_l2norm_split(rng):
    """The prefill form: q and k heads of rows of every rms, one token per rms."""
    n_tok, hk, dk, hv, dv = len(RMS), 2, 64, 2, 32
    mixed = rows_of_rms(rng, (n_tok, 2 * hk * dk + hv * dv))
    q, k, v = poisoned((n_tok, hk, dk)), poisoned((n_tok, hk, dk)), poisoned((n_tok, hv, dv))
    l2norm.split_cpu(mixed, EPS, dk ** -0.5, q, k, v)
    parts = np.split(mixed, [hk * dk, 2 * hk * dk], axis=1)
    assert_close("q", l2norm.reference(parts[0].reshape(q.shape), EPS, dk ** -0.5), q,
                 l2norm_tests.ATOL, l2norm_tests.RTOL)
    assert_close("k", l2norm.reference(parts[1].reshape(k.shape), EPS), k,
                 l2norm_tests.ATOL, l2norm_tests.RTOL)


@pytest.mark.parametrize("mean", [0.0, 300.0], ids=["centred", "mean-300"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_layer_norm(rng, shape, mean):
    x = rows_of_rms(rng, shape, mean)
    w = (1 + 0.3 * rng.standard_normal(shape[-1])).astype(np.float32)
    b = (0.3 * rng.standard_normal(shape[-1])).astype(np.float32)
    assert_close("layer_norm", layer_norm.reference(x, w, b, EPS), layer_norm.cpu(x, w, b, EPS),
                 layer_norm_tests.ATOL, layer_norm_tests.RTOL)


# --- GPU ---------------------------------------------------------------------------------------

def check_gpu(name, expected, actual, atol, rtol):
    report_error(f"{name} (rms 1e-4..1e4)", expected, actual)
    assert_close(name, expected, actual, atol, rtol)


@needs_gpu
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_rmsnorm_gpu(rng, shape):
    x, w = rows_of_rms(rng, shape), offsets(rng, shape[-1])
    check_gpu("rmsnorm", rmsnorm.reference(x, w, EPS), rmsnorm.gpu(x, w, EPS, out=poisoned(shape)),
              rmsnorm_gpu_tests.ATOL, rmsnorm_gpu_tests.RTOL)
    o = x.reshape(shape[0], 1, shape[1])
    z = (3 * rng.standard_normal(o.shape)).astype(np.float32)
    check_gpu("gated rmsnorm", rmsnorm.gated_reference(o, z, 1 + w, EPS),
              rmsnorm.gated_gpu(o, z, 1 + w, EPS, out=poisoned(o.shape)),
              rmsnorm_gpu_tests.ATOL, rmsnorm_gpu_tests.RTOL)


@needs_gpu
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_l2norm_gpu(rng, shape):
    x = rows_of_rms(rng, shape)
    check_gpu("l2norm", l2norm.reference(x, EPS, 1.0), l2norm.gpu(x, EPS, 1.0, out=poisoned(shape)),
              l2norm_gpu_tests.ATOL, l2norm_gpu_tests.RTOL)


@needs_gpu
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_layer_norm_gpu(rng, shape):
    """Centred rows only: the GPU takes its statistics in fp32 (kernels_ptx/layer_norm.ptx), where
    a mean of 300 over rows of rms 1e-3 is beyond fp32 whatever the kernel does."""
    from tests.ops.test_vision_gpu import NORM_ATOL, NORM_RTOL

    x = rows_of_rms(rng, shape)
    w = (1 + 0.3 * rng.standard_normal(shape[-1])).astype(np.float32)
    b = (0.3 * rng.standard_normal(shape[-1])).astype(np.float32)
    check_gpu("layer_norm", layer_norm.reference(x, w, b, EPS),
              layer_norm.gpu(x, w, b, EPS, out=poisoned(shape)), NORM_ATOL, NORM_RTOL)
