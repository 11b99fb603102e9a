"""MoE block: W4A8 cpu against the fp32-activation reference, and exactly against the same
computation done with the W4A8 references of its parts."""

import numba
import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.jit import cpu
from fermijit.jit.cpu import configure_threads
from fermijit.ops import matvec, moe, quant
from tests.numerics import assert_close, poisoned

# Q8 activations (twice: x and the SwiGLU output) cost ~1% per element; MoE outputs are sums of
# many such products, so relative to the output's scale a 3% bound is loose but meaningful.
W4A8_VS_FP32 = 3e-2
# cpu vs the composition of the parts' exact W4A8 references: fp32 rounding only.
RTOL = 1e-4


def _q4(rng, shape):
    qs, d = quant.quantize_q4_0(rng.standard_normal(shape).astype(np.float32) * 0.3)
    return qs, d


def _weights(rng, n_experts, hidden, inter, shared_inter):
    gu_qs, gu_d = _q4(rng, (n_experts, 2 * inter, hidden))
    dn_qs, dn_d = _q4(rng, (n_experts, hidden, inter))
    sgu_qs, sgu_d = _q4(rng, (1, 2 * shared_inter, hidden))
    sdn_qs, sdn_d = _q4(rng, (1, hidden, shared_inter))
    w_sg = rng.standard_normal(hidden).astype(np.float32) * 0.1
    return moe.MoeWeights(gu_qs, gu_d, dn_qs, dn_d, sgu_qs, sgu_d, sdn_qs, sdn_d, w_sg)


def _routing(rng, n_tok, n_experts, top_k):
    ids = np.stack([rng.choice(n_experts, top_k, replace=False) for _ in range(n_tok)])
    weights = rng.uniform(0.05, 1, (n_tok, top_k)).astype(np.float32)
    return ids.astype(np.int32), weights / weights.sum(axis=1, keepdims=True)


def _w4a8_reference(x, ids, weights, w):
    """The same math from the parts' W4A8 references (matvec.reference quantises activations)."""
    def ffn(gu_qs, gu_d, dn_qs, dn_d, xt):
        gu = matvec.reference(gu_qs, gu_d, xt).astype(np.float32)
        g, u = np.split(gu, 2)
        h = (g / (np.float32(1) + np.exp(-g)) * u).astype(np.float32)
        return matvec.reference(dn_qs, dn_d, h)

    y = np.zeros(x.shape)
    for t, xt in enumerate(x):
        gate = 1 / (1 + np.exp(-(xt.astype(np.float64) @ w.shared_gate)))
        y[t] = gate * ffn(*(a[0] for a in w.shared), xt)
        for e, wt in zip(ids[t], weights[t]):
            y[t] += wt * ffn(w.gate_up_qs[e], w.gate_up_d[e], w.down_qs[e], w.down_d[e], xt)
    return y


# Shapes with the shared expert of the routed experts' width (Is = I) and of its own.
SHAPES = {"T1-E8-H64-I32": (1, 8, 64, 32, 64, 2), "T1-E16-H256-I128": (1, 16, 256, 128, 96, 4),
          "T1-E16-H128-I64-shared-fused": (1, 16, 128, 64, 64, 4),
          "T7-E8-H64-I32": (7, 8, 64, 32, 32, 3), "T20-E12-H128-I64": (20, 12, 128, 64, 64, 2),
          "T45-E16-H384-I96": (45, 16, 384, 96, 256, 2)}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_matches_references(rng, shape):
    n_tok, n_experts, hidden, inter, shared_inter, top_k = shape
    w = _weights(rng, n_experts, hidden, inter, shared_inter)
    ids, weights = _routing(rng, n_tok, n_experts, top_k)
    x = rng.standard_normal((n_tok, hidden)).astype(np.float32)
    out = poisoned((n_tok, hidden))
    moe.cpu(x, ids, weights, w, out=out)
    exact = _w4a8_reference(x, ids, weights, w)
    assert_close("moe vs w4a8 parts", exact, out, atol=RTOL * np.abs(exact).max(), rtol=RTOL)
    spec = moe.reference(x, ids, weights, w)
    assert_close("moe vs fp32 spec", spec, out, atol=W4A8_VS_FP32 * np.abs(spec).max(), rtol=0)


def test_decode_scratch_is_reused(rng):
    w = _weights(rng, 8, 64, 32, 32)
    ids, weights = _routing(rng, 1, 8, 2)
    scratch = moe.Scratch.make(w, 2)
    outs = []
    for _ in range(2):
        x = rng.standard_normal((1, 64)).astype(np.float32)
        outs.append(moe.cpu(x, ids, weights, w, out=poisoned((1, 64)), scratch=scratch))
        assert_close("moe decode", _w4a8_reference(x, ids, weights, w), outs[-1],
                     atol=RTOL * np.abs(outs[-1]).max(), rtol=RTOL)
    assert scratch.act_h is not None


def test_bad_inputs(rng):
    w = _weights(rng, 4, 64, 32, 32)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    ids, weights = np.array([[0, 4]], np.int32), np.full((1, 2), 0.5, np.float32)
    with pytest.raises(FermijitError, match="out of range"):
        moe.cpu(x, ids, weights, w)
    with pytest.raises(FermijitError, match="weights has shape"):
        moe.cpu(x, ids[:, :1] * 0, weights, w)
    with pytest.raises(FermijitError, match="inconsistent weight shapes"):
        moe.cpu(rng.standard_normal((1, 96)).astype(np.float32), ids * 0, weights,
                moe.MoeWeights(*w.routed, *w.shared, np.zeros(96, np.float32)))


BATCHED = {"B1-E8-H64-I32": (1, 8, 64, 32, 64, 2),
           "B3-E16-H128-I64-shared-fused": (3, 16, 128, 64, 64, 4),
           "B5-E12-H128-I64": (5, 12, 128, 64, 96, 3), "B8-E4-H64-I32": (8, 4, 64, 32, 32, 2)}


@pytest.mark.parametrize("shape", BATCHED.values(), ids=BATCHED.keys())
def test_batched_rows_are_decode_exactly(rng, shape):
    """Batched decode (model/batch.py) needs each row bit for bit what decode gives that row."""
    n_seq, n_experts, hidden, inter, shared_inter, top_k = shape
    w = _weights(rng, n_experts, hidden, inter, shared_inter)
    ids, weights = _routing(rng, n_seq, n_experts, top_k)
    ids[-1] = ids[0]  # two rows on the same experts: runs of several tokens per expert
    x = rng.standard_normal((n_seq, hidden)).astype(np.float32)
    out = moe.batched(x, ids, weights, w, out=poisoned((n_seq, hidden)))
    for b in range(n_seq):
        one = moe.cpu(x[b:b + 1], ids[b:b + 1], weights[b:b + 1], w)
        np.testing.assert_array_equal(out[b:b + 1], one, err_msg=f"row {b}")
    exact = _w4a8_reference(x, ids, weights, w)
    assert_close("moe batched vs w4a8 parts", exact, out, atol=RTOL * np.abs(exact).max(),
                 rtol=RTOL)


def test_batched_checks_expert_ids(rng):
    w = _weights(rng, 4, 64, 32, 32)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    with pytest.raises(FermijitError, match="out of range"):
        moe.batched(x, np.array([[0, 4]], np.int32), np.full((1, 2), 0.5, np.float32), w)


ISAS = cpu.variants_up_to(cpu.selected_isa())


@pytest.mark.parametrize("shared_inter", [96, 256, 64], ids=["Is=I", "Is>I", "Is<I"])
@pytest.mark.parametrize("isa", ISAS, ids=[i.label for i in ISAS])
def test_fused_decode_equals_its_launches_one_by_one(rng, isa, shared_inter):
    """The one-dispatch decode (the shared expert riding in the routed launches, of the routed
    experts' width or its own) is bit for bit the gathered launches, the SwiGLU, the
    quantisation and the combination called one by one, at 1 and 2 threads (the down launch's
    shares combine their own rows)."""
    n_experts, hidden, inter, top_k = 16, 160, 96, 4
    w = _weights(rng, n_experts, hidden, inter, shared_inter)
    ids, weights = _routing(rng, 1, n_experts, top_k)
    x = rng.standard_normal((1, hidden)).astype(np.float32)
    act = matvec.quantize_act(x, isa)
    outs = []
    before = numba.get_num_threads()
    try:
        for n in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            configure_threads(n)
            outs.append(poisoned((1, hidden)))
            moe.decode(x, act, ids, weights, w, outs[-1], moe.Scratch.make(w, top_k))
    finally:
        configure_threads(before)
    gu_bits, sgu_bits, dn_bits, sdn_bits = w.d_bits
    zero = np.zeros(1, np.int32)

    def expert_rows(gu_qs, gu_bits, dn_qs, dn_bits, idx, width):
        gu = matvec.gathered(gu_qs, gu_bits, idx, act, poisoned((idx.size, 2 * width)))
        h = poisoned((idx.size, width))
        moe._swiglu(gu, h)
        return matvec.gathered(dn_qs, dn_bits, idx, matvec.quantize_act(h, isa),
                               poisoned((idx.size, hidden)))

    routed = expert_rows(w.gate_up_qs, gu_bits, w.down_qs, dn_bits, ids[0], inter)
    shared = expert_rows(w.shared_gate_up_qs, sgu_bits, w.shared_down_qs, sdn_bits, zero,
                         shared_inter)
    want = poisoned((1, hidden))
    moe._combine(routed, weights[0], shared[0], x[0], w.shared_gate, want[0])
    for out in outs:
        assert np.array_equal(out, want)


ROWS_CASES = {  # (tokens, experts, hidden, inter, top-k, experts the last token shares, Is)
    "R2-H160-I96-shares2": (2, 16, 160, 96, 4, 2, 96),
    "R2-H160-I96-same": (2, 16, 160, 96, 4, 4, 96),
    "R2-H160-I96-apart": (2, 16, 160, 96, 4, 0, 96), "R3-H224-I64": (3, 12, 224, 64, 3, 1, 64),
    "R4-H96-I160": (4, 8, 96, 160, 3, 2, 160), "R2-H2080-I32": (2, 8, 2080, 32, 2, 1, 32),
    "R2-H384-I96-Is256": (2, 16, 384, 96, 2, 1, 256), "R3-H160-I96-Is32": (3, 8, 160, 96, 2, 1, 32)}


@pytest.mark.parametrize("isa", ISAS, ids=[i.label for i in ISAS])
@pytest.mark.parametrize("case", ROWS_CASES.values(), ids=ROWS_CASES.keys())
def test_fused_rows_are_decode_exactly(rng, isa, case):
    """A verify step's few tokens in one call (moe.rows_launch: the union of their experts, each
    read once for the tokens that chose it) give each token bit for bit its decode, at 1 and 2
    threads, on ragged shapes (H past the wide steps; I not a multiple of the tile's rows; the
    shared expert wider or narrower than the routed ones),
    tokens sharing experts (all of them, none), into NaN-poisoned outputs, twice (the scratch
    reused with other routing)."""
    n_tok, n_experts, hidden, inter, top_k, shared, shared_inter = case
    w = _weights(rng, n_experts, hidden, inter, shared_inter)
    before = numba.get_num_threads()
    s = moe.RowsScratch.make(w, top_k, n_tok)
    try:
        for _ in range(2):
            ids, weights = _routing(rng, n_tok, n_experts, top_k)
            if shared:  # the last token shares `shared` experts with the first
                rest = np.setdiff1d(np.arange(n_experts), ids[0])
                ids[-1] = np.concatenate([ids[0][:shared][::-1],
                                          rng.choice(rest, top_k - shared, replace=False)])
            x = rng.standard_normal((n_tok, hidden)).astype(np.float32)
            act = matvec.quantize_act(x, isa)
            want = []
            for t in range(n_tok):
                want.append(poisoned((1, hidden)))
                moe.decode(x[t:t + 1], matvec.quantize_act(x[t:t + 1], isa), ids[t:t + 1],
                           weights[t:t + 1], w, want[-1], moe.Scratch.make(w, top_k))
            for n in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
                configure_threads(n)
                out = poisoned((n_tok, hidden))
                kernel_, args = moe.rows_launch(x, act, ids, weights, w, out, s)
                kernel_(*args)
                for t in range(n_tok):
                    np.testing.assert_array_equal(out[t:t + 1], want[t],
                                                  err_msg=f"token {t}, {n} threads")
            exact = _w4a8_reference(x, ids, weights, w)
            assert_close("moe rows vs w4a8 parts", exact, out, atol=RTOL * np.abs(exact).max(),
                         rtol=RTOL)
    finally:
        configure_threads(before)


def test_rows_launch_checks(rng):
    w = _weights(rng, 8, 64, 32, 32)
    ids, weights = _routing(rng, 2, 8, 2)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    s = moe.RowsScratch.make(w, 2, 2)
    act = matvec.quantize_act(x)
    with pytest.raises(FermijitError, match="scratch"):
        moe.rows_launch(x, act, ids, weights, w, np.empty((2, 64), np.float32),
                        moe.RowsScratch.make(w, 2, 3))
    bad = ids.copy()
    bad[1, 0] = 8
    kernel_, args = moe.rows_launch(x, act, bad, weights, w, np.empty((2, 64), np.float32), s)
    with pytest.raises(IndexError):
        kernel_(*args)
