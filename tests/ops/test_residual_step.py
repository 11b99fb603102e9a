"""The fused sublayer-input step of decode: the add, the norm, the quantisation and the routing
bit for bit the ops one by one; the fp32 product close to float64 and the same whatever the
thread count."""

import numba
import numpy as np
import pytest

from fermijit.jit import cpu
from fermijit.jit.cpu import configure_threads
from fermijit.ops import fp32_rows, matvec, residual_step, rmsnorm, router
from tests.numerics import assert_close, poisoned

ISAS = cpu.variants_up_to(cpu.selected_isa())
EPS = 1e-6
# fp32 sums of H products vs float64: a few ulps of the sum of |terms| (H <= 4096).
PRODUCT_RTOL = 1e-5

CASES = {  # H, R (product rows), k (0: no routing)
    "H64-no-product": (64, 0, 0),
    "H96-R5-gates": (96, 5, 0),
    "H2080-R37-k3": (2080, 37, 3),
    "H256-R128-k8": (256, 128, 8),
}


def _inputs(rng, H, R):
    f = np.float32
    return (rng.standard_normal((1, H)).astype(f), rng.standard_normal((1, H)).astype(f),
            (0.3 * rng.standard_normal(H)).astype(f),
            (rng.standard_normal((R, H)) / np.sqrt(H)).astype(f))


def _fused(x, y, nw, w, k, isa):
    H, R = x.shape[1], w.shape[0]
    xn, p = poisoned((1, H)), poisoned((1, R))
    act = matvec.quantize_act(np.zeros((1, H), np.float32), isa)
    ids, weights = np.full((1, k), -1, np.int32), poisoned((1, k))
    residual_step.cpu(x, y, nw, EPS, xn, act, w, p, ids, weights)
    return xn, act, p, ids, weights


@pytest.mark.parametrize("isa", ISAS, ids=[i.label for i in ISAS])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_equals_the_ops_one_by_one(rng, case, isa):
    H, R, k = case
    x, y, nw, w = _inputs(rng, H, R)
    fx = x.copy()
    xn, act, p, ids, weights = _fused(fx, y, nw, w, k, isa)
    want_x = x + y
    want_xn = rmsnorm.cpu(want_x, nw, EPS)
    want_act = matvec.quantize_act(want_xn, isa)
    assert np.array_equal(fx, want_x)
    assert np.array_equal(xn, want_xn)
    for name in ("xq", "dx", "xsum8"):
        assert np.array_equal(getattr(act, name), getattr(want_act, name)), name
    _, ref_xn, ref_p = residual_step.reference(x, y, nw, EPS, w)
    assert_close("xn", ref_xn, xn, 1e-6, 1e-5)
    bound = PRODUCT_RTOL * (np.abs(w) @ np.abs(ref_xn[0]).astype(np.float64))
    assert_close("product", ref_p, p, bound.max() if R else 0, 0)
    if k:
        want_ids, want_w = router.cpu(p, k)
        assert np.array_equal(ids, want_ids) and np.array_equal(weights, want_w)


def test_without_add_leaves_x(rng):
    x, y, nw, w = _inputs(rng, 128, 4)
    fx = x.copy()
    xn, *_ = _fused(fx, None, nw, w, 0, ISAS[0])
    assert np.array_equal(fx, x)
    assert np.array_equal(xn, rmsnorm.cpu(x, nw, EPS))


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="one CPU: nothing to compare")
def test_product_is_the_same_for_any_thread_count(rng):
    x, y, nw, w = _inputs(rng, 2048, 129)
    before = numba.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            configure_threads(n)
            results.append(_fused(x.copy(), y, nw, w, 8, ISAS[0]))
    finally:
        configure_threads(before)
    for a, b in zip(*results):
        a, b = (a.xq, b.xq) if isinstance(a, matvec.Q8Act) else (a, b)
        assert np.array_equal(a, b)


def test_product_is_prefills_for_the_same_row(rng):
    """Decode's router logits are the bits prefill's product (ops.fp32_rows) gives that input row
    among others."""
    x, y, nw, w = _inputs(rng, 2048, 128)
    xn, _, p, _, _ = _fused(x.copy(), y, nw, w, 0, ISAS[0])
    rows = rng.standard_normal((9, 2048)).astype(np.float32)
    rows[5] = xn[0]
    assert np.array_equal(fp32_rows.cpu(rows, w)[5], p[0])
