"""kernels_ptx/q4_gemm.ptx, dense mode, launched directly: out = x . dequant(W)^T against numpy.
(The expert modes are tested through ops.expert_matmul in tests/ops.)"""

import numpy as np
import pytest

from fermijit.ops.quant import dequantize_q4_0, quantize_q4_0
from tests.gpu import MARKS, report_error
from tests.numerics import assert_close, poisoned

pytestmark = MARKS

# Issue 5: GEMMs within 1e-4 relative; fp32 sums of up to 2048 products stay near 1e-6.
GEMM_REL = 1e-4

# (T, N, K): one token; ragged T and N around the 64 x 128 tile; the model's K = 2048.
SHAPES = {"T1-N1-K32": (1, 1, 32), "T70-N130-K64": (70, 130, 64),
          "T129-N300-K96": (129, 300, 96), "T65-N127-K2048": (65, 127, 2048)}


def dense(x, qs, d, out):
    from fermijit.jit import gpu

    n_tokens, k = x.shape
    n = qs.shape[0]
    y = gpu.output("test", out, (n_tokens, n))
    gpu.kernel("q4_gemm", MODE="dense")(
        (-(-n // 128), -(-n_tokens // 64)), (256,),
        gpu.to_device("test", "x", x, np.float32), gpu.to_device("test", "qs", qs, np.uint8),
        gpu.to_device("test", "d", d, np.float16), y, None, None, None, n_tokens, n, k)
    return gpu.result("test", y, out, False)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_dense_matches_numpy(rng, shape):
    n_tokens, n, k = shape
    x = rng.standard_normal((n_tokens, k)).astype(np.float32)
    qs, d = quantize_q4_0((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32))
    expected = x.astype(np.float64) @ dequantize_q4_0(qs, d).astype(np.float64).T
    actual = dense(x, qs, d, poisoned((n_tokens, n)))
    assert_close("y", expected, actual, atol=GEMM_REL * np.abs(expected).max(), rtol=GEMM_REL)
    report_error("q4_gemm dense y", expected, actual)
