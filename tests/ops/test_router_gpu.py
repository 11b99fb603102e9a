"""router.gpu (kernels_ptx/router.ptx) against the numpy reference (MODEL.md §4)."""

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.ops import router
from tests.gpu import needs_gpu, report_error
from tests.numerics import assert_close, poisoned

# Issue 5: elementwise ops within 1e-5 relative. k exponentials (ex2.approx, ~2^-22, of an
# fp32 difference times log2 e), a k-term sum and a division.
ATOL, RTOL = 1e-7, 1e-5

# (T, E, k): one token; the model (256 experts, 128 after REAP, top 8); ragged; k = 1 and k = E.
SHAPES = {"T1-E256-k8": (1, 256, 8), "T70-E128-k8": (70, 128, 8), "T65-E60-k5": (65, 60, 5),
          "T3-E9-k1": (3, 9, 1), "T4-E6-k6": (4, 6, 6)}


def check(logits, top_k, idx, weight):
    expected_idx, expected_weight = router.reference(logits, top_k)
    np.testing.assert_array_equal(idx, expected_idx)
    assert_close("router weight", expected_weight, weight, ATOL, RTOL)
    report_error("router weight", expected_weight, weight)


@needs_gpu
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_router_gpu(rng, shape):
    n_tokens, n_experts, top_k = shape
    logits = (2 * rng.standard_normal((n_tokens, n_experts))).astype(np.float32)
    out = (np.full((n_tokens, top_k), -1, np.int32), poisoned((n_tokens, top_k)))
    idx, weight = router.gpu(logits, top_k, out=out)
    assert idx is out[0] and weight is out[1]
    check(logits, top_k, idx, weight)


@needs_gpu
def test_ties_go_to_the_lower_expert(rng):
    """Logits from 6 values: many ties, broken by index as the reference does (stable sort)."""
    logits = rng.integers(0, 6, (50, 128)).astype(np.float32)
    check(logits, 8, *router.gpu(logits, 8))


@needs_gpu
def test_one_token_vector(rng):
    logits = rng.standard_normal(256).astype(np.float32)
    idx, weight = router.gpu(logits, 8)
    assert idx.shape == (8,) and weight.shape == (8,)
    check(logits, 8, idx, weight)


@pytest.mark.parametrize("args", [
    (np.zeros((2, 8)), 2), (np.zeros((2, 8), np.float32), 9), (np.zeros((2, 16), np.float32), 0),
    (np.zeros((2, 2, 8), np.float32), 2), (np.zeros((2, 8), np.float32), 2.0),
], ids=["float64", "k-past-E", "k-zero", "3d", "k-float"])
def test_bad_arguments_raise(args):
    with pytest.raises(FermijitError):
        router.gpu(*args)
