"""matmul.cpu: the CPU prefill's W4A8 GEMM against the fp32-activation spec."""

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.ops import matmul, matvec
from fermijit.ops.quant import quantize_q4_0
from tests.numerics import assert_close, poisoned

# 8-bit activations: each block's rounding error is at most dx/2 = max|x|/254 per element; over
# K products it averages out to ~1/(127·sqrt(3)) of the scale. 2% of max|y| bounds it loosely.
W4A8_VS_FP32 = 2e-2
EXACT = 1e-5  # against the W4A8 reference: fp32 rounding only

SHAPES = {"T2-N5-K64": (2, 5, 64), "T17-N33-K544": (17, 33, 544), "T64-N128-K2048": (64, 128, 2048)}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_cpu_matches_references(rng, shape):
    n_tokens, n, k = shape
    x = rng.standard_normal((n_tokens, k)).astype(np.float32)
    qs, d = quantize_q4_0((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32))
    y = matmul.cpu(x, qs, d, out=poisoned((n_tokens, n)))
    spec = matmul.reference(x, qs, d)
    assert_close("w4a8 vs fp32", spec, y, atol=W4A8_VS_FP32 * np.abs(spec).max(), rtol=0)
    exact = matvec.reference(qs, d, x)
    assert_close("w4a8 exact", exact, y, atol=EXACT * np.abs(exact).max(), rtol=EXACT)


def test_cpu_wants_tokens_by_inputs(rng):
    qs, d = quantize_q4_0(rng.standard_normal((4, 64)).astype(np.float32))
    with pytest.raises(FermijitError, match="must be 2-D"):
        matmul.cpu(np.zeros(64, np.float32), qs, d)
