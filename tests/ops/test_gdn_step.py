"""The fused GDN decode step: bit for bit the ops it chains, called one by one, and close to the
composition of their references."""

import numpy as np
import pytest

from fermijit.ops import conv1d, gated_delta, gdn_step, l2norm, matvec, rmsnorm
from tests.numerics import assert_close, poisoned

EPS, L2_EPS = 1e-6, 1e-6
RTOL = 1e-5  # fp32 kernels vs float64 references (each op's own test holds it to its own bound)


def _inputs(rng, Hk, Hv, dk, dv, taps=4):
    C = 2 * Hk * dk + Hv * dv
    f = np.float32
    return dict(
        mixed=rng.standard_normal((1, C)).astype(f), z=rng.standard_normal((1, Hv, dv)).astype(f),
        a=rng.standard_normal((1, Hv)).astype(f), b=rng.standard_normal((1, Hv)).astype(f),
        conv_w=(rng.standard_normal((C, taps)) * 0.5).astype(f),
        conv_state=rng.standard_normal((C, taps - 1)).astype(f),
        A_log=rng.uniform(0, 2, Hv).astype(f), dt_bias=rng.standard_normal(Hv).astype(f),
        norm_w=rng.uniform(0.5, 1.5, dv).astype(f),
        state=(rng.standard_normal((Hv, dk, dv)) * 0.1).astype(f))


@pytest.mark.parametrize("shape", [(2, 4, 32, 32), (4, 4, 64, 32), (2, 6, 32, 64),
                                   (2, 2, 32, 48)],
                         ids=["Hk2-Hv4-d32", "Hk4-Hv4-dk64-dv32", "Hk2-Hv6-dk32-dv64",
                              "Hk2-Hv2-dk32-dv48"])  # dv48: blocks span heads (quantised after)
def test_equals_the_ops_one_by_one_and_the_references(rng, shape):
    Hk, Hv, dk, dv = shape
    x = _inputs(rng, Hk, Hv, dk, dv)
    # the ops one by one, as model/forward.py's prefill path calls them
    mixed, conv_state, state = x["mixed"].copy(), x["conv_state"].copy(), x["state"].copy()
    conv1d.cpu(mixed, x["conv_w"], conv_state, out=mixed)
    nk = Hk * dk
    q = np.ascontiguousarray(mixed[:, :nk].reshape(1, Hk, dk))
    k = np.ascontiguousarray(mixed[:, nk:2 * nk].reshape(1, Hk, dk))
    v = np.ascontiguousarray(mixed[:, 2 * nk:].reshape(1, Hv, dv))
    l2norm.cpu(q, L2_EPS, 1 / np.sqrt(dk), out=q)
    l2norm.cpu(k, L2_EPS, out=k)
    g, beta = gated_delta.gates_cpu(x["a"], x["b"], x["A_log"], x["dt_bias"])
    o, _ = gated_delta.cpu(q, k, v, g, beta, state)
    rmsnorm.gated_cpu(o, x["z"], x["norm_w"], EPS, out=o)
    act = matvec.quantize_act(o.reshape(1, -1))
    # fused
    f_mixed, f_conv, f_state = x["mixed"].copy(), x["conv_state"].copy(), x["state"].copy()
    scratch = [poisoned(s) for s in ((1, Hk, dk), (1, Hk, dk), (1, Hv, dv), (1, Hv), (1, Hv))]
    f_o = poisoned((1, Hv, dv))
    f_act = matvec.quantize_act(np.zeros((1, Hv * dv), np.float32))
    gdn_step.cpu(f_mixed, x["z"], x["a"], x["b"], x["conv_w"], f_conv, x["A_log"], x["dt_bias"],
                 x["norm_w"], EPS, L2_EPS, f_state, *scratch, f_o, f_act)
    for name, want, got in (("o", o, f_o), ("conv state", conv_state, f_conv),
                            ("state", state, f_state), ("xq", act.xq, f_act.xq),
                            ("dx", act.dx, f_act.dx), ("xsum8", act.xsum8, f_act.xsum8)):
        assert np.array_equal(want, got), name
    ref_o, ref_conv, ref_state = gdn_step.reference(
        x["mixed"], x["z"], x["a"], x["b"], x["conv_w"], x["conv_state"], x["A_log"],
        x["dt_bias"], x["norm_w"], EPS, L2_EPS, x["state"])
    assert_close("o", ref_o, f_o, RTOL * np.abs(ref_o).max(), RTOL)
    assert_close("conv state", ref_conv, f_conv, 0, 0)
    assert_close("state", ref_state, f_state, RTOL * np.abs(ref_state).max(), RTOL)


@pytest.mark.parametrize("shape", [(3, 6, 32, 32), (1, 2, 64, 32)], ids=["Hk3-Hv6", "Hk1-Hv2"])
def test_thread_count_changes_no_bit(rng, shape):
    # Each thread runs its key heads' channels and value heads, conv to norm: an odd split (3 key
    # heads on 2 threads) and a thread with none (1 key head) give one thread's bits.
    import numba

    Hk, Hv, dk, dv = shape
    x = _inputs(rng, Hk, Hv, dk, dv)
    results = []
    before = numba.get_num_threads()
    try:
        for n in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
            numba.set_num_threads(n)
            mixed, conv, state = x["mixed"].copy(), x["conv_state"].copy(), x["state"].copy()
            scratch = [poisoned(s) for s in ((1, Hk, dk), (1, Hk, dk), (1, Hv, dv), (1, Hv),
                                             (1, Hv))]
            o = poisoned((1, Hv, dv))
            act = matvec.quantize_act(np.zeros((1, Hv * dv), np.float32))
            gdn_step.cpu(mixed, x["z"], x["a"], x["b"], x["conv_w"], conv, x["A_log"],
                         x["dt_bias"], x["norm_w"], EPS, L2_EPS, state, *scratch, o, act)
            results.append((o, conv, state, act.xq, act.dx))
    finally:
        numba.set_num_threads(before)
    for one, two in zip(*results):
        np.testing.assert_array_equal(one, two)
    ref_o, _, _ = gdn_step.reference(x["mixed"], x["z"], x["a"], x["b"], x["conv_w"],
                                     x["conv_state"], x["A_log"], x["dt_bias"], x["norm_w"], EPS,
                                     L2_EPS, x["state"])
    assert_close("o", ref_o, results[0][0], RTOL * np.abs(ref_o).max(), RTOL)
