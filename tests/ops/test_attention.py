"""Causal GQA attention with the output gate: cpu against the numpy reference (prefill, decode
after a prefix, split decode) over an fp32 cache and a Q8_0 one (every ISA variant), the
reference against torch's attention, bad inputs."""

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.jit import cpu as jit_cpu
from fermijit.ops import attention, kv_quant
from tests.numerics import assert_close, poisoned

ISAS = jit_cpu.variants_up_to(jit_cpu.selected_isa())

# fp32 kernel (online softmax, fp32 sums over up to 3000 keys) vs float64 reference, |o| <= ~4.
# Unit-variance scores: measured max abs error 8e-7 over 8 seeds; ~6x margin.
ATOL, RTOL = 2e-6, 2e-5
# Peaked scores (std 10): the fp32 rounding of the score itself (~|score| 2^-24 sqrt(D)) is
# multiplied by exp, whatever the kernel does; measured 4.4e-6; ~10x margin.
PEAKED_ATOL, PEAKED_RTOL = 2e-5, 2e-4
# The reference against torch's fp32 attention.
ORACLE_ATOL, ORACLE_RTOL = 1e-5, 1e-4

# (T, Hq, Hkv, D, S, start, q scale): GQA groups 1, 2, 8; caches longer than the keys used;
# several 64-key blocks; decode long enough to be split across threads.
CASES = {
    "T1-Hq16-Hkv2-D256-S3000-start2500": (1, 16, 2, 256, 3000, 2500, 1.0),
    "T1-Hq8-Hkv1-D64-S1100-start1030-peaked": (1, 8, 1, 64, 1100, 1030, 10.0),
    "T1-Hq4-Hkv4-D60-S5-start0": (1, 4, 4, 60, 5, 0, 1.0),
    "T63-Hq4-Hkv2-D60-S63-start0": (63, 4, 2, 60, 63, 0, 1.0),
    "T37-Hq8-Hkv1-D32-S100-start20": (37, 8, 1, 32, 100, 20, 1.0),
    "T150-Hq4-Hkv2-D48-S200-start30-peaked": (150, 4, 2, 48, 200, 30, 10.0),
    "T5-Hq6-Hkv6-D16-S9-start4": (5, 6, 6, 16, 9, 4, 1.0),
    # groups of 3 and 5 heads: the score and weighted-value tiles' last partial tile of heads
    "T40-Hq6-Hkv2-D64-S70-start10": (40, 6, 2, 64, 70, 10, 1.0),
    "T9-Hq10-Hkv2-D32-S40-start5": (9, 10, 2, 32, 40, 5, 1.0),
}


def _inputs(rng, T, Hq, Hkv, D, S, q_scale=1.0):
    """q, k, v ~ N(0, 1) so scores ~ N(0, q_scale^2); the gate spans sigmoid's range."""
    q = rng.standard_normal((T, Hq, D)) * q_scale
    k = rng.standard_normal((Hkv, S, D))
    v = rng.standard_normal((Hkv, S, D))
    gate = rng.standard_normal((T, Hq, D)) * 3
    return [x.astype(np.float32) for x in (q, k, v, gate)]


def _q8(k, v):
    return kv_quant.reference(k), kv_quant.reference(v)


def _f64(xs):
    return [x.astype(np.float64) for x in xs]


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_cpu_matches_reference(rng, case):
    T, Hq, Hkv, D, S, start, q_scale = case
    q, k, v, gate = _inputs(rng, T, Hq, Hkv, D, S, q_scale)
    expected = attention.reference(*_f64([q, k, v, gate]), start)
    out = poisoned((T, Hq, D))
    o = attention.cpu(q, k, v, gate, start, out=out)
    assert o is out
    atol, rtol = (ATOL, RTOL) if q_scale == 1 else (PEAKED_ATOL, PEAKED_RTOL)
    assert_close("o", expected, o, atol, rtol)


def test_split_decode_is_exercised():
    """The S1100 decode case above is split into key ranges whatever the thread count."""
    assert attention.n_ranges(1031) > 1


def test_decode_one_token_at_a_time_after_prefill(rng):
    """A prefill of 40 queries then decode steps at start 40, 41, 42: one pass over 43."""
    q, k, v, gate = _inputs(rng, 43, 4, 2, 32, 50)
    expected = attention.reference(*_f64([q, k, v, gate]), 0)
    o = poisoned(q.shape)
    attention.cpu(q[:40], k, v, gate[:40], 0, out=o[:40])
    for t in range(40, 43):
        attention.cpu(q[t:t + 1], k, v, gate[t:t + 1], t, out=o[t:t + 1])
    assert_close("o", expected, o, ATOL, RTOL)


@pytest.mark.parametrize("heads", [(6, 2), (10, 2), (16, 2)], ids=["G3", "G5", "G8"])
def test_a_query_has_the_same_bits_in_any_pass(rng, heads):
    """Each query of a 600-query pass (1 to 3 key ranges) computed alone (a decode step), in a
    short pass (every key range an item) or in a longer one (a query's ranges in turn) gives the
    whole pass's bits: a prompt's output does not depend on how it is cut into passes."""
    Hq, Hkv = heads
    q, k, v, gate = _inputs(rng, 600, Hq, Hkv, 64, 610)
    whole = attention.cpu(q, k, v, gate, 0)
    for t in (0, 3, 255, 256, 300, 511, 512, 599):
        assert np.array_equal(attention.cpu(q[t:t + 1], k, v, gate[t:t + 1], t), whole[t:t + 1]), t
    for lo, hi in ((30, 39), (250, 259), (252, 257), (508, 517), (590, 595)):
        assert np.array_equal(attention.cpu(q[lo:hi], k, v, gate[lo:hi], lo), whole[lo:hi]), lo


def test_reference_matches_torch(rng):
    torch = pytest.importorskip("torch")
    T, Hq, Hkv, D, S, start = 7, 4, 2, 16, 12, 5
    q, k, v, gate = _inputs(rng, T, Hq, Hkv, D, S)
    tq = torch.from_numpy(q).transpose(0, 1)                            # [Hq, T, D]
    tk, tv = (torch.from_numpy(x[:, :start + T]).repeat_interleave(Hq // Hkv, dim=0)
              for x in (k, v))                                          # [Hq, L, D]
    allowed = torch.arange(start + T)[None, :] <= start + torch.arange(T)[:, None]
    o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=allowed)
    o = o.transpose(0, 1) * torch.sigmoid(torch.from_numpy(gate))
    expected = attention.reference(*_f64([q, k, v, gate]), start)
    assert_close("o", expected, o.numpy(), ORACLE_ATOL, ORACLE_RTOL)


def test_bad_inputs(rng):
    q, k, v, gate = _inputs(rng, 3, 4, 2, 8, 10)
    with pytest.raises(FermijitError, match="dtype"):
        attention.cpu(q.astype(np.float64), k, v, gate, 0)
    with pytest.raises(FermijitError, match="k has shape"):
        attention.cpu(q, k[:, :, :4].copy(), v, gate, 0)
    with pytest.raises(FermijitError, match="v has shape"):
        attention.cpu(q, k, v[:, :9].copy(), gate, 0)
    with pytest.raises(FermijitError, match="gate has shape"):
        attention.cpu(q, k, v, gate[:2].copy(), 0)
    with pytest.raises(FermijitError, match="multiple"):
        attention.cpu(q, *_inputs(rng, 3, 4, 3, 8, 10)[1:3], gate, 0)
    with pytest.raises(FermijitError, match="contiguous"):
        attention.cpu(q, k[:, :5], v[:, :5], gate, 0)   # a slice of a longer cache
    for start in (8, -1, 2.0):
        with pytest.raises(FermijitError, match="start"):
            attention.cpu(q, k, v, gate, start)
    with pytest.raises(FermijitError, match="out"):
        attention.cpu(q, k, v, gate, 0, out=poisoned((3, 4, 9)))


# --- the Q8_0 cache -----------------------------------------------------------------------------

# Q8_0 kernel (integer block sums, fp32 scaling and softmax) vs the float64 reference over the same
# codes: measured max abs error 3.3e-7 (unit-variance scores), as the fp32 kernel's: its margins.
# Head dims of whole 32-blocks: 256 (the full-size model: two full AVX2 steps, one AVX-512
# step), 64 and 32 (the default and tiny models: halving steps only), 96 and 160 (a full SSE or
# AVX2 step and halving ones).
Q8_CASES = {
    "T1-Hq16-Hkv2-D256-S3000-start2500": (1, 16, 2, 256, 3000, 2500, 1.0),
    "T1-Hq8-Hkv1-D64-S1100-start1030-peaked": (1, 8, 1, 64, 1100, 1030, 10.0),
    "T37-Hq8-Hkv1-D32-S100-start20": (37, 8, 1, 32, 100, 20, 1.0),
    "T40-Hq6-Hkv2-D64-S70-start10": (40, 6, 2, 64, 70, 10, 1.0),
    "T9-Hq10-Hkv2-D96-S40-start5": (9, 10, 2, 96, 40, 5, 1.0),
    "T63-Hq4-Hkv2-D160-S63-start0": (63, 4, 2, 160, 63, 0, 1.0),
    "T1-Hq3-Hkv3-D32-S5-start0": (1, 3, 3, 32, 5, 0, 1.0),
    # 12 heads a kv head, 3 blocks: decode's values in registers by tiles of 4 heads (AVX-512)
    "T1-Hq12-Hkv1-D96-S300-start290": (1, 12, 1, 96, 300, 290, 1.0),
}


@pytest.mark.parametrize("isa", ISAS, ids=[i.label for i in ISAS])
@pytest.mark.parametrize("case", Q8_CASES.values(), ids=Q8_CASES.keys())
def test_q8_cache_matches_reference(rng, isa, case):
    T, Hq, Hkv, D, S, start, q_scale = case
    q, k, v, gate = _inputs(rng, T, Hq, Hkv, D, S, q_scale)
    k8, v8 = _q8(k, v)
    expected = attention.reference(q, k8, v8, gate.astype(np.float64), start)
    out = poisoned((T, Hq, D))
    assert attention.cpu(q, k8, v8, gate, start, out=out, isa=isa) is out
    atol, rtol = (ATOL, RTOL) if q_scale == 1 else (PEAKED_ATOL, PEAKED_RTOL)
    assert_close(f"o[{isa.label}]", expected, out, atol, rtol)


def test_q8_reference_is_the_dequantised_attention(rng):
    """The spec: the query rounded to Q8_0 as the keys are, then fp attention over the
    dequantised cache; and that stays near the fp32 cache's attention (~1 % of |o| here)."""
    q, k, v, gate = _inputs(rng, 5, 4, 2, 64, 20)
    k8, v8 = _q8(k, v)
    q8 = kv_quant.reference(q).dequantize(np.float64)
    expected = attention.reference(q8, k8.dequantize(np.float64), v8.dequantize(np.float64),
                                   gate.astype(np.float64), 15)
    np.testing.assert_array_equal(attention.reference(q, k8, v8, gate.astype(np.float64), 15),
                                  expected)
    f32 = attention.reference(*_f64([q, k, v, gate]), 15)
    assert np.abs(expected - f32).max() < 0.05


@pytest.mark.parametrize("isa", ISAS, ids=[i.label for i in ISAS])
@pytest.mark.parametrize("heads", [(16, 2), (6, 2), (20, 2)], ids=["G8", "G3", "G10"])
def test_q8_query_has_the_same_bits_in_any_pass(rng, heads, isa):
    """As test_a_query_has_the_same_bits_in_any_pass, over a Q8_0 cache, for every variant: a
    decode step (one query) reads the values by a path of its own (weighted_q8_rows)."""
    Hq, Hkv = heads
    q, k, v, gate = _inputs(rng, 530, Hq, Hkv, 96, 540)
    k8, v8 = _q8(k, v)
    whole = attention.cpu(q, k8, v8, gate, 0, isa=isa)
    for t in (0, 255, 256, 529):
        assert np.array_equal(attention.cpu(q[t:t + 1], k8, v8, gate[t:t + 1], t, isa=isa),
                              whole[t:t + 1]), t
    for lo, hi in ((250, 259), (508, 517)):
        assert np.array_equal(attention.cpu(q[lo:hi], k8, v8, gate[lo:hi], lo, isa=isa),
                              whole[lo:hi]), lo


def test_q8_bad_inputs(rng):
    q, k, v, gate = _inputs(rng, 3, 4, 2, 32, 10)
    k8, v8 = _q8(k, v)
    with pytest.raises(FermijitError, match="k is Q8_0 rows, v is not"):
        attention.cpu(q, k8, v, gate, 0)
    with pytest.raises(FermijitError, match="whole 32-blocks"):
        attention.cpu(q[..., :16].copy(), k8, v8, gate[..., :16].copy(), 0)
    with pytest.raises(FermijitError, match="v scales has shape"):
        attention.cpu(q, k8, kv_quant.Q8Rows(v8.qs, v8.d[:, :5].copy()), gate, 0)
    with pytest.raises(FermijitError, match="k codes has dtype"):
        attention.cpu(q, kv_quant.Q8Rows(k8.qs.view(np.uint8), k8.d), v8, gate, 0)
    with pytest.raises(FermijitError, match="start"):
        attention.cpu(q, k8, v8, gate, 8)


@pytest.mark.parametrize("q8", [False, True], ids=["f32", "q8_0"])
def test_tiles_of_any_size_give_the_same_bits(rng, monkeypatch, q8):
    """A prefill item takes a tile of queries (issue 31 item 5): each query has the same bits
    in a tile of 1, 5 or 16, with any thread count's tiles."""
    q, k, v, gate = _inputs(rng, 300, 8, 2, 64, 700)
    if q8:
        k, v = _q8(k, v)
    outs = []
    for tile in (1, 5, 16):
        monkeypatch.setattr(attention, "tile_queries", lambda n_queries, n_kv_heads: tile)
        outs.append(attention.cpu(q, k, v, gate, 390))
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("T", [1, 5, 40, 67])
def test_rounded_queries_are_the_cache_rounding_on_one_thread_or_many(rng, T):
    """A prefill pass's queries are rounded over the threads (from omp.ROWS_MIN rows), a decode
    step's on its own thread: kv_quant's rounding either way, 128 · the codes' sums beside."""
    q = rng.standard_normal((T, 3, 64)).astype(np.float32)
    q[0, 1, :32] = 0  # a block of zeros: scale 0, codes 0
    q[-1, 2, 32:] *= 1e4
    qq = np.full((T, 3, 64), 99, np.int8)
    qd = np.full((T, 3, 2), np.nan, np.float32)
    qc = np.full((T, 3, 2), -7, np.int32)
    attention._quantize_queries(q, qq, qd, qc)
    expected = kv_quant.reference(q)
    np.testing.assert_array_equal(qq, expected.qs)
    np.testing.assert_array_equal(qd, expected.d)
    sums = expected.qs.reshape(T, 3, 2, 32).astype(np.int32).sum(axis=-1)
    np.testing.assert_array_equal(qc, 128 * sums)


@pytest.mark.parametrize("isa", [jit_cpu.Isa.AVX512VNNI, jit_cpu.Isa.AVX2],
                         ids=["flipped", "signed"])
@pytest.mark.parametrize("D", [256, 96, 32])
@pytest.mark.parametrize("n", [64, 63, 17, 16, 9, 1])
def test_keys_transposed_for_scores_by_key(rng, D, n, isa):
    """The keys' transposition for scores by key (attention_simd.make_transposed_keys; plain
    vector IR, so both run on any machine): dword w of block b of key i at kt[b, w, i], the
    bytes flipped to code + 128 for VNNI, or as they are with their magnitudes in ka for AVX2;
    the scales at kdt[b, i]; lanes past n repeat the last key. nb 8 takes the scales' transpose
    path, others the scalar one."""
    S, j0 = 200, 70
    k = kv_quant.reference(rng.standard_normal((S, D)).astype(np.float32))
    k.qs[j0, :4] = [-128, 127, 0, -1]  # -128's magnitude is 128, read as unsigned
    nb = D // kv_quant.BLOCK
    kt = np.full((nb, 8, attention.BLOCK), 12345, np.int32)
    ka = np.full((nb, 8, attention.BLOCK), 12345, np.int32)
    kdt = np.full((nb, attention.BLOCK), np.nan, np.float32)
    _, transposed = attention.q8_score_kernels(isa, f"test-{isa.label}")
    transposed((k.qs[None], k.d[None]), 0, j0, n, (kt, kdt, ka))
    keys = j0 + np.minimum(np.arange(attention.BLOCK), n - 1)           # a lane's key

    def laid_out(codes):  # int8 [S, D] -> [nb, 8, BLOCK] int32, as kt
        per_dword = codes.reshape(S, nb, 8, 4)[keys].transpose(1, 2, 0, 3)
        return np.ascontiguousarray(per_dword).view(np.int32)[..., 0]

    if isa is jit_cpu.Isa.AVX512VNNI:
        np.testing.assert_array_equal(kt, laid_out((k.qs.view(np.uint8) ^ 0x80).view(np.int8)))
        assert (ka == 12345).all()
    else:
        np.testing.assert_array_equal(kt, laid_out(k.qs))
        magnitude = np.abs(k.qs.astype(np.int16)).astype(np.uint8).view(np.int8)
        np.testing.assert_array_equal(ka, laid_out(magnitude))
    np.testing.assert_array_equal(kdt, k.d[keys].T)
