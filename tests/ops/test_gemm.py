"""The prefill W4A8 GEMM (ops.gemm): every ISA this CPU runs against the exact-integer reference,
its activation offsets, and results that do not depend on threads or token tiling."""

import numba
import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.jit import cpu, omp
from fermijit.ops import gemm, matvec, quant
from tests.numerics import assert_close, poisoned
from tests.ops.test_matvec import q4_weights

ISAS = [i for i in cpu.variants_up_to(cpu.selected_isa())]
# Exact integer block sums; fp32 rounding of one multiply and one (fused) multiply-add per block
# and row: a few ulps of the row's scale, as the GEMV.
RTOL = 1e-5
# (rows, K, tokens): a partial row group for every ISA (37, 5), K of 3 blocks and K past several
# panels of groups (2048: 70 rows are 2 panels at AVX-512 and AVX2 widths), tokens past whole
# tiles and past one block of tokens (70 at K = 2048), K = 416 and 800 with whole wide steps
# and a natural-order tail in Q8Act's layout.
SHAPES = {"R37-K96-T11": (37, 96, 11), "R5-K64-T2": (5, 64, 2), "R16-K416-T8": (16, 416, 8),
          "R70-K2048-T19": (70, 2048, 19), "R20-K2048-T70": (20, 2048, 70),
          "R24-K800-T3": (24, 800, 3)}


@pytest.mark.parametrize("isa", ISAS, ids=[i.label for i in ISAS])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_matches_reference(rng, isa, shape):
    rows, k, n_tok = shape
    qs, d = q4_weights(rng, rows, k)
    x = rng.standard_normal((n_tok, k)).astype(np.float32)
    out = matvec.product(matvec.Q4Matrix.of(qs, d), matvec.quantize_act(x, isa),
                         poisoned((n_tok, rows)))
    expected = matvec.reference(qs, d, x)
    assert_close(f"gemm[{isa.label}]", expected, out, atol=RTOL * np.abs(expected).max(),
                 rtol=RTOL)


@pytest.mark.parametrize("isa", ISAS, ids=[i.label for i in ISAS])
def test_x_offsets_find_each_block_in_the_layout(rng, isa):
    """The bytes at a block's two offsets are its elements 0..15 and 16..31, for K covering the
    wide steps, half-width steps (AVX-512) and the natural-order tail."""
    k = 32 * 29
    x = rng.standard_normal((1, k)).astype(np.float32)
    act = matvec.quantize_act(x, isa)
    natural, _ = matvec.quantize_act_reference(x)
    offs = gemm.x_offsets(isa, k // 32)
    got = np.stack([np.concatenate([act.xq[0, lo:lo + 16], act.xq[0, hi:hi + 16]])
                    for lo, hi in offs])
    np.testing.assert_array_equal(got, natural[0])


def test_same_bits_whatever_threads_and_tokens(rng):
    """Rows never mix in a lane and tokens never mix in a tile: 1 and 2 threads, and a prefix of
    the tokens alone (other tiles, other tails), give the same bits."""
    rows, k, n_tok = 70, 512, 21
    qs, d = q4_weights(rng, rows, k)
    w = matvec.Q4Matrix.of(qs, d)
    x = rng.standard_normal((n_tok, k)).astype(np.float32)
    act = matvec.quantize_act(x)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = matvec.product(w, act, poisoned((n_tok, rows)))
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        two = matvec.product(w, act, poisoned((n_tok, rows)))
    finally:
        numba.set_num_threads(before)
    np.testing.assert_array_equal(one, two)
    part = matvec.product(w, matvec.quantize_act(x[:5]), poisoned((5, rows)))
    np.testing.assert_array_equal(one[:5], part)


@pytest.mark.parametrize("isa", ISAS, ids=[i.label for i in ISAS])
@pytest.mark.parametrize("k", [1024, 800])
def test_like_gemv_gives_the_gemv_bits(rng, isa, k):
    """`like_gemv` (batched decode's choice) and the Q8_0 head's few-token tile (a verify
    step's rows): each token's row is the GEMV's, bit for bit, at every token count (tiles of
    2, 3 and 4 tokens, and 4 plus tails), rows with a tail; K of whole wide steps, and with SSE
    steps and one-block tails (800). On an AVX-512 VNNI process AVX2's few-token tiles take
    vpdpbusd (matvec._few_tokens_vec): still the AVX2 GEMV's bits."""
    rows, n_tok = 13, 6
    qs, d = q4_weights(rng, rows, k)
    w = matvec.Q4Matrix.of(qs, d)
    q8s, q8d = quant.quantize_q8_0(rng.standard_normal((rows, k)).astype(np.float32))
    x = rng.standard_normal((n_tok, k)).astype(np.float32)
    for n in range(2, n_tok + 1):
        act = matvec.quantize_act(x[:n], isa)
        y = matvec.product(w, act, poisoned((n, rows)), like_gemv=True)
        y8 = matvec.q8_cpu(q8s, q8d, act, out=poisoned((n, rows)))
        for t in range(n):
            one = matvec.quantize_act(x[t], isa)
            np.testing.assert_array_equal(y[t], matvec.product(w, one, poisoned(rows)))
            np.testing.assert_array_equal(y8[t], matvec.q8_cpu(q8s, q8d, one,
                                                               out=poisoned(rows)))
    isa = matvec.default_isa(1)  # decode's variant, as batched decode quantises its rows
    x = x[:6]
    y = matvec.product(w, matvec.quantize_act(x, isa), poisoned((n_tok, rows)), like_gemv=True)
    offsets = np.array([0, 4, n_tok], np.int64)
    qs2, d2 = np.stack([qs, qs]), np.stack([d, d]).view(np.uint16)
    g = matvec.grouped(qs2, d2, offsets, matvec.quantize_act(x, isa), poisoned((n_tok, rows)),
                       like_gemv=True)
    np.testing.assert_array_equal(g, y)


@pytest.mark.parametrize("isa", ISAS, ids=[i.label for i in ISAS])
def test_grouped_every_tail(rng, isa):
    """Experts with 0-15 tokens: every remainder of a tile (half, quarter and single-token
    tiles), rows not whole groups."""
    counts = [7, 15, 6, 3, 0, 1, 8, 12, 5, 2, 14, 9, 4, 11, 13, 10]
    n_experts, rows, k = len(counts), 37, 96
    qs, d = q4_weights(rng, n_experts * rows, k)
    qs, d = qs.reshape(n_experts, rows, -1), d.reshape(n_experts, rows, -1)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    x = rng.standard_normal((offsets[-1], k)).astype(np.float32)
    out = matvec.grouped_cpu(qs, d, offsets, x, out=poisoned((offsets[-1], rows)), isa=isa)
    expected = matvec.grouped_reference(qs, d, offsets, x)
    assert_close("grouped", expected, out, atol=RTOL * np.abs(expected).max(), rtol=RTOL)


@pytest.mark.parametrize("isa", ISAS, ids=[i.label for i in ISAS])
def test_grouped_reads_rows_in_place(rng, isa):
    """x_rows: each slot reads its token's activation row where it is, the same bits as the
    gathered copy (the MoE's slots sorted by expert: tokens repeated, out of order)."""
    counts = [9, 0, 3, 17, 1]
    n_experts, rows, k, n_tok = len(counts), 21, 384, 11
    qs, d = q4_weights(rng, n_experts * rows, k)
    qs, d_bits = qs.reshape(n_experts, rows, -1), d.reshape(n_experts, rows, -1).view(np.uint16)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    x_rows = rng.integers(0, n_tok, offsets[-1]).astype(np.int64)
    act = matvec.quantize_act(rng.standard_normal((n_tok, k)).astype(np.float32), isa)
    in_place = matvec.grouped(qs, d_bits, offsets, act, poisoned((offsets[-1], rows)),
                              x_rows=x_rows)
    copied = matvec.grouped(qs, d_bits, offsets, act.rows(x_rows), poisoned((offsets[-1], rows)))
    np.testing.assert_array_equal(in_place, copied)
    past_end = x_rows.copy()
    past_end[5] = n_tok
    for bad in (x_rows[:-1], past_end, x_rows.astype(np.int32)):
        with pytest.raises(FermijitError):
            matvec.grouped(qs, d_bits, offsets, act, np.empty((offsets[-1], rows), np.float32),
                           x_rows=bad)
    with pytest.raises(FermijitError, match="prefill GEMM only"):
        matvec.grouped(qs, d_bits, offsets, act, np.empty((offsets[-1], rows), np.float32),
                       x_rows=x_rows, like_gemv=True)


def _thread_counts():
    most = numba.config.NUMBA_NUM_THREADS
    return sorted({1, min(2, most), min(3, most), most})


@pytest.mark.parametrize("isa", ISAS, ids=[i.label for i in ISAS])
def test_claimed_units_give_the_static_split_bits(rng, isa):
    claimed_units_give_the_static_split_bits(rng, isa)


@pytest.mark.skipif(not omp.available(), reason="Numba's threading layer is not omp here")
def test_claimed_units_in_a_team_of_five():
    """The same in a team of 5 (more threads than this machine's cores, an odd count: units
    that do not divide among the threads, some claimed runs empty)."""
    from tests.fermijit.jit.test_omp import _python
    _python(["-c", "import numpy as np; from tests.ops.test_gemm import *; "
             "claimed_units_give_the_static_split_bits(np.random.default_rng(5), "
             "cpu.selected_isa())"], NUMBA_NUM_THREADS="5")


def claimed_units_give_the_static_split_bits(rng, isa):
    """Prefill's GEMMs claim fine units of work (jit.omp.fine_units) unless told not to
    (FERMIJIT_PREFILL_CLAIM=0: the static split): the same bits both ways, at 1, 2, 3 and the
    most threads, with the dynamic schedule and without (omp.set_dynamic(False): the units'
    static equal runs): the dense product with rows not whole groups, fewer groups than units
    and more; the grouped experts unevenly loaded (empty ones, one of many tokens, a ragged
    tail of rows); and the reference's values. Outputs NaN-poisoned: every element written."""
    n_experts, rows, k = 23, 45, 160
    counts = rng.integers(0, 6, n_experts)
    counts[[0, 7]], counts[3] = 0, 41
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    qs, d = q4_weights(rng, n_experts * rows, k)
    qs3, d3 = qs.reshape(n_experts, rows, -1), d.reshape(n_experts, rows, -1)
    x_slots = rng.standard_normal((offsets[-1], k)).astype(np.float32)
    dense = {r: q4_weights(rng, r, k) for r in (37, 1003)}
    x = rng.standard_normal((19, k)).astype(np.float32)
    act, act_slots = matvec.quantize_act(x, isa), matvec.quantize_act(x_slots, isa)

    def run():
        out = {r: matvec.product(matvec.Q4Matrix.of(*w), act, poisoned((19, r)))
               for r, w in dense.items()}
        out["grouped"] = matvec.grouped(qs3, d3.view(np.uint16), offsets, act_slots,
                                        poisoned((offsets[-1], rows)))
        return out

    before, dynamic, claim = numba.get_num_threads(), omp.set_dynamic(True), \
        omp.set_prefill_claim(False)
    try:
        numba.set_num_threads(1)
        static = run()
        for r, (q, dd) in dense.items():
            expected = matvec.reference(q, dd, x)
            assert_close(f"gemm[{isa.label}] R{r}", expected, static[r],
                         atol=RTOL * np.abs(expected).max(), rtol=RTOL)
        expected = matvec.grouped_reference(qs3, d3, offsets, x_slots)
        assert_close("grouped", expected, static["grouped"],
                     atol=RTOL * np.abs(expected).max(), rtol=RTOL)
        for n in _thread_counts():
            numba.set_num_threads(n)
            for claimed, dynamic_runs in ((False, True), (True, True), (True, False)):
                omp.set_prefill_claim(claimed)
                omp.set_dynamic(dynamic_runs)
                got = run()
                for key, value in static.items():
                    np.testing.assert_array_equal(got[key], value, err_msg=f"{key}, {n} threads")
    finally:
        numba.set_num_threads(before)
        omp.set_dynamic(*dynamic)
        omp.set_prefill_claim(claim)
