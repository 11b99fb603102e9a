"""W4A8 GEMV/GEMM: every ISA variant this CPU runs against the exact-integer reference."""

import numba
import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.jit import cpu
from fermijit.jit.cpu import configure_threads
from fermijit.ops import matvec, quant
from tests.numerics import assert_close, poisoned

ISAS = [i for i in cpu.variants_up_to(cpu.selected_isa())]
# The kernel sums each block exactly in integers; what remains is fp32 rounding of one
# multiply-add per block and of the final horizontal sum: a few ulps of the row's scale.
RTOL = 1e-5
# (rows, K, tokens): ragged rows (tails of the 4-row tile), K whose block count is not a whole
# step for any ISA (tail blocks; K384, K736 and K800 leave whole half-width and SSE steps after
# the wide ones), and
# the GEMM's token tail.
SHAPES = {"R1-K32-T1": (1, 32, 1), "R5-K96-T1": (5, 96, 1), "R8-K512-T1": (8, 512, 1),
          "R33-K1056-T1": (33, 1056, 1), "R7-K544-T5": (7, 544, 5), "R12-K2048-T9": (12, 2048, 9),
          "R9-K384-T6": (9, 384, 6), "R3-K736-T1": (3, 736, 1), "R4-K800-T3": (4, 800, 3)}


def q4_weights(rng, rows, k):
    """Q4_0 (qs, d) of random weights at a random scale."""
    w = rng.standard_normal((rows, k)).astype(np.float32) * rng.uniform(0.01, 2)
    return quant.quantize_q4_0(w)


@pytest.mark.parametrize("isa", ISAS, ids=[i.label for i in ISAS])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_matches_reference(rng, isa, shape):
    rows, k, n_tok = shape
    qs, d = q4_weights(rng, rows, k)
    x = rng.standard_normal((n_tok, k) if n_tok > 1 else k).astype(np.float32)
    out = poisoned((n_tok, rows) if n_tok > 1 else rows)
    y = matvec.cpu(qs, d, x, out=out, isa=isa)
    assert y is out
    expected = matvec.reference(qs, d, x)
    assert_close(f"matvec[{isa.label}]", expected, y, atol=RTOL * np.abs(expected).max(), rtol=RTOL)


def test_integer_block_sums_are_exact(rng):
    """With every scale 1, each output is an integer the kernel must hit exactly."""
    rows, k = 9, 640
    qs = rng.integers(0, 256, (rows, k // 2), dtype=np.uint8)
    d = np.ones((rows, k // 32), np.float16)
    x = rng.integers(-127, 128, k).astype(np.float32)
    x[::32] = 127  # every block's max is 127, so dx = 1 and xq = x exactly
    q = np.concatenate([qs.reshape(rows, -1, 16) & 15, qs.reshape(rows, -1, 16) >> 4], axis=-1)
    exact = ((q.astype(np.int64) - 8).reshape(rows, k) * x.astype(np.int64)).sum(axis=1)
    for isa in ISAS:
        np.testing.assert_array_equal(matvec.cpu(qs, d, x, isa=isa), exact.astype(np.float32))


def test_prepared_activations_are_reused(rng):
    qs, d = q4_weights(rng, 16, 256)
    x = rng.standard_normal(256).astype(np.float32)
    act = matvec.quantize_act(x)
    out = poisoned(16)
    matvec.cpu(qs, d, act, out=out)
    assert_close("matvec(Q8Act)", matvec.reference(qs, d, x), out, atol=1e-4, rtol=RTOL)


def test_q4_tensor_close_to_float_product(rng):
    """Sanity of the whole W4A8 scheme: near the fp32 product of the dequantised weights."""
    qs, d = q4_weights(rng, 64, 1024)
    x = rng.standard_normal(1024).astype(np.float32)
    exact = quant.dequantize_q4_0(qs, d) @ x
    # Q8 activations: relative error ~ 1/127/sqrt(3) per element, averaging over K.
    assert_close("w4a8 vs fp32", exact, matvec.cpu(qs, d, x), atol=0.02 * np.abs(exact).max(), rtol=0)


def test_bad_inputs(rng):
    qs, d = q4_weights(rng, 4, 64)
    x = rng.standard_normal(64).astype(np.float32)
    with pytest.raises(FermijitError, match="x has 32 inputs, weights have 64"):
        matvec.cpu(qs, d, x[:32])
    with pytest.raises(FermijitError, match="dtype float64"):
        matvec.cpu(qs, d, x.astype(np.float64))
    with pytest.raises(FermijitError, match="qs has shape"):
        matvec.cpu(qs[:, :16].copy(), d, x)
    with pytest.raises(FermijitError, match="C-contiguous"):
        matvec.cpu(qs, d, np.stack([x, x], axis=1)[:, 0])
    with pytest.raises(FermijitError, match="out has shape"):
        matvec.cpu(qs, d, x, out=np.empty(5, np.float32))
    with pytest.raises(FermijitError, match="whole 32-blocks"):
        matvec.quantize_act(np.zeros(40, np.float32))
    if len(ISAS) > 1:
        act = matvec.quantize_act(x, ISAS[-1])
        with pytest.raises(FermijitError, match="laid out for"):
            matvec.cpu(qs, d, act, isa=ISAS[0])


@pytest.mark.parametrize("isa", ISAS, ids=[i.label for i in ISAS])
@pytest.mark.parametrize("per_item", [False, True], ids=["shared-x", "x-per-expert"])
@pytest.mark.parametrize("n_shared", [0, 1, 2], ids=["routed", "1-always-on", "2-always-on"])
def test_gathered_matches_reference(rng, isa, per_item, n_shared):
    n_experts, rows, k = 6, 37, 160
    qs, d = q4_weights(rng, (n_experts + n_shared) * rows, k)
    qs, d = qs.reshape(n_experts + n_shared, rows, -1), d.reshape(n_experts + n_shared, rows, -1)
    (qs, sqs), (d, sd) = np.split(qs, [n_experts]), np.split(d, [n_experts])
    shared = (sqs, sd) if n_shared else None
    idx = np.array([4, 0, 4, 5], np.int32)
    x = rng.standard_normal((len(idx) + n_shared, k) if per_item else k).astype(np.float32)
    out = poisoned((len(idx) + n_shared, rows))
    matvec.gathered_cpu(qs, d, idx, x, out=out, shared=shared, isa=isa)
    expected = matvec.gathered_reference(qs, d, idx, x, shared=shared)
    assert_close("gathered", expected, out, atol=RTOL * np.abs(expected).max(), rtol=RTOL)


@pytest.mark.parametrize("isa", ISAS, ids=[i.label for i in ISAS])
@pytest.mark.parametrize("counts", [[5, 0, 9, 1, 0, 3], [0, 0, 0, 0, 0, 2], [1, 1, 1, 1, 1, 1]],
                         ids=["ragged", "one-expert", "one-each"])
def test_grouped_matches_reference(rng, isa, counts):
    """Tokens grouped by expert, some experts empty, runs not whole token tiles; rows not whole
    row tiles (37)."""
    n_experts, rows, k = len(counts), 37, 416
    qs, d = q4_weights(rng, n_experts * rows, k)
    qs, d = qs.reshape(n_experts, rows, -1), d.reshape(n_experts, rows, -1)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    x = rng.standard_normal((offsets[-1], k)).astype(np.float32)
    out = poisoned((offsets[-1], rows))
    assert matvec.grouped_cpu(qs, d, offsets, x, out=out, isa=isa) is out
    expected = matvec.grouped_reference(qs, d, offsets, x)
    assert_close("grouped", expected, out, atol=RTOL * np.abs(expected).max(), rtol=RTOL)


def test_grouped_bad_inputs(rng):
    qs, d = q4_weights(rng, 8, 64)
    qs, d = qs.reshape(2, 4, -1), d.reshape(2, 4, -1)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    for bad in ([0, 2, 2], [1, 2, 3], [0, 3, 2], [0, 1]):
        with pytest.raises(FermijitError, match="offsets"):
            matvec.grouped_cpu(qs, d, np.array(bad, np.int64), x)
    with pytest.raises(FermijitError, match="offsets has dtype int32"):
        matvec.grouped_cpu(qs, d, np.array([0, 1, 3], np.int32), x)
    with pytest.raises(FermijitError, match="inconsistent"):
        matvec.grouped(qs, d.view(np.uint16), np.array([0, 1, 3], np.int64),
                       matvec.quantize_act(x), np.empty((3, 5), np.float32))


def test_read_only_inputs_are_accepted(rng):
    """Weights, activations and expert indices are only read: read-only arrays (memory-mapped
    files, shared buffers) go straight in."""
    def frozen(a):
        a = a.copy()
        a.flags.writeable = False
        return a

    qs, d = q4_weights(rng, 6, 64)
    x = rng.standard_normal(64).astype(np.float32)
    act = matvec.quantize_act(x)
    act = matvec.Q8Act(frozen(act.xq), frozen(act.dx), frozen(act.xsum8), act.vec)
    expected = matvec.reference(qs, d, x)
    y = matvec.product(matvec.Q4Matrix.of(frozen(qs), frozen(d)), act, np.empty(6, np.float32))
    assert_close("product", expected, y, atol=RTOL * np.abs(expected).max(), rtol=RTOL)
    qs3, d3 = frozen(qs.reshape(2, 3, -1)), frozen(d.reshape(2, 3, -1))
    g = matvec.gathered(qs3, d3.view(np.uint16), frozen(np.array([1, 0], np.int32)), act,
                        np.empty((2, 3), np.float32))
    np.testing.assert_array_equal(g.reshape(-1), y[[3, 4, 5, 0, 1, 2]])


def test_gathered_bad_inputs(rng):
    qs, d = q4_weights(rng, 8, 64)
    qs, d = qs.reshape(2, 4, -1), d.reshape(2, 4, -1)
    x = rng.standard_normal(64).astype(np.float32)
    for bad in ([0, 2], [-1, 0]):  # checked in the kernel, before any thread reads
        with pytest.raises(FermijitError, match="out of range"):
            matvec.gathered_cpu(qs, d, np.array(bad, np.int32), x)
    act = matvec.quantize_act(x)
    for scales, out in ((d, np.empty((2, 5), np.float32)), (d[:1], np.empty((2, 4), np.float32))):
        with pytest.raises(FermijitError, match="inconsistent"):
            matvec.gathered(qs, scales.view(np.uint16), np.array([0, 1], np.int32), act, out)
    with pytest.raises(FermijitError, match="wrong dtype or layout"):
        matvec.gathered(qs, d.view(np.uint16), np.array([0, 1], np.int32), act,
                        np.empty((2, 4), np.float64))
    with pytest.raises(FermijitError, match="idx has dtype int64"):
        matvec.gathered_cpu(qs, d, np.array([0, 1]), x)
    with pytest.raises(FermijitError, match="3 activation rows for 2 experts"):
        matvec.gathered_cpu(qs, d, np.array([0, 1], np.int32), np.stack([x, x, x]))


@pytest.mark.parametrize("isa", ISAS, ids=[i.label for i in ISAS])
@pytest.mark.parametrize("shape", [(5, 96, 1), (9, 1056, 1), (6, 160, 3)],
                         ids=["R5-K96", "R9-K1056", "R6-K160-T3"])
def test_q8_weights_match_reference(rng, isa, shape):
    rows, k, n_tok = shape
    qs, d = quant.quantize_q8_0(rng.standard_normal((rows, k)).astype(np.float32))
    qs[0, :4] = [-128, 127, -127, 0]   # extremes of the sign trick
    x = rng.standard_normal((n_tok, k) if n_tok > 1 else k).astype(np.float32)
    out = poisoned((n_tok, rows) if n_tok > 1 else rows)
    matvec.q8_cpu(qs, d, x, out=out, isa=isa)
    expected = matvec.q8_reference(qs, d, x)
    assert_close(f"q8[{isa.label}]", expected, out, atol=RTOL * np.abs(expected).max(), rtol=RTOL)


def test_activations_must_be_aligned(rng):
    """The kernels fold activation loads into SSE memory operands, which fault when misaligned:
    a misaligned buffer is refused when the activations are made, before any kernel runs."""
    act = matvec.quantize_act(rng.standard_normal(64).astype(np.float32))
    raw = np.empty(act.xq.size + 16, np.int8)
    start = (-raw.ctypes.data % 16) + 1
    shifted = raw[start:start + act.xq.size].reshape(act.xq.shape)
    with pytest.raises(FermijitError, match="16-byte aligned"):
        matvec.Q8Act(shifted, act.dx, act.xsum8, act.vec)
    assert matvec.quantize_act(np.zeros((3, 64), np.float32)).rows(np.array([2, 0])).xq.ctypes.data % 16 == 0


@pytest.mark.parametrize("isa", ISAS, ids=[i.label for i in ISAS])
def test_prepared_product_matches_reference(rng, isa):
    qs, d = q4_weights(rng, 37, 544)
    w = matvec.Q4Matrix.of(qs, d)
    for n_tok, out in ((1, poisoned(37)), (1, poisoned((1, 37))), (5, poisoned((5, 37)))):
        x = rng.standard_normal((n_tok, 544)).astype(np.float32)
        y = matvec.product(w, matvec.quantize_act(x, isa), out, isa=isa)
        expected = matvec.reference(qs, d, x).reshape(out.shape)
        assert_close("product", expected, y, atol=RTOL * np.abs(expected).max(), rtol=RTOL)


def test_prepared_product_bad_inputs(rng):
    qs, d = q4_weights(rng, 4, 64)
    with pytest.raises(FermijitError, match="qs has shape"):
        matvec.Q4Matrix.of(qs[:, :16].copy(), d)
    w = matvec.Q4Matrix.of(qs, d)
    act = matvec.quantize_act(rng.standard_normal(64).astype(np.float32))
    with pytest.raises(FermijitError, match="x has 96 inputs, weights have 64"):
        matvec.product(w, matvec.quantize_act(np.zeros(96, np.float32)), np.empty(4, np.float32))
    for out in (np.empty(5, np.float32), np.empty((2, 4), np.float32), [0.0] * 4):
        with pytest.raises(FermijitError, match="out has shape"):
            matvec.product(w, act, out)
    read_only = np.empty(4, np.float32)
    read_only.flags.writeable = False
    for out in (np.empty(4, np.float64), np.empty(8, np.float32)[::2], read_only):
        with pytest.raises(FermijitError, match="wrong dtype or layout"):
            matvec.product(w, act, out)
    if len(ISAS) > 1:
        with pytest.raises(FermijitError, match="laid out for"):
            matvec.product(w, matvec.quantize_act(np.zeros(64, np.float32), ISAS[-1]),
                           np.empty(4, np.float32), isa=ISAS[0])


# Issue 12, item 9: every ISA variant, those this CPU cannot run reported as skipped.
ALL_ISAS = list(cpu.Isa)
EXTREMES = {"w=-8, x=+127": (0, 127), "w=-8, x=-127": (0, -127), "w=+7, x=+127": (15, 127),
            "w=+7, x=-127": (15, -127), "alternating": (None, None)}


@pytest.mark.parametrize("case", EXTREMES)
@pytest.mark.parametrize("isa", ALL_ISAS, ids=[i.label for i in ALL_ISAS])
def test_extreme_inputs_do_not_saturate(isa, case):
    """Nibbles all 0 or all 15 (weights -8 or +7) against activations all +-127, scales 1: each
    output is an exact integer (|y| up to 8·127·K), which the 16-bit pmaddubsw stage and the
    32-bit sums must carry without saturating, in the GEMV and in every GEMM tile position."""
    if not cpu.supported(isa):
        pytest.skip(f"{isa.label}: this CPU (or Numba's target) lacks "
                    f"{', '.join(f for f in isa.features if f not in cpu.host_features())}")
    rows, k, n_tok = 7, 2080, 5                      # row and token tails; 65 blocks: a tail block
    nib, x_val = EXTREMES[case]
    if nib is None:                                  # a row of each, against alternating signs
        q = np.tile(np.array([0, 15], np.uint8).repeat(k // 2), (rows, 1))
        x = np.tile(np.array([127, -127], np.float32), (n_tok, k // 2))
        x[1::2] *= -1
    else:
        q = np.full((rows, k), nib, np.uint8)
        x = np.full((n_tok, k), x_val, np.float32)
    qb = q.reshape(rows, -1, 32)
    qs = (qb[..., :16] | (qb[..., 16:] << 4)).reshape(rows, k // 2)
    d = np.ones((rows, k // 32), np.float16)
    exact = (x.astype(np.int64) @ (q.astype(np.int64) - 8).T).astype(np.float32)   # [T, R]
    for xs, expected in ((x[0], exact[0]), (x, exact)):
        out = poisoned(expected.shape)
        np.testing.assert_array_equal(matvec.cpu(qs, d, xs, out=out, isa=isa), expected)
    q8 = np.where(q == 0, -128, 127).astype(np.int8)  # Q8_0's extremes, through the sign trick
    exact8 = (x.astype(np.int64) @ q8.astype(np.int64).T).astype(np.float32)
    np.testing.assert_array_equal(matvec.q8_cpu(q8, d, x, isa=isa), exact8)


@pytest.mark.parametrize("isa", ISAS, ids=[i.label for i in ISAS])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 66], ids=lambda r: f"R{r}")
def test_gemv_streams_equal_the_one_row_tile(rng, isa, rows):
    """The decode GEMV reads each thread's rows as GEMV_STREAMS side-by-side runs (rows left
    over one by one): every row bit for bit the one-row tile's, at 1 and 2 threads, Q4_0 and
    Q8_0, and the gathered launch's matrices each bit for bit its own GEMV."""
    k = 1056                                                # 33 blocks: every step width
    qs, d = q4_weights(rng, rows, k)
    q8s, q8d = quant.quantize_q8_0(rng.standard_normal((rows, k)).astype(np.float32))
    act = matvec.quantize_act(rng.standard_normal(k).astype(np.float32), isa)
    one_row = {fmt: matvec._product(isa, (1, 1), fmt=fmt) for fmt in (matvec.Q4_0, matvec.Q8_0)}
    expected = {}
    for fmt, (w, s) in ((matvec.Q4_0, (qs, d)), (matvec.Q8_0, (q8s.view(np.uint8), q8d))):
        expected[fmt] = poisoned(rows)
        one_row[fmt](w, s.view(np.uint16), act.xq, act.dx, act.xsum8, expected[fmt])
    gathered_qs = np.stack([qs, qs[::-1].copy(), qs])
    gathered_d = np.stack([d, d[::-1].copy(), d])
    idx = np.array([1, 0], np.int32)
    before = numba.get_num_threads()
    try:
        for n in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            configure_threads(n)
            out = poisoned(rows)
            matvec.product(matvec.Q4Matrix.of(qs, d), act, out)
            np.testing.assert_array_equal(out, expected[matvec.Q4_0])
            q8_out = matvec.q8_cpu(q8s, q8d, act, out=poisoned(rows), isa=isa)
            np.testing.assert_array_equal(q8_out, expected[matvec.Q8_0])
            out = poisoned((3, rows))
            matvec.gathered_cpu(gathered_qs, gathered_d, idx, act, out=out,
                                shared=(gathered_qs[2:], gathered_d[2:]), isa=isa)
            reversed_rows = poisoned(rows)
            one_row[matvec.Q4_0](gathered_qs[1], gathered_d[1].view(np.uint16), act.xq, act.dx,
                                 act.xsum8, reversed_rows)
            for got, want in zip(out, (reversed_rows, expected[matvec.Q4_0],
                                       expected[matvec.Q4_0])):
                np.testing.assert_array_equal(got, want)
    finally:
        configure_threads(before)


@pytest.mark.parametrize("isa", ISAS, ids=[i.label for i in ISAS])
@pytest.mark.parametrize("k", [96, 384, 768, 1312])
def test_two_tokens_are_each_its_gemv(rng, isa, k):
    """A verify step's 2 tokens (the few-token tile; on an AVX-512 VNNI machine their 256-bit
    steps paired in 512-bit registers: matvec.PAIRED): each token's row bit for bit its own
    GEMV's, Q4_0 and Q8_0, at K with every step width (full, half, SSE, single blocks)."""
    rows = 37
    qs, d = q4_weights(rng, rows, k)
    q8s, q8d = quant.quantize_q8_0(rng.standard_normal((rows, k)).astype(np.float32))
    x = rng.standard_normal((2, k)).astype(np.float32)
    w = matvec.Q4Matrix.of(qs, d)
    both = matvec.product(w, matvec.quantize_act(x, isa), poisoned((2, rows)), like_gemv=True)
    both8 = matvec.q8_cpu(q8s, q8d, matvec.quantize_act(x, isa), poisoned((2, rows)))
    for t in range(2):
        act = matvec.quantize_act(x[t:t + 1], isa)
        np.testing.assert_array_equal(both[t], matvec.product(w, act, poisoned((1, rows)))[0])
        np.testing.assert_array_equal(both8[t], matvec.q8_cpu(q8s, q8d, act,
                                                             poisoned((1, rows)))[0])


@pytest.mark.parametrize("isa", ISAS, ids=[i.label for i in ISAS])
@pytest.mark.parametrize("rows,k,n_fp32,n_tok", [(5, 96, 3, 1), (33, 1056, 64, 1), (1, 32, 1, 1),
                                                 (12, 512, 9, 1), (33, 1056, 64, 2),
                                                 (7, 160, 5, 3), (12, 512, 9, 2)],
                         ids=["R5-K96-P3", "R33-K1056-P64", "R1-K32-P1", "R12-K512-P9",
                              "R33-K1056-P64-T2", "R7-K160-P5-T3", "R12-K512-P9-T2"])
def test_gemv_with_fp32_rows_is_both_products(rng, isa, rows, k, n_fp32, n_tok):
    """Decode's GEMV (or a verify step's few tokens) with an fp32 product of the same input in
    its fork (the GDN gates beside the joined in-projection): each token's outputs bit for bit
    its own GEMV's, the fp32 rows fp32_rows' of that token alone (each output one way, whatever
    the split and the tokens beside it), at every thread count."""
    from fermijit.ops import fp32_rows

    qs, d = q4_weights(rng, rows, k)
    x = rng.standard_normal((n_tok, k)).astype(np.float32)
    w_rows = rng.standard_normal((n_fp32, k)).astype(np.float32)
    act = matvec.quantize_act(x, isa)
    w = matvec.Q4Matrix.of(qs, d)
    want, want_p = poisoned((n_tok, rows)), poisoned((n_tok, n_fp32))
    for t in range(n_tok):
        matvec.product(w, matvec.quantize_act(x[t:t + 1], isa), want[t:t + 1])
        fp32_rows.rows_range(x[t:t + 1], w_rows, want_p[t:t + 1], 0, n_fp32)
    assert_close("fp32 rows", x.astype(np.float64) @ w_rows.astype(np.float64).T, want_p,
                 atol=1e-5 * np.abs(want_p).max(), rtol=1e-5)
    assert_close("product", matvec.reference(qs, d, x), want, atol=RTOL * np.abs(want).max(),
                 rtol=RTOL)
    full = numba.get_num_threads()
    try:
        for n in sorted({1, full}):
            configure_threads(n)
            out, p = poisoned((n_tok, rows)), poisoned((n_tok, n_fp32))
            kernel_, args = matvec.launch_with_rows(w, act, out, x, w_rows, p)
            kernel_(*args)
            np.testing.assert_array_equal(out, want, err_msg=f"{n} threads")
            np.testing.assert_array_equal(p, want_p, err_msg=f"{n} threads")
    finally:
        configure_threads(full)


def test_gemv_with_fp32_rows_bad_inputs(rng):
    qs, d = q4_weights(rng, 4, 64)
    w = matvec.Q4Matrix.of(qs, d)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    act = matvec.quantize_act(x)
    with pytest.raises(FermijitError, match="w_rows"):
        matvec.launch_with_rows(w, act, np.empty((1, 4), np.float32), x,
                                np.zeros((3, 32), np.float32), np.empty((1, 3), np.float32))
    with pytest.raises(FermijitError, match="p has shape|p "):
        matvec.launch_with_rows(w, act, np.empty((1, 4), np.float32), x,
                                np.zeros((3, 64), np.float32), np.empty((1, 2), np.float32))
    many = matvec.quantize_act(np.zeros((matvec.FEW_TOKENS + 1, 64), np.float32))
    with pytest.raises(FermijitError, match="tokens"):
        matvec.launch_with_rows(w, many, np.empty((matvec.FEW_TOKENS + 1, 4), np.float32),
                                np.zeros((matvec.FEW_TOKENS + 1, 64), np.float32),
                                np.zeros((3, 64), np.float32),
                                np.empty((matvec.FEW_TOKENS + 1, 3), np.float32))
