"""f32_gemm.gpu (kernels_ptx/f32_gemm.ptx) against its numpy reference."""

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.ops import f32_gemm
from tests.gpu import needs_gpu, report_error
from tests.numerics import assert_close, poisoned

# fp32 dot products of K <= 2048 terms (error ~ sqrt(K) * 2^-24 of the terms' magnitude) and,
# in the epilogues, ex2.approx / lg2.approx (~2^-22 relative).
ATOL, RTOL = 1e-5, 1e-5

# (T, N, K): the router (128 experts, hidden 2048); the shared gate (N = 1); ragged tiles; K not
# a multiple of the tile's 16; one token.
SHAPES = {"T70-N128-K2048": (70, 128, 2048), "T33-N1-K384": (33, 1, 384),
          "T17-N19-K40": (17, 19, 40), "T1-N16-K64": (1, 16, 64)}


@needs_gpu
@pytest.mark.parametrize("mode", ["plain", "sigmoid"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_f32_gemm_gpu(rng, shape, mode):
    t, n, k = shape
    x = rng.standard_normal((t, k), dtype=np.float32)
    w = (rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k)).astype(np.float32)
    out = poisoned((t, n))
    y = f32_gemm.gpu(x, w, mode, out=out)
    assert y is out
    expected = f32_gemm.reference(x, w, mode)
    assert_close(f"f32_gemm {mode}", expected, y, ATOL, RTOL)
    report_error(f"f32_gemm {mode}", expected, y)


@needs_gpu
@pytest.mark.parametrize("shape", [(70, 32, 2048), (5, 8, 384), (1, 1, 64)])
def test_gates_gpu(rng, shape):
    t, hv, k = shape
    x = rng.standard_normal((t, k), dtype=np.float32)
    w_ba = (3 * rng.standard_normal((2 * hv, k), dtype=np.float32) / np.sqrt(k)).astype(np.float32)
    A_log = rng.standard_normal(hv, dtype=np.float32)
    dt_bias = rng.standard_normal(hv, dtype=np.float32)
    out = (poisoned((t, hv)), poisoned((t, hv)))
    g, beta = f32_gemm.gates_gpu(x, w_ba, A_log, dt_bias, out=out)
    assert g is out[0] and beta is out[1]
    eg, ebeta = f32_gemm.gates_reference(x, w_ba, A_log, dt_bias)
    assert_close("gates g", eg, g, ATOL, RTOL)
    assert_close("gates beta", ebeta, beta, ATOL, RTOL)
    report_error("gates g", eg, g)


def test_references_agree_with_the_gates_op(rng):
    """gates_reference is ops.gated_delta's gates of the two products."""
    from fermijit.ops import gated_delta

    x = rng.standard_normal((4, 64), dtype=np.float32)
    w_ba = rng.standard_normal((6, 64), dtype=np.float32)
    A_log, dt_bias = rng.standard_normal(3), rng.standard_normal(3)
    ba = x.astype(np.float64) @ w_ba.T.astype(np.float64)
    eg, ebeta = gated_delta.gates_reference(ba[:, 3:], ba[:, :3], A_log, dt_bias)
    g, beta = f32_gemm.gates_reference(x, w_ba, A_log, dt_bias)
    assert_close("g", eg, g, 1e-6, 1e-6)
    assert_close("beta", ebeta, beta, 1e-6, 1e-6)


@pytest.mark.parametrize("args", [
    (np.zeros((2, 8)), np.zeros((3, 8), np.float32)),
    (np.zeros((2, 8), np.float32), np.zeros((3, 9), np.float32)),
    (np.zeros((2, 8), np.float32), np.zeros((0, 8), np.float32)),
], ids=["float64", "k-mismatch", "no-outputs"])
def test_bad_arguments_raise(args):
    with pytest.raises(FermijitError):
        f32_gemm.gpu(*args)


def test_bad_mode_and_odd_gates_raise():
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(FermijitError):
        f32_gemm.gpu(x, np.zeros((3, 8), np.float32), "gates")
    with pytest.raises(FermijitError):
        f32_gemm.gates_gpu(x, np.zeros((3, 8), np.float32), np.zeros(1, np.float32),
                           np.zeros(1, np.float32))
