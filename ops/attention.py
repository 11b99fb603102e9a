"""Causal GQA attention with the sigmoid output gate, MODEL.md §5 steps 5-6.

    o[t, h] = softmax_s(q[t, h] . k[h // G, s] / sqrt(D)) v[h // G, s]  over s <= start + t,
    then o *= sigmoid(gate).
One function serves prefill (T queries) and decode (T = 1): the queries are positions
start..start+T-1 and the KV cache holds positions 0..S-1 with S >= start + T.

The cache is fp32 or Q8_0 rows (ops/kv_quant.py, issue 31 item 1: the default). With Q8_0 the
query is rounded to Q8_0 the same way and each score is integer dot products of the codes, block
by block (pmaddubsw on SSSE3 and AVX2, vpdpbusd on AVX-512 VNNI), times the two blocks' scales;
the values are converted from int8 and scaled in fp32 as they are accumulated.

Letters: T queries, Hq query heads, Hkv kv heads, G = Hq/Hkv queries per kv head, D head dim,
S cache length (the cache may be longer than the keys used), L = start + T keys used,
nb = D/32 blocks of a Q8_0 row.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from fermijit import FermijitError
from fermijit.jit.checks import check_array, output
from fermijit.jit import cpu as jit_cpu
from fermijit.jit import mathf, omp, simd
from fermijit.jit.cpu import Isa, bind, kernel
from fermijit.jit.simd import F32, I8, I32, I64, vec
from fermijit.ops import fp32_rows, kv_quant
from fermijit.ops.fp32_rows import LANES
from fermijit.ops.kv_quant import Q8Rows


def reference(q, k, v, gate, start):
    """q, gate [T, Hq, D]; k, v [Hkv, S, D] fp32, or both Q8Rows (then q is rounded to Q8_0
    first, and the arithmetic is float64); start >= 0 -> o [T, Hq, D], fp32 or wider."""
    if isinstance(k, Q8Rows):
        q = kv_quant.reference(q).dequantize(np.float64)
        k, v = k.dequantize(np.float64), v.dequantize(np.float64)
    dt = np.result_type(q, k, v, gate, np.float32)
    T, Hq, D = q.shape
    L = start + T
    kv_head = np.arange(Hq) // (Hq // k.shape[0])                     # query head h -> h // G
    keys = np.asarray(k, dtype=dt)[kv_head, :L]                       # [Hq, L, D]
    values = np.asarray(v, dtype=dt)[kv_head, :L]
    scores = np.einsum("thd,hsd->ths", np.asarray(q, dtype=dt), keys) / np.sqrt(D)  # [T, Hq, L]
    causal = np.arange(L)[None, :] <= start + np.arange(T)[:, None]   # [T, L]
    scores = np.where(causal[:, None, :], scores, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    o = np.einsum("ths,hsd->thd", p, values)
    return o * np.exp(-np.logaddexp(0, -np.asarray(gate, dtype=dt)))  # sigmoid(gate)


# --- CPU ----------------------------------------------------------------------------------------

# Keys per online-softmax step: the [G, BLOCK] scores of one step stay in L1.
BLOCK = 64
# A query's keys are cut at multiples of RANGE_KEYS; each range's partial attention (the online
# softmax over its blocks) is computed alone and the partials merged by `_combine`, one fixed
# way. So a query's output has the same bits in a pass of any length and in a decode step (a
# prompt split into passes, a prefix-cache resume), and decode can give a head's ranges to
# different threads (flash-decoding: with Hkv = 2 there are too few heads to occupy the cores
# otherwise). Shorter ranges cost more in set-up and merging than they save.
RANGE_KEYS = 256
# Calls with fewer (query, kv head) pairs than this (decode, short passes) make every range an
# item of its own over the threads and merge afterwards; others take a pair's ranges in turn in
# one item and merge there. Either way the same bits, whatever the thread count (issue 9 item 7).
SPLIT_ITEMS = 16


# Keys per score tile: the group's query rows against 4 key rows, 16-float accumulators
# (fp32_rows.tile), every score summed in one fixed order whatever the tile (the bits).
SCORE_KEYS = 4


def head_groups() -> tuple:
    """Sizes of the groups of query heads a score or weighted-value tile takes, tried in turn
    (the first dividing the group's heads wins; else one head at a time): with 32 vector
    registers (AVX-512) 4 or 3 heads x 4 keys, 16 or 12 accumulators, share each key row's loads
    (the full-size model's 8 heads a kv head, the default model's 3); with 16 (AVX2, SSE) one
    head's 4 accumulators already fill them. Decided when compiled, for the target compiled
    for; only these shapes are compiled (each costs compile time on a first run)."""
    return (4, 3) if "avx512f" in jit_cpu.target_features() else ()


def _in_groups(builder, n, sizes, emit):
    """emit(first, size) over consecutive groups of rows covering 0..n-1 (n an i64 value): all
    of the first of `sizes` that divides n, else single rows."""
    c = lambda x: ir.Constant(I64, x)  # noqa: E731
    size = sizes[0] if sizes else 1
    if size == 1:
        with cgutils.for_range(builder, n) as i:
            emit(i.index, 1)
        return
    with builder.if_else(builder.icmp_unsigned("==", builder.urem(n, c(size)), c(0))) as (
            whole, other):
        with whole:
            with cgutils.for_range(builder, builder.udiv(n, c(size))) as i:
                emit(builder.mul(i.index, c(size)), size)
        with other:
            _in_groups(builder, n, sizes[1:], emit)


@intrinsic
def _group_scores(typingctx, q_t, k_h, p, h0, n_heads, key, j):
    """p[g, j + b] = q_t[h0 + g] · k_h[key + b] for g < n_heads, b < SCORE_KEYS, the heads in
    head_groups(). The head dim must be a multiple of 16 (_attend_range's other path)."""
    sig = types.none(q_t, k_h, p, h0, n_heads, key, j)

    def codegen(context, builder, sig, args):
        qa, ka, pa = (context.make_array(sig.args[i])(context, builder, args[i]) for i in range(3))
        h0v, nv, keyv, jv = args[3:7]
        _in_groups(builder, nv, head_groups(), lambda g, heads: fp32_rows.emit_tile(
            builder, qa, ka, pa, builder.add(h0v, g), keyv, g, jv, heads, SCORE_KEYS,
            ragged=False))
        return context.get_dummy_value()

    return sig, codegen


# --- Q8_0 scores ---------------------------------------------------------------------------------

# Query heads a Q8_0 score tile takes against one key (the first dividing the group's heads, else
# one at a time): the key's registers loaded and made unsigned once for them.
Q8_HEAD_GROUPS = {Isa.AVX512VNNI: (4, 3), Isa.AVX2: (2,), Isa.SSSE3: (2,)}
Q8_STEP_REGISTERS = 4  # registers of a key row a full step reads (the rest: halving steps)


def _step_vec(v: simd.Vec, n_blocks: int) -> simd.Vec:
    """The registers a step of n_blocks 32-byte blocks is read in: v's, or for a single block
    on AVX-512 its 256-bit form."""
    return simd.AVX512VNNI_256 if v.nbytes > 32 * n_blocks else v


def _block_sums(builder, parts, group: int):
    """i32 vectors `parts` (lanes in order, as if one long vector) -> one vector of the sums of
    each run of `group` lanes, in order: adjacent lanes added pairwise, vector pairs first."""
    vs = list(parts)
    while group > 1:
        n = vs[0].type.count
        if len(vs) > 1:
            pairs = list(zip(vs[::2], vs[1::2]))
            pick = lambda x, y, first: builder.shuffle_vector(  # noqa: E731
                x, y, ir.Constant(vec(I32, n), list(range(first, 2 * n, 2))))
        else:
            pairs = [(vs[0], vs[0])]
            pick = lambda x, y, first: builder.shuffle_vector(  # noqa: E731
                x, y, ir.Constant(vec(I32, n // 2), list(range(first, n, 2))))
        vs = [builder.add(pick(x, y, 0), pick(x, y, 1)) for x, y in pairs]
        group //= 2
    (sums,) = vs
    return sums


def make_q8_scores(isa: Isa):
    """An intrinsic scores(qq, qd, qc, kq, kd, p, h0, n_heads, key, j): p[g, j] = the Q8_0 dot
    product of query row h0 + g (codes qq [., D], scales qd [., nb], qc [., nb] 128 · the codes'
    sum per block) with key row `key` (kq [S, D] int8, kd [S, nb]), for g < n_heads:

        Σ_b (isum_b · qd_b) · kd_b,   isum_b = Σ_{i in block b} qq_i · kq_i  (exact, in int32)

    Steps of Q8_STEP_REGISTERS registers of the ISA, then halving steps for the rest (D = 32,
    64 ...), each into its own fp32 accumulator of a lane per block, added largest step first.
    Products: |k| · sign(q, k) by pmaddubsw then pmaddwd (exact: 2 · 127 · 127 < 2^15), or with
    VNNI (k + 128) · q by vpdpbusd, less 128 · Σq. A key row's score depends on D and the ISA
    only: the same bits in any tile, pass or thread."""
    v = simd.VEC_OF[isa]
    full = Q8_STEP_REGISTERS * v.nbytes // 32                 # blocks of a full step
    sizes = [full >> i for i in range(full.bit_length())]     # full, full/2, ..., 1

    @intrinsic
    def scores(typingctx, qq, qd, qc, kq, kd, p, h0, n_heads, key, j):
        sig = types.none(qq, qd, qc, kq, kd, p, h0, n_heads, key, j)

        def codegen(context, builder, sig, args):
            qqa, qda, qca, kqa, kda, pa = (context.make_array(sig.args[i])(
                context, builder, args[i]) for i in range(6))
            h0v, nv, keyv, jv = args[6:10]
            c = lambda x: ir.Constant(I64, x)  # noqa: E731
            nb = builder.extract_value(qda.shape, 1)
            stride = lambda arr: builder.extract_value(arr.strides, 0)  # noqa: E731
            k_row = builder.mul(keyv, stride(kqa))
            kd_row = builder.mul(keyv, stride(kda))

            def tile(g0, n_heads):
                heads = [builder.add(builder.add(h0v, g0), c(g)) for g in range(n_heads)]
                accs = {}                                      # (head, step size) -> f32 [size]

                def step(size, b0):
                    sv = _step_vec(v, size)
                    w = sv.nbytes
                    n_regs = 32 * size // w
                    byte0 = builder.mul(b0, c(32))
                    ks = [simd.load(builder, kqa.data, builder.add(builder.add(k_row, byte0),
                                                                   c(r * w)), vec(I8, w))
                          for r in range(n_regs)]
                    if sv.dpbusd:
                        ku = [builder.xor(k, ir.Constant(k.type, [0x80] * w)) for k in ks]
                    else:
                        ku = [simd.abs_i8(builder, k) for k in ks]
                    fv, iv = vec(F32, size), vec(I32, size)
                    kd = simd.load(builder, kda.data, builder.add(kd_row, builder.mul(b0, c(4))),
                                   fv)
                    for g, h in enumerate(heads):
                        q_row = builder.add(builder.mul(h, stride(qqa)), byte0)
                        qs = [simd.load(builder, qqa.data, builder.add(q_row, c(r * w)),
                                        vec(I8, w)) for r in range(n_regs)]
                        parts = [simd.dot_u8s8(sv, builder, [
                            (u, q if sv.dpbusd else simd.sign_i8(builder, q, k))])
                            for u, q, k in zip(ku, qs, ks)]
                        isum = _block_sums(builder, parts, 8)  # 8 i32 partials a block
                        s_off = builder.add(builder.mul(h, stride(qda)), builder.mul(b0, c(4)))
                        if sv.dpbusd:
                            isum = builder.sub(isum, simd.load(builder, qca.data, builder.add(
                                builder.mul(h, stride(qca)), builder.mul(b0, c(4))), iv))
                        qd = simd.load(builder, qda.data, s_off, fv)
                        term = builder.fmul(builder.fmul(builder.sitofp(isum, fv), qd), kd)
                        acc = accs[g, size]
                        builder.store(builder.fadd(builder.load(acc), term), acc)

                for size in sizes:
                    for g in range(n_heads):
                        accs[g, size] = cgutils.alloca_once_value(
                            builder, ir.Constant(vec(F32, size), None))
                n_full = builder.udiv(nb, c(full))
                with cgutils.for_range(builder, n_full) as loop:
                    step(full, builder.mul(loop.index, c(full)))
                done = builder.mul(n_full, c(full))
                for size in sizes[1:]:                      # the rest: each size at most once
                    has = builder.icmp_unsigned("!=", builder.and_(builder.sub(nb, done),
                                                                   c(size)), c(0))
                    with builder.if_then(has):
                        step(size, done)
                    done = builder.add(done, builder.select(has, c(size), c(0)))
                p_row = stride(pa)
                for g in range(n_heads):
                    total = None
                    for size in sizes:
                        part = simd.hsum(builder, builder.load(accs[g, size]))
                        total = part if total is None else builder.fadd(total, part)
                    at = builder.add(builder.mul(builder.add(g0, c(g)), p_row),
                                     builder.mul(jv, c(4)))
                    builder.store(total, builder.bitcast(simd.byte_ptr(builder, pa.data, at),
                                                         F32.as_pointer()))

            _in_groups(builder, nv, Q8_HEAD_GROUPS[isa], tile)
            return context.get_dummy_value()

        return sig, codegen

    return scores


# Vectors of 16 floats of a row of `a` held in registers while the keys' weighted values are added.
PV_VECTORS = 4


def _emit_weighted(builder, pa, aa, j0v, nv, load_value):
    """_weighted_rows' code; load_value(key, off, ty) gives the `ty` (16 floats or one) of value
    row `key` (an i64: j0 + j) at float offset off / 4 (the fp32 rows, or Q8_0 codes converted
    and scaled)."""
    c = lambda x: ir.Constant(I64, x)  # noqa: E731
    n_rows, d = cgutils.unpack_tuple(builder, aa.shape, 2)

    def rows(row0, n_heads, width, offs):
        """rows row0..row0+n_heads-1 of a, the floats at byte offsets offs (width 0: single
        floats), over the n keys."""
        ty = vec(F32, LANES) if width else F32
        load = (lambda ptr, off: simd.load(builder, ptr, off, ty)) if width else (
            lambda ptr, off: simd.load_scalar(builder, ptr, off, F32))
        a_rows = [builder.mul(builder.add(row0, c(h)), builder.extract_value(aa.strides, 0))
                  for h in range(n_heads)]
        p_rows = [builder.mul(builder.add(row0, c(h)), builder.extract_value(pa.strides, 0))
                  for h in range(n_heads)]
        accs = [[cgutils.alloca_once_value(builder, load(aa.data, builder.add(r, o)))
                 for o in offs] for r in a_rows]
        with cgutils.for_range(builder, nv) as key:
            xs = [load_value(builder.add(j0v, key.index), o, ty) for o in offs]
            for p_row, row_accs in zip(p_rows, accs):
                w = simd.load_scalar(builder, pa.data, builder.add(
                    p_row, builder.mul(key.index, c(4))), F32)
                w = simd.splat(builder, w, LANES) if width else w
                for acc, x in zip(row_accs, xs):
                    builder.store(builder.fadd(builder.load(acc), builder.fmul(w, x)), acc)
        for r, row_accs in zip(a_rows, accs):
            for acc, o in zip(row_accs, offs):
                dst = simd.byte_ptr(builder, aa.data, builder.add(r, o))
                builder.store(builder.load(acc), builder.bitcast(dst, ty.as_pointer()),
                              align=4)

    def run(width, count, start):
        """`count` runs of `width` vectors (width 0: single floats) from float `start`; the
        rows in head_groups() for the runs of PV_VECTORS (all there is for head dims that
        are multiples of 64), one at a time for the rest."""
        lanes, n_vec = (LANES, width) if width else (1, 1)
        with cgutils.for_range(builder, count) as run_loop:
            col = builder.mul(builder.add(start, builder.mul(run_loop.index,
                                                             c(lanes * n_vec))), c(4))
            offs = [builder.add(col, c(4 * lanes * u)) for u in range(n_vec)]
            _in_groups(builder, n_rows, head_groups() if width == PV_VECTORS else (),
                       lambda row0, heads: rows(row0, heads, width, offs))

    n_vec = builder.udiv(d, c(LANES))
    groups = builder.udiv(n_vec, c(PV_VECTORS))
    run(PV_VECTORS, groups, c(0))
    singles_from = builder.mul(groups, c(PV_VECTORS * LANES))
    run(1, builder.sub(n_vec, builder.mul(groups, c(PV_VECTORS))), singles_from)
    tail_from = builder.mul(n_vec, c(LANES))
    run(0, builder.sub(d, tail_from), tail_from)


@intrinsic
def _weighted_rows(typingctx, p, v, a, j0, n):
    """a[g] += Σ_{j < n} p[g, j] · v[j0 + j] for every row g of a: per run of PV_VECTORS 16-float
    vectors of the rows (then single vectors, then leftover floats), head_groups()' rows at a
    time held in registers over the keys, each key's run of v read once for them (from L1).
    Every a[g, d] sums its keys in order: the rows taken together never change a bit."""
    sig = types.none(p, v, a, j0, n)

    def codegen(context, builder, sig, args):
        pa, va, aa = (context.make_array(sig.args[i])(context, builder, args[i])
                      for i in range(3))
        v_stride = builder.extract_value(va.strides, 0)

        def load_value(key, off, ty):
            at = builder.add(builder.mul(key, v_stride), off)
            if isinstance(ty, ir.VectorType):
                return simd.load(builder, va.data, at, ty)
            return simd.load_scalar(builder, va.data, at, ty)

        _emit_weighted(builder, pa, aa, args[3], args[4], load_value)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _weighted_rows_q8(typingctx, p, vq, vd, a, j0, n):
    """_weighted_rows over Q8_0 values vq [S, D] int8, vd [S, nb]: each value converted and
    times its block's scale (v = q · d, fp32: the reference's value) before it is weighted."""
    sig = types.none(p, vq, vd, a, j0, n)

    def codegen(context, builder, sig, args):
        pa, qa, da, aa = (context.make_array(sig.args[i])(context, builder, args[i])
                          for i in range(4))
        c = lambda x: ir.Constant(I64, x)  # noqa: E731
        q_stride = builder.extract_value(qa.strides, 0)
        d_stride = builder.extract_value(da.strides, 0)

        def load_value(key, off, ty):
            col = builder.udiv(off, c(4))                            # the first value's index
            scale = simd.load_scalar(builder, da.data, builder.add(
                builder.mul(key, d_stride), builder.mul(builder.udiv(col, c(32)), c(4))), F32)
            at = builder.add(builder.mul(key, q_stride), col)
            if isinstance(ty, ir.VectorType):                        # 16 values: one block's half
                codes = simd.load(builder, qa.data, at, vec(I8, ty.count))
                return builder.fmul(builder.sitofp(codes, ty), simd.splat(builder, scale,
                                                                          ty.count))
            return builder.fmul(builder.sitofp(simd.load_scalar(builder, qa.data, at, I8), F32),
                                scale)

        _emit_weighted(builder, pa, aa, args[4], args[5], load_value)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _row_max(typingctx, p, g, n, m0):
    """max(m0, p[g, 0..n-1]) in 16-float vectors (compare and select: exact, so the order does
    not matter). LLVM keeps a loop of scalar max() serial without the no-NaNs flag: one compare
    and select of latency a score, most of the softmax's time."""
    sig = types.float32(p, g, n, m0)

    def codegen(context, builder, sig, args):
        pa = context.make_array(sig.args[0])(context, builder, args[0])
        gv, nv, m0v = args[1:4]
        c = lambda x: ir.Constant(I64, x)  # noqa: E731
        vf = vec(F32, LANES)
        row = builder.mul(gv, builder.extract_value(pa.strides, 0))
        best = cgutils.alloca_once_value(builder, simd.splat(builder, m0v, LANES))
        n_vec = builder.udiv(nv, c(LANES))
        with cgutils.for_range(builder, n_vec) as loop:
            off = builder.add(row, builder.mul(loop.index, c(4 * LANES)))
            x = simd.load(builder, pa.data, off, vf)
            b = builder.load(best)
            builder.store(builder.select(builder.fcmp_ordered(">", x, b), x, b), best)
        m = cgutils.alloca_once_value(builder, simd.hmax(builder, builder.load(best)))
        with cgutils.for_range(builder, builder.sub(nv, builder.mul(n_vec, c(LANES)))) as loop:
            j = builder.add(builder.mul(n_vec, c(LANES)), loop.index)
            x = simd.load_scalar(builder, pa.data, builder.add(row, builder.mul(j, c(4))), F32)
            b = builder.load(m)
            builder.store(builder.select(builder.fcmp_ordered(">", x, b), x, b), m)
        return builder.load(m)

    return sig, codegen


@kernel
def n_ranges(n_keys):
    """Key ranges of a query that attends to n_keys keys."""
    return max(1, (n_keys + RANGE_KEYS - 1) // RANGE_KEYS)


@kernel
def _attend_range(q, k, v, t, hkv, j0, j1, a, m_t, l_t, p):
    """Unnormalised partial attention of query t over keys j0..j1-1 of kv head hkv, for the G
    query heads sharing it, so each key and value row is read once: a [G, D] = Σ_s e^(score - m)
    v_s, m_t [G] the running max of the scores and l_t the sum of e^(score - m); p [G, BLOCK]
    scratch. An empty range leaves m = -inf, l = 0, a = 0. Every caller passes a, m_t, l_t as
    the same kind of view (of 4-D and 3-D arrays), so this compiles once: one code, one set of
    bits. The fp32 cache: k = (k,), v = (v,) [Hkv, S, D]."""
    G, D = a.shape
    h0 = hkv * G
    a[:] = 0
    m_t[:] = -np.inf
    l_t[:] = 0
    q_t, k_h, v_h = q[t], k[0][hkv], v[0][hkv]                        # [Hq, D], [S, D]
    for jb in range(j0, j1, BLOCK):
        n = min(BLOCK, j1 - jb)
        # q·k: every head of the group against 4 keys a tile (in L1) before the next ones
        j = 0
        while j + SCORE_KEYS <= n and D % LANES == 0:  # other head dims: one score at a time
            _group_scores(q_t, k_h, p, h0, G, jb + j, j)
            j += SCORE_KEYS
        for j in range(j, n):
            for g in range(G):
                fp32_rows.one(q_t, k_h, p, h0 + g, jb + j, g, j)
        _online_softmax(p, n, a, m_t, l_t)
        _weighted_rows(p, v_h, a, jb, n)


def _attend_range_q8(q, k, v, t, hkv, j0, j1, a, m_t, l_t, p):
    """_attend_range over a Q8_0 cache, k = (codes [Hkv, S, D] int8, scales [Hkv, S, nb]) and
    v alike, for the query rounded to Q8_0: q = (codes [T, Hq, D], scales [T, Hq, nb], 128 ·
    the codes' sum per block [T, Hq, nb]). `q8_scores` is bound per ISA (make_q8_scores)."""
    G, D = a.shape
    h0 = hkv * G
    a[:] = 0
    m_t[:] = -np.inf
    l_t[:] = 0
    qq, qd, qc = q[0][t], q[1][t], q[2][t]                            # [Hq, D], [Hq, nb] x 2
    kq, kd, vq, vd = k[0][hkv], k[1][hkv], v[0][hkv], v[1][hkv]       # [S, D], [S, nb] ...
    for jb in range(j0, j1, BLOCK):
        n = min(BLOCK, j1 - jb)
        for j in range(n):
            q8_scores(qq, qd, qc, kq, kd, p, h0, G, jb + j, j)
        _online_softmax(p, n, a, m_t, l_t)
        _weighted_rows_q8(p, vq, vd, a, jb, n)


@kernel
def _online_softmax(p, n, a, m_t, l_t):
    """The scores p[:, :n] of a block of keys (times 1/sqrt(D)) -> their weights e^(s - m), the
    running maxima m_t, sums l_t and accumulated rows a rescaled to the new maxima."""
    G, D = a.shape
    scale = np.float32(1 / np.sqrt(D))
    for g in range(G):
        for j in range(n):
            p[g, j] *= scale
    for g in range(G):
        m_new = _row_max(p, g, n, m_t[g])
        rescale = np.exp(m_t[g] - m_new)
        total = np.float32(0)
        for j in range(n):
            p[g, j] = mathf.exp(p[g, j] - m_new)
            total += p[g, j]
        l_t[g] = l_t[g] * rescale + total
        m_t[g] = m_new
        if rescale != 1:
            for d in range(D):
                a[g, d] *= rescale


@kernel
def _query(item, T, Hkv, per):
    """The query and kv head of an item: kv heads outermost, so a thread's run of items reads
    one head's keys and values (at full size 1 MB for 512 keys: L2), not both in turn; queries
    in pairs (t, T-1-t), so every contiguous run of items has the same causal work (each thread
    takes a contiguous run). `per` items a (query, kv head) pair (its ranges)."""
    hkv = (item // per) % Hkv
    rank = item // (per * Hkv)
    return (rank // 2 if rank % 2 == 0 else T - 1 - rank // 2), hkv


def attend_share(thread, n_threads, args):
    """A thread's contiguous run of items (jit.omp.fork; also ops/attention_step.py's). With
    ranges in acc [R, T, Hq, D] (R > 0; m, l [R, T, Hq]): the items are (query, kv head, key
    range) triples, range r of each pair into acc[r] (empty where the query has fewer keys),
    merged later (combine_head). With R = 0: the items are (query, kv head) pairs, each its
    ranges in turn into scratch (one range: into o itself) and merged into o there, without
    partial outputs for the whole pass. The same calls either way, so the same bits; one call
    site of each kernel (each site is optimised apart: a first run's compile time). A fork, not
    a prange: called from inside another compiled function (attention_step), a prange launch
    cost several times the work on 2 threads, and the parfors took 5 s of a first compile."""
    q, k, v, start, acc, m, l, gate, o = args
    T, Hq, D = o.shape
    Hkv = k[0].shape[0]
    G = Hq // Hkv
    per_range = acc.shape[0] > 0
    n_scratch = 0 if per_range else n_ranges(start + T)
    part = np.empty((n_scratch, 1, G, D), dtype=np.float32)       # a pair's acc [R, 1, G, D]
    pm = np.empty((n_scratch, 1, G), dtype=np.float32)
    pl = np.empty((n_scratch, 1, G), dtype=np.float32)
    p = np.empty((G, BLOCK), dtype=np.float32)
    o4 = o.reshape(1, T, Hq, D)
    per = acc.shape[0] if per_range else 1
    n_items = per * T * Hkv
    for item in range(thread * n_items // n_threads, (thread + 1) * n_items // n_threads):
        t, hkv = _query(item, T, Hkv, per)
        h0 = hkv * G
        n_keys = start + t + 1
        if per_range:
            r0, r1 = item % per, item % per + 1
            dst, dt, dh, mm, ll, mt, mh = acc, t, h0, m, l, t, h0
        else:
            r0, r1 = 0, n_ranges(n_keys)
            dst, dt, dh = (o4, t, h0) if r1 == 1 else (part, 0, 0)
            mm, ll, mt, mh = pm, pl, 0, 0
        for r in range(r0, r1):
            _attend_range(q, k, v, t, hkv, r * RANGE_KEYS, min(n_keys, (r + 1) * RANGE_KEYS),
                          dst[r, dt, dh:dh + G], mm[r, mt, mh:mh + G], ll[r, mt, mh:mh + G], p)
        if not per_range:
            for g in range(G):
                _combine(dst, dt, dh + g, pm, pl, mt, g, r1, gate[t, h0 + g], o[t, h0 + g],
                         r1 == 1)  # mt (0), not a literal 0: that compiled _combine twice


@kernel(fastmath=False)
def _combine(acc, at, ah, m, l, mt, mh, R, gate_row, o_row, in_place):
    """o_row = the R key ranges' partials acc[s, at, ah] (maxima m[s, mt, mh], sums l) each
    rescaled to the common max, / their sum · sigmoid(gate_row). No fast-math: the same bits from
    every caller. in_place: acc[0, at, ah] is o_row itself (one range, accumulated in o), so the
    loop reads and writes one array and vectorises."""
    D = o_row.shape[0]
    m_max = m[0, mt, mh]
    for s in range(1, R):
        m_max = max(m_max, m[s, mt, mh])
    total = np.float32(0)
    for s in range(R):
        total += np.exp(m[s, mt, mh] - m_max) * l[s, mt, mh]
    w = np.exp(m[0, mt, mh] - m_max) / total
    if in_place:
        for d in range(D):
            o_row[d] = w * o_row[d] * mathf.sigmoid(gate_row[d])
        return
    a_row = acc[0, at, ah]
    for d in range(D):
        o_row[d] = w * a_row[d]
    for s in range(1, R):
        w = np.exp(m[s, mt, mh] - m_max) / total
        a_row = acc[s, at, ah]
        for d in range(D):
            o_row[d] += w * a_row[d]
    for d in range(D):
        o_row[d] *= mathf.sigmoid(gate_row[d])


@kernel
def combine_head(acc, m, l, start, gate, o, th):
    """o[t, h] for th = t·Hq + h from attend_share's ranges (the query's own: n_ranges of its
    keys). acc may be o itself, as [1, T, Hq, D] (one range)."""
    Hq = o.shape[1]
    t, h = th // Hq, th % Hq
    _combine(acc, t, h, m, l, t, h, n_ranges(start + t + 1), gate[t, h], o[t, h],
             acc.shape[0] == 1 and acc.ctypes.data == o.ctypes.data)


def _combine_share(thread, n_threads, args):
    acc, m, l, start, gate, o = args
    n = o.shape[0] * o.shape[1]
    for th in range(thread * n // n_threads, (thread + 1) * n // n_threads):
        combine_head(acc, m, l, start, gate, o, th)


def _attention_body(q, k, v, start, acc, m, l, gate, o):
    """The items over the threads (one fork); with key ranges in acc, every (query, head)
    merged after them (another)."""
    fork((q, k, v, start, acc, m, l, gate, o))
    if acc.shape[0] > 0:
        fork_combine((acc, m, l, start, gate, o))


_attention_kernel = omp.forking_kernel(_attention_body, fork=attend_share,
                                       fork_combine=_combine_share)
_q8_kernels: dict = {}


def _q8_kernel(isa: Isa):
    """The Q8_0 cache's kernel for `isa`: attend_share over _attend_range_q8 with its scores."""
    if isa not in _q8_kernels:
        label = f"q8_{isa.label}"
        attend_range = kernel(_attend_range_q8, variant=isa.label, q8_scores=make_q8_scores(isa))
        _q8_kernels[isa] = omp.forking_kernel(
            bind(_attention_body, label), fork=bind(attend_share, label,
                                                    _attend_range=attend_range),
            fork_combine=_combine_share)
    return _q8_kernels[isa]()


@kernel(fastmath=False)
def _quantize_queries(q, qq, qd, qc):
    """q [T, Hq, D] -> its Q8_0 codes, scales and 128 · the codes' sum per block (the keys'
    rounding: ops/kv_quant.py)."""
    for t in range(q.shape[0]):
        for h in range(q.shape[1]):
            kv_quant.quantize_row(q[t, h], qq[t, h], qd[t, h], qc[t, h])
            for b in range(qc.shape[2]):
                qc[t, h, b] *= 128


def _check_cache(op: str, k, v, D: int) -> tuple[int, int]:
    """(Hkv, S) of the caches k, v: fp32 [Hkv, S, D], or Q8Rows of that shape."""
    if not isinstance(k, Q8Rows):
        Hkv, S = check_array(op, "k", k, np.float32, (None, None, D)).shape[:2]
        check_array(op, "v", v, np.float32, (Hkv, S, D))
        return Hkv, S
    if not isinstance(v, Q8Rows):
        raise FermijitError(f"{op}: k is Q8_0 rows, v is not")
    if D % kv_quant.BLOCK:
        raise FermijitError(f"{op}: a Q8_0 cache needs a head dim of whole "
                            f"{kv_quant.BLOCK}-blocks, got {D}")
    Hkv, S = check_array(op, "k codes", k.qs, np.int8, (None, None, D)).shape[:2]
    for name, rows in (("k", k), ("v", v)):
        check_array(op, f"{name} codes", rows.qs, np.int8, (Hkv, S, D))
        check_array(op, f"{name} scales", rows.d, np.float32, (Hkv, S, D // kv_quant.BLOCK))
    return Hkv, S


def cpu(q, k, v, gate, start, out=None, isa: Isa | None = None):
    """`reference`, fp32 out. Allocates only scratch: per-head maxima and sums, the [G, BLOCK]
    scores, the partial outputs of key ranges ([R, T, Hq, D] for short passes, a query's for
    others) and, for a Q8_0 cache, the rounded queries. `isa`: the Q8_0 kernel's variant (the
    process's by default); the fp32 kernel has one."""
    op = "attention"
    T, Hq, D = check_array(op, "q", q, np.float32, ndim=3).shape
    Hkv, S = _check_cache(op, k, v, D)
    check_array(op, "gate", gate, np.float32, (T, Hq, D))
    if Hkv == 0 or Hq % Hkv:
        raise FermijitError(f"{op}: {Hq} query heads is not a multiple of {Hkv} kv heads")
    if not isinstance(start, (int, np.integer)) or start < 0 or start + T > S:
        raise FermijitError(f"{op}: start {start!r} with {T} queries needs a cache of "
                            f"start + T positions, have {S}")
    o = output(op, out, (T, Hq, D))
    attend(q, k, v, gate, int(start), o, isa)
    return o


def attend(q, k, v, gate, start: int, o, isa: Isa | None = None) -> None:
    """`cpu` into o without its checks, for callers whose buffers were made right once (decode's
    ops/attention_step.py). The one compiled kernel of prefill and decode (per cache type): a
    second kernel holding the same attention code took ~3 s more of a first run's compile
    (issue 9)."""
    T, Hq, D = o.shape
    R = 0 if T * k.shape[0] >= SPLIT_ITEMS else n_ranges(start + T)
    if R == 1:
        acc = o.reshape(1, T, Hq, D)                                  # accumulate in place
    else:
        acc = np.empty((R, T, Hq, D), dtype=np.float32)
    m = np.empty((R, T, Hq), dtype=np.float32)
    l = np.empty((R, T, Hq), dtype=np.float32)
    if not isinstance(k, Q8Rows):
        _attention_kernel()(q, (k,), (v,), start, acc, m, l, gate, o)
        return
    nb = D // kv_quant.BLOCK
    rounded = (np.empty((T, Hq, D), np.int8), np.empty((T, Hq, nb), np.float32),
               np.empty((T, Hq, nb), np.int32))
    _quantize_queries(q, *rounded)
    _q8_kernel(isa or jit_cpu.selected_isa())(rounded, (k.qs, k.d), (v.qs, v.d), start, acc, m,
                                              l, gate, o)


# --- GPU (kernels_ptx/attention.ptx: a block per 16 queries of one head, 16-key tiles) ----------

GPU_HEAD_DIMS = (32, 64, 128, 256)  # the D attention.ptx is rendered for


def gpu(q, k, v, gate, start, out=None):
    """As `cpu`; arrays numpy or on the device (fermijit.jit.gpu)."""
    from fermijit.jit import gpu as g

    op = "attention"
    on_device = g.is_device(q) or g.is_device(out)
    T, Hq, D = g.check_array(op, "q", q, np.float32, ndim=3).shape
    Hkv, S = g.check_array(op, "k", k, np.float32, (None, None, D)).shape[:2]
    g.check_array(op, "v", v, np.float32, (Hkv, S, D))
    g.check_array(op, "gate", gate, np.float32, (T, Hq, D))
    if Hkv == 0 or Hq % Hkv:
        raise FermijitError(f"{op}: {Hq} query heads is not a multiple of {Hkv} kv heads")
    if D not in GPU_HEAD_DIMS:
        raise FermijitError(f"{op}: the GPU kernel takes head dims {GPU_HEAD_DIMS}, got {D}")
    if not isinstance(start, (int, np.integer)) or start < 0 or start + T > S:
        raise FermijitError(f"{op}: start {start!r} with {T} queries needs a cache of "
                            f"start + T positions, have {S}")
    o = g.output(op, out, (T, Hq, D))
    if T and Hq:
        g.kernel("attention", HEAD_DIM=D)(
            (-(-T // 16), Hq), (256,), *(g.to_device(op, name, a, np.float32) for name, a in
                                         (("q", q), ("k", k), ("v", v), ("gate", gate))),
            o, T, Hq, Hkv, S, int(start), float(1 / np.sqrt(D)))
    return g.result(op, o, out, on_device)
