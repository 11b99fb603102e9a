"""The SIMD tiles of CPU attention (ops/attention.py), emitted in LLVM IR: the scores of a group of
query heads against keys (fp32 rows, or Q8_0 codes by integer dot products per ISA), the weighted
sum of value rows, the maximum of a row of scores. Their arithmetic is plain IR without fast-math
flags: each output is one fixed sequence of fp32 operations, whatever tile or thread computes it.

Letters: as ops/attention.py.
"""

from __future__ import annotations

import functools

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from fermijit.jit import cpu as jit_cpu
from fermijit.jit import mathf, simd
from fermijit.jit.cpu import Isa
from fermijit.jit.simd import F32, I8, I32, I64, vec
from fermijit.ops import fp32_rows
from fermijit.ops.fp32_rows import LANES

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
def group_scores(typingctx, q_t, k_h, p, h0, n_heads, key, j):
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


# Decode reads a kv head's keys and values once, from memory, 64-key block by block: a 32-byte
# column of the block's rows at a time (transposed_keys, weighted_q8_rows: 256-byte strides the
# hardware prefetchers followed late) or row by row (make_q8_scores, dequantized_rows). Each of
# those loops prefetches what it reads of the rows PREFETCH_KEYS further on, non-temporal
# (prefetchnta: into L1, not into L2 or the last-level cache); past the cache's end the address
# is never read (a prefetch cannot fault). No arithmetic changes.
# - Why at all: 16k keys, 4 full-size layers, 1 thread, a Zen 5, without prefetches vs with
#   (prefetcht1, 64 keys ahead): AVX-512 VNNI 88 -> 60 ns a key-head (1.49x), AVX2 1.25x, SSE
#   (westmere) 1.05-1.07x; at 16 threads attention alone on the GPU machine's host no change
#   (compute-bound there: 136 ns a key-head of thread time over a cold cache and hot).
# - Why non-temporal, 16 keys ahead (session 34): at 16k positions a token's 180 MB of KV went
#   through L2 into the last-level cache, the likely reason the token's other ops ran slower
#   than at 64 positions (a profiled token's MoE, products and glue +0.3-0.8 ms; gone in a round
#   with prefetchnta). Decode at 16k of its 64-position rate, full-size reap128, 16 threads,
#   fresh processes of `tests/gpu_longctx.sh paired16k` interleaved on one host
#   (tests/host_ab.sh): prefetcht1 at 64 keys 82.8 / 78.4 %, prefetchnta at 16 keys 89.9 / 90.6
#   %, prefetchnta at 64 keys 81.0 % (likely its lines left L1 before they were read).
#   Here (2-core Zen 3, AVX2) attention alone at 1 and 2 threads the same or slightly faster;
#   a 4-layer slice of reap128 at 16k, 2 threads, 3 interleaved fresh rounds: decode at 16k
#   86.1 % of 64 positions against 87.5 (noise), CPU prefill 305.6 tok/s against 277.0.
PREFETCH_KEYS = 16
PREFETCH_TO = 0  # LLVM's locality 0: prefetchnta


def _prefetch_ahead(builder, data, row, stride, offset):
    """Prefetch byte `offset` of row `row` + PREFETCH_KEYS (row stride `stride`); nothing where
    PREFETCH_KEYS is 0 (tests/longctx_attention_ab.py compiles that for its A/B)."""
    if PREFETCH_KEYS:
        ahead = builder.mul(builder.add(row, ir.Constant(I64, PREFETCH_KEYS)), stride)
        simd.prefetch(builder, data, builder.add(ahead, offset), PREFETCH_TO)


# --- Q8_0 scores ---------------------------------------------------------------------------------

# Query heads a Q8_0 score tile takes against one key (the first dividing the group's heads, else
# one at a time): the key's registers loaded and made unsigned once for them. AVX2 and SSE: all
# 8 of the full-size model's, 3 of the default model's; decode scores alone (full size, haswell
# and westmere targets, 1 thread) 82 and 135 ns a key visit, against 94 and 185 by 2 heads.
Q8_HEAD_GROUPS = {Isa.AVX512VNNI: (4, 3), Isa.AVX2: (8, 3, 2), Isa.SSSE3: (8, 3, 2)}
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

    Steps of Q8_STEP_REGISTERS registers of the ISA into an fp32 accumulator of a lane per block,
    summed; then halving steps for the rest (D = 32, 64 ...), each summed and added in turn.
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
            with cgutils.for_range(builder, builder.udiv(builder.add(nb, c(1)), c(2))) as line:
                _prefetch_ahead(builder, kqa.data, keyv, stride(kqa),
                                builder.mul(line.index, c(64)))
            _prefetch_ahead(builder, kda.data, keyv, stride(kda), c(0))

            def tile(g0, n_heads):
                heads = [builder.add(builder.add(h0v, g0), c(g)) for g in range(n_heads)]
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
                        if size == full:                  # accumulated over the full steps
                            acc = accs[g]
                            builder.store(builder.fadd(builder.load(acc), term), acc)
                        else:                             # a halving step runs at most once
                            builder.store(builder.fadd(builder.load(totals[g]),
                                                       simd.hsum(builder, term)), totals[g])

                accs = [cgutils.alloca_once_value(builder, ir.Constant(vec(F32, full), None))
                        for _ in range(n_heads)]
                totals = [cgutils.alloca_once(builder, F32) for _ in range(n_heads)]
                n_full = builder.udiv(nb, c(full))
                with cgutils.for_range(builder, n_full) as loop:
                    step(full, builder.mul(loop.index, c(full)))
                for g in range(n_heads):
                    builder.store(simd.hsum(builder, builder.load(accs[g])), totals[g])
                done = builder.mul(n_full, c(full))
                for size in sizes[1:]:                      # the rest: each size at most once
                    has = builder.icmp_unsigned("!=", builder.and_(builder.sub(nb, done),
                                                                   c(size)), c(0))
                    with builder.if_then(has):
                        step(size, done)
                    done = builder.add(done, builder.select(has, c(size), c(0)))
                p_row = stride(pa)
                for g in range(n_heads):
                    total = builder.load(totals[g])
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


@intrinsic
def weighted_rows(typingctx, p, v, a, j0, n):
    """a[g] += Σ_{j < n} p[g, j] · v[j0 + j] for every row g of a: per run of PV_VECTORS 16-float
    vectors of the rows (then single vectors, then leftover floats), head_groups()' rows at a
    time held in registers over the keys, each key's run of v read once for them (from L1).
    Every a[g, d] sums its keys in order, fused multiply-adds where the target has them (half
    the instructions of the fp32 cache's and the Q8_0 cache's largest part): the rows taken
    together never change a bit."""
    sig = types.none(p, v, a, j0, n)

    def codegen(context, builder, sig, args):
        pa, va, aa = (context.make_array(sig.args[i])(context, builder, args[i])
                      for i in range(3))
        j0v, nv = args[3:5]
        c = lambda x: ir.Constant(I64, x)  # noqa: E731
        n_rows, d = cgutils.unpack_tuple(builder, aa.shape, 2)
        v_stride = builder.extract_value(va.strides, 0)

        def rows(row0, n_heads, width, offs):
            """rows row0..row0+n_heads-1 of a, the floats at byte offsets offs (width 0:
            single floats), over the n keys."""
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
                v_row = builder.mul(builder.add(j0v, key.index), v_stride)
                xs = [load(va.data, builder.add(v_row, o)) for o in offs]
                for p_row, row_accs in zip(p_rows, accs):
                    w = simd.load_scalar(builder, pa.data, builder.add(
                        p_row, builder.mul(key.index, c(4))), F32)
                    w = simd.splat(builder, w, LANES) if width else w
                    for acc, x in zip(row_accs, xs):
                        builder.store(simd.muladd(builder, w, x, builder.load(acc)), acc)
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
        return context.get_dummy_value()

    return sig, codegen


# A Q8_0 weighted-value tile: query heads held in registers (tried in turn, else one at a time)
# and vectors of each head's row, so that each value vector is converted from int8 once for all
# the tile's heads. 32 vector registers (AVX-512): all 8 of the full-size model's group, a whole
# 32-dim block (16 accumulators). AVX2: 8 heads of one LANES (16-float) vector, 2 ymm each, where
# a pair of heads over a whole block converted every vector 4 times (half the weighted values'
# instructions were conversions). 8-float vectors there (8 accumulators, no spills, the same
# bits) ran 1.5x faster alone on values in cache but slower in the kernel (191.7 against 177.5
# ns a key-head, 1 thread, 16k keys; session 33).
def q8_value_tile() -> tuple:
    """(head group sizes, vectors of a row) of a weighted_q8_rows tile."""
    return ((8, 4, 3), 32 // LANES if "avx512f" in jit_cpu.target_features() else 1)


@intrinsic
def weighted_q8_rows(typingctx, p, vq, vd, a, j0, n):
    """weighted_rows over Q8_0 values: a[g] += Σ_{j < n} p[g, j] · x_j for every row g of a,
    x_j = vq[j0 + j] · vd[j0 + j] per 32-block (codes converted to fp32 times the scale: the
    dequantised value, bit for bit) made in registers per key and block, never stored (staging a
    64-key block as fp32, 64 KB at D = 256, went through L2: a quarter of a 16k decode step's
    attention). Per q8_value_tile() vectors of a 32-dim block, its heads at a time in registers
    over the keys; each a[g, d] sums its keys in order with the same fused multiply-adds as
    weighted_rows, so the bits are weighted_rows' over the dequantised rows."""
    sig = types.none(p, vq, vd, a, j0, n)

    def codegen(context, builder, sig, args):
        pa, qa, da, aa = (context.make_array(sig.args[i])(context, builder, args[i])
                          for i in range(4))
        j0v, nv = args[4:6]
        c = lambda x: ir.Constant(I64, x)  # noqa: E731
        n_rows = builder.extract_value(aa.shape, 0)
        nb = builder.extract_value(da.shape, 1)
        q_stride, d_stride, a_stride, p_stride = (builder.extract_value(x.strides, 0)
                                                  for x in (qa, da, aa, pa))
        vf = vec(F32, LANES)
        heads, n_vec = q8_value_tile()

        def tile(b, first, row0, n_heads):
            """Vectors first..first+n_vec-1 of block b of rows row0.. (the block's first tile
            prefetches: its rows' bytes are the next tiles' too)."""
            a_rows = [builder.mul(builder.add(row0, c(h)), a_stride) for h in range(n_heads)]
            p_rows = [builder.mul(builder.add(row0, c(h)), p_stride) for h in range(n_heads)]
            cols = [builder.mul(builder.add(builder.mul(b, c(32)), c((first + u) * LANES)), c(4))
                    for u in range(n_vec)]
            accs = [[cgutils.alloca_once_value(builder, simd.load(builder, aa.data,
                                                                  builder.add(r, o), vf))
                     for o in cols] for r in a_rows]
            with cgutils.for_range(builder, nv) as key:
                row = builder.add(j0v, key.index)
                if first == 0:
                    _prefetch_ahead(builder, qa.data, row, q_stride, builder.mul(b, c(32)))
                    _prefetch_ahead(builder, da.data, row, d_stride, c(0))
                scale = simd.splat(builder, simd.load_scalar(builder, da.data, builder.add(
                    builder.mul(row, d_stride), builder.mul(b, c(4))), F32), LANES)
                q_row = builder.add(builder.mul(row, q_stride), builder.mul(b, c(32)))
                xs = [builder.fmul(builder.sitofp(simd.load(builder, qa.data, builder.add(
                    q_row, c((first + u) * LANES)), vec(I8, LANES)), vf), scale)
                      for u in range(n_vec)]
                for p_row, row_accs in zip(p_rows, accs):
                    w = simd.splat(builder, simd.load_scalar(builder, pa.data, builder.add(
                        p_row, builder.mul(key.index, c(4))), F32), LANES)
                    for acc, x in zip(row_accs, xs):
                        builder.store(simd.muladd(builder, w, x, builder.load(acc)), acc)
            for r, row_accs in zip(a_rows, accs):
                for acc, o in zip(row_accs, cols):
                    dst = simd.byte_ptr(builder, aa.data, builder.add(r, o))
                    builder.store(builder.load(acc), builder.bitcast(dst, vf.as_pointer()),
                                  align=4)

        with cgutils.for_range(builder, nb) as block:
            for first in range(0, 32 // LANES, n_vec):
                _in_groups(builder, n_rows, heads,
                           lambda row0, size: tile(block.index, first, row0, size))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def row_max(typingctx, p, g, n, m0):
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


@intrinsic
def merged_row(typingctx, a, a_r, c, c_r):
    """a[d] = c · a[d] + c_r · a_r[d] for every d (contiguous fp32 rows of one length): two
    products and a sum, rounded each, 16 at a time, then the leftover floats the same way, so
    every element has the bits of the scalar loop. Numba left that loop scalar (no fast-math:
    LLVM kept it unvectorised), 65 ranges x 16 heads x 256 floats a layer of decode at 16k."""
    if not all(isinstance(x, types.Array) and x.layout == "C" for x in (a, a_r)):
        return None
    sig = types.none(a, a_r, c, c_r)

    def codegen(context, builder, sig, args):
        aa, ra = (context.make_array(sig.args[i])(context, builder, args[i]) for i in range(2))
        cv, crv = args[2:4]
        c = lambda x: ir.Constant(I64, x)  # noqa: E731
        n = builder.extract_value(aa.shape, 0)
        n_vec = builder.udiv(n, c(LANES))

        def merge(offset, ty, scale, scale_r):
            ptr = builder.bitcast(simd.byte_ptr(builder, aa.data, offset), ty.as_pointer())
            x = builder.load(ptr, align=4)
            y = builder.load(builder.bitcast(simd.byte_ptr(builder, ra.data, offset),
                                             ty.as_pointer()), align=4)
            builder.store(builder.fadd(builder.fmul(scale, x), builder.fmul(scale_r, y)), ptr,
                          align=4)

        cs, crs = simd.splat(builder, cv, LANES), simd.splat(builder, crv, LANES)
        with cgutils.for_range(builder, n_vec) as loop:
            merge(builder.mul(loop.index, c(4 * LANES)), vec(F32, LANES), cs, crs)
        with cgutils.for_range(builder, builder.sub(n, builder.mul(n_vec, c(LANES)))) as loop:
            merge(builder.mul(builder.add(builder.mul(n_vec, c(LANES)), loop.index), c(4)), F32,
                  cv, crv)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def zeroed_rows(typingctx, a, n):
    """a[i, g, :] = 0 for i < n and every g of a [., G, D] (a view of C arrays' leading axes: its
    last axis contiguous), LANES floats a store. Numba's `a[i] = 0` on such 'A' views became
    scatters in the AVX-512 build (105 vscatterqps: ~2k floats a key range of decode)."""
    if not (isinstance(a, types.Array) and a.ndim == 3 and a.dtype == types.float32):
        return None
    sig = types.none(a, n)

    def codegen(context, builder, sig, args):
        aa = context.make_array(sig.args[0])(context, builder, args[0])
        nv = args[1]
        c = lambda x: ir.Constant(I64, x)  # noqa: E731
        _, n_rows, d = cgutils.unpack_tuple(builder, aa.shape, 3)
        s0, s1, s2 = cgutils.unpack_tuple(builder, aa.strides, 3)
        n_vec = builder.select(builder.icmp_unsigned("==", s2, c(4)), builder.udiv(d, c(LANES)),
                               c(0))                       # any other layout: a float a store
        with cgutils.for_range(builder, nv) as i, cgutils.for_range(builder, n_rows) as g:
            row = builder.add(builder.mul(i.index, s0), builder.mul(g.index, s1))
            with cgutils.for_range(builder, n_vec) as loop:
                at = simd.byte_ptr(builder, aa.data, builder.add(row, builder.mul(
                    loop.index, c(4 * LANES))))
                builder.store(ir.Constant(vec(F32, LANES), None),
                              builder.bitcast(at, vec(F32, LANES).as_pointer()), align=4)
            with cgutils.for_range(builder, builder.sub(d, builder.mul(n_vec, c(LANES)))) as loop:
                at = simd.byte_ptr(builder, aa.data, builder.add(row, builder.mul(builder.add(
                    builder.mul(n_vec, c(LANES)), loop.index), s2)))
                builder.store(ir.Constant(F32, 0), builder.bitcast(at, F32.as_pointer()))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def exp_row(typingctx, p, g, n, m):
    """p[g, j] = e^(p[g, j] - m) for j < n (mathf's exp, 16 at a time: Numba left that loop
    mostly scalar, an eighth of a decode step's attention) -> their sum: 16-lane partial sums
    in order, added by halving, then the leftover scores in order."""
    sig = types.float32(p, g, n, m)

    def codegen(context, builder, sig, args):
        pa = context.make_array(sig.args[0])(context, builder, args[0])
        gv, nv, mv = args[1:4]
        c = lambda x: ir.Constant(I64, x)  # noqa: E731
        vf = vec(F32, LANES)
        row = builder.mul(gv, builder.extract_value(pa.strides, 0))
        ms = simd.splat(builder, mv, LANES)
        acc = cgutils.alloca_once_value(builder, ir.Constant(vf, None))
        n_vec = builder.udiv(nv, c(LANES))
        with cgutils.for_range(builder, n_vec) as loop:
            ptr = builder.bitcast(simd.byte_ptr(builder, pa.data, builder.add(
                row, builder.mul(loop.index, c(4 * LANES)))), vf.as_pointer())
            e = mathf.emit_exp(builder, builder.fsub(builder.load(ptr, align=4), ms))
            builder.store(e, ptr, align=4)
            builder.store(builder.fadd(builder.load(acc), e), acc)
        total = cgutils.alloca_once_value(builder, simd.hsum(builder, builder.load(acc)))
        with cgutils.for_range(builder, builder.sub(nv, builder.mul(n_vec, c(LANES)))) as loop:
            j = builder.add(builder.mul(n_vec, c(LANES)), loop.index)
            ptr = builder.bitcast(simd.byte_ptr(builder, pa.data, builder.add(
                row, builder.mul(j, c(4)))), F32.as_pointer())
            e = mathf.emit_exp(builder, builder.fsub(builder.load(ptr), mv))
            builder.store(e, ptr)
            builder.store(builder.fadd(builder.load(total), e), total)
        return builder.load(total)

    return sig, codegen


@intrinsic
def dequantized_rows(typingctx, vq, vd, rows, j0, n):
    """rows[j] = vq[j0 + j] · vd[j0 + j] per 32-block (the Q8_0 values, fp32) for j < n: 16
    codes at a time widened, converted and scaled in registers (Numba's loop of this stayed
    scalar: half of a 16k-position decode step's attention). The head dim is whole blocks."""
    sig = types.none(vq, vd, rows, j0, n)

    def codegen(context, builder, sig, args):
        qa, da, ra = (context.make_array(sig.args[i])(context, builder, args[i])
                      for i in range(3))
        j0v, nv = args[3:5]
        c = lambda x: ir.Constant(I64, x)  # noqa: E731
        nb = builder.extract_value(da.shape, 1)
        q_stride, d_stride, r_stride = (builder.extract_value(a.strides, 0)
                                        for a in (qa, da, ra))
        vf = vec(F32, LANES)
        with cgutils.for_range(builder, nv) as row:
            key = builder.add(j0v, row.index)
            q_row, d_row = builder.mul(key, q_stride), builder.mul(key, d_stride)
            r_row = builder.mul(row.index, r_stride)
            _prefetch_ahead(builder, da.data, key, d_stride, c(0))
            with cgutils.for_range(builder, nb) as block:
                _prefetch_ahead(builder, qa.data, key, q_stride, builder.mul(block.index, c(32)))
                scale = simd.splat(builder, simd.load_scalar(builder, da.data, builder.add(
                    d_row, builder.mul(block.index, c(4))), F32), LANES)
                for half in range(2):
                    col = builder.add(builder.mul(block.index, c(32)), c(half * LANES))
                    codes = simd.load(builder, qa.data, builder.add(q_row, col),
                                      vec(I8, LANES))
                    x = builder.fmul(builder.sitofp(codes, vf), scale)
                    dst = simd.byte_ptr(builder, ra.data, builder.add(r_row,
                                                                      builder.mul(col, c(4))))
                    builder.store(x, builder.bitcast(dst, vf.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


# --- Q8_0 scores by keys in the lanes (AVX-512 VNNI) --------------------------------------------

KEY_GROUP = 16   # keys a register of the transposed block holds (int32 lanes of a zmm)


def _transpose8(builder, rows):
    """8 vectors <16 x i32>, each two 8-dword rows (lanes 0-7 and 8-15) -> the two 8x8
    transposes side by side (out[j][i] = rows[i][j], out[j][8 + i] = rows[i][8 + j]), by the
    unpack and 128-bit-lane shuffles of the usual 8x8 transpose, each on both halves at once (a
    zmm shuffle the two ymm ones took)."""
    def shuffle(x, y, mask):  # mask: an 8x8 transpose's, on each half of x and y
        lanes = ([m if m < 8 else m + 8 for m in mask]
                 + [m + 8 if m < 8 else m + 16 for m in mask])
        return builder.shuffle_vector(x, y, ir.Constant(vec(I32, 16), lanes))

    lo32, hi32 = [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]
    lo64, hi64 = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
    lo128, hi128 = [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]
    t = []
    for i in range(0, 8, 2):
        t += [shuffle(rows[i], rows[i + 1], lo32), shuffle(rows[i], rows[i + 1], hi32)]
    u = []
    for i in (0, 4):                                   # t0..t3 from rows 0-3, t4..t7 from 4-7
        u += [shuffle(t[i], t[i + 2], lo64), shuffle(t[i], t[i + 2], hi64),
              shuffle(t[i + 1], t[i + 3], lo64), shuffle(t[i + 1], t[i + 3], hi64)]
    return ([shuffle(u[j], u[j + 4], lo128) for j in range(4)]
            + [shuffle(u[j], u[j + 4], hi128) for j in range(4)])


def make_transposed_keys(unsigned: bool):
    """An intrinsic transposed(kq, kd, kt, kdt, ka, j0, n): keys j0..j0+n-1 (n <= BLOCK) of one
    kv head, laid out for scores by keys in the lanes: kt [nb, 8, BLOCK] int32 holds dword w of
    block b of key i at [b, w, i], kdt [nb, BLOCK] the scales. `unsigned`: the bytes made code +
    128, as vpdpbusd takes them (ka unused); else the codes as they are and their magnitudes in
    ka (kt's shape: pmaddubsw's unsigned operand, the codes' signs put on the query's bytes).
    Lanes past n repeat key j0+n-1 (read, never used)."""

    @intrinsic
    def transposed(typingctx, kq, kd, kt, kdt, ka, j0, n):
        return types.none(kq, kd, kt, kdt, ka, j0, n), functools.partial(
            _transposed_codegen, unsigned)

    return transposed


def _transposed_codegen(unsigned, context, builder, sig, args):
    qa, da, ta, sa, aba = (context.make_array(sig.args[i])(context, builder, args[i])
                           for i in range(5))
    j0v, nv = args[5:7]
    c = lambda x: ir.Constant(I64, x)  # noqa: E731
    nb = builder.extract_value(da.shape, 1)
    width = builder.extract_value(ta.shape, 2)       # BLOCK
    q_stride, d_stride = (builder.extract_value(a.strides, 0) for a in (qa, da))
    last = builder.sub(nv, c(1))
    v8 = vec(I32, 8)
    flip = ir.Constant(vec(I32, 16), [0x80808080 - (1 << 32)] * 16)

    def key_row(i):                                  # the row index of lane i, clamped
        return builder.add(j0v, builder.select(
            builder.icmp_unsigned("<", c(i), nv), c(i), last))

    def store(vector, at):                           # <16 x i32> at byte `at` of kt or kdt
        builder.store(vector, builder.bitcast(at, vector.type.as_pointer()), align=4)

    # Sixteen keys at a time (keys i0 + i and i0 + 8 + i in the halves of one register,
    # so each shuffle transposes two 8x8 tiles), each group's row offsets computed once and
    # its stores by adds: the 64 rows' offsets held across the block loop were spilled and
    # reloaded, and every prefetch, load and store address multiplied anew (~300
    # instructions a key, the stage 57-77 ns of a key-head's 170-260 on the GPU machine's
    # Emerald Rapids host); eight keys at a time took 3 ymm shuffles a key and block.
    row_bytes = builder.mul(width, c(4))             # a [BLOCK] int32 row of kt or kdt
    ahead_q, ahead_d = (builder.mul(c(PREFETCH_KEYS), s) for s in (q_stride, d_stride))
    whole_scale_rows = builder.icmp_unsigned("==", nb, c(8))

    def paired(load_row, offsets):                   # 16 rows -> 8 registers of 2 rows
        return [builder.shuffle_vector(load_row(offsets[i]), load_row(offsets[8 + i]),
                                       ir.Constant(vec(I32, 16), list(range(16))))
                for i in range(8)]

    for i0 in range(0, BLOCK_KEYS, KEY_GROUP):
        rows = [builder.mul(key_row(i0 + i), q_stride) for i in range(KEY_GROUP)]
        d_rows = [builder.mul(key_row(i0 + i), d_stride) for i in range(KEY_GROUP)]
        with cgutils.for_range(builder, nb) as block:
            col = builder.mul(block.index, c(32))
            if PREFETCH_KEYS:
                for r in rows:
                    simd.prefetch(builder, qa.data, builder.add(builder.add(r, ahead_q), col),
                                  PREFETCH_TO)
            loaded = paired(
                lambda r: simd.load(builder, qa.data, builder.add(r, col), v8), rows)
            if unsigned:
                loaded = [builder.xor(x, flip) for x in loaded]
            first = builder.add(builder.mul(builder.mul(block.index, c(8)), row_bytes),
                                c(4 * i0))           # kt[b, 0, i0]
            for w, out in enumerate(_transpose8(builder, loaded)):
                at = builder.add(first, builder.mul(c(w), row_bytes))
                store(out, simd.byte_ptr(builder, ta.data, at))
                if not unsigned:
                    magnitude = simd.abs_i8(builder, builder.bitcast(out, vec(I8, 64)))
                    store(builder.bitcast(magnitude, out.type),
                          simd.byte_ptr(builder, aba.data, at))
        if PREFETCH_KEYS:
            for r in d_rows:
                simd.prefetch(builder, da.data, builder.add(r, ahead_d), PREFETCH_TO)
        with builder.if_else(whole_scale_rows) as (whole, other):
            with whole:                              # 8 scales a key: transposed as the codes
                loaded = paired(lambda r: simd.load(builder, da.data, r, v8), d_rows)
                for b, out in enumerate(_transpose8(builder, loaded)):
                    store(out, simd.byte_ptr(builder, sa.data, builder.add(
                        builder.mul(c(b), row_bytes), c(4 * i0))))
            with other:
                with cgutils.for_range(builder, nb) as block:
                    for i, r in enumerate(d_rows):
                        scale = simd.load_scalar(builder, da.data, builder.add(
                            r, builder.mul(block.index, c(4))), F32)
                        at = builder.add(builder.mul(block.index, row_bytes), c(4 * (i0 + i)))
                        builder.store(scale, builder.bitcast(
                            simd.byte_ptr(builder, sa.data, at), F32.as_pointer()))
    return context.get_dummy_value()


transposed_keys = make_transposed_keys(unsigned=True)   # AVX-512 VNNI's
signed_transposed_keys = make_transposed_keys(unsigned=False)   # AVX2's

BLOCK_KEYS = 64  # keys of a transposed block: ops/attention.py BLOCK


# Keys a pass of scores by key holds in its registers: 4 registers of int32 sums and 4 of fp32
# ones (AVX2: of 8 keys, so two passes over a 64-key block).
BY_KEY_REGISTERS = 4


def make_q8_scores_by_key(isa: Isa):
    """An intrinsic scores(qq, qd, qc, kt, kdt, ka, p, h0, n_heads): p[g, i] for the BLOCK_KEYS
    keys of a transposed block (make_transposed_keys: kt, kdt, ka) and query rows
    h0..h0+n_heads-1 (qq [., D] codes, qd [., nb] scales, qc [., nb] 128 · the codes' sum per
    block). Per block b, the integer sums of a register's keys over the block's 8 dwords w,
    each against the query's dword w (broadcast): with VNNI vpdpbusd of the keys' bytes + 128
    from -128 · Σq, 16 keys a register; on AVX2 pmaddubsw of their magnitudes with the query's
    bytes signed as theirs, then pmaddwd, 8 keys a register (both the exact Σ q · k); converted,
    times qd_b · kd_b and added over b. Each lane the same operations, on either ISA: a key's
    score has the same bits in any lane, block or pass, and on AVX2 as with VNNI."""
    vnni = isa is Isa.AVX512VNNI
    lanes = KEY_GROUP if vnni else 8
    v = simd.AVX512VNNI if vnni else simd.AVX2

    @intrinsic
    def scores(typingctx, qq, qd, qc, kt, kdt, ka, p, h0, n_heads):
        sig = types.none(qq, qd, qc, kt, kdt, ka, p, h0, n_heads)

        def codegen(context, builder, sig, args):
            qqa, qda, qca, ta, sa, aba, pa = (context.make_array(sig.args[i])(
                context, builder, args[i]) for i in range(7))
            h0v, nv = args[7:9]
            c = lambda x: ir.Constant(I64, x)  # noqa: E731
            nb = builder.extract_value(qda.shape, 1)
            stride = lambda arr: builder.extract_value(arr.strides, 0)  # noqa: E731
            vi, vf = vec(I32, lanes), vec(F32, lanes)
            byte = lambda x: builder.bitcast(x, vec(I8, 4 * lanes))  # noqa: E731
            n_groups = min(BY_KEY_REGISTERS, BLOCK_KEYS // lanes)
            with cgutils.for_range(builder, nv) as head:
                h = builder.add(h0v, head.index)
                q_row, s_row = builder.mul(h, stride(qqa)), builder.mul(h, stride(qda))
                p_row = builder.mul(head.index, stride(pa))
                for key0 in range(0, BLOCK_KEYS, n_groups * lanes):
                    acc = [cgutils.alloca_once_value(builder, ir.Constant(vf, None))
                           for _ in range(n_groups)]
                    with cgutils.for_range(builder, nb) as block:
                        b = block.index
                        if vnni:  # the sums start at -128 · Σq: no subtraction after them
                            corr = simd.splat(builder, simd.load_scalar(builder, qca.data,
                                builder.add(builder.mul(h, stride(qca)), builder.mul(b, c(4))),
                                I32), lanes)
                            sums = [builder.sub(ir.Constant(vi, None), corr)] * n_groups
                        else:
                            sums = [ir.Constant(vi, None)] * n_groups
                        for w in range(8):
                            qv = simd.splat(builder, simd.load_scalar(builder, qqa.data,
                                builder.add(q_row, builder.add(builder.mul(b, c(32)),
                                                               c(4 * w))), I32), lanes)
                            row = builder.mul(builder.add(builder.mul(b, c(8)), c(w)),
                                              c(BLOCK_KEYS * 4))
                            for gi in range(n_groups):
                                at = builder.add(row, c(4 * (key0 + lanes * gi)))
                                kv = simd.load(builder, ta.data, at, vi)
                                if vnni:
                                    sums[gi] = simd.dpbusd(v, builder, sums[gi], kv, qv)
                                    continue
                                signed = simd.sign_i8(builder, byte(qv), byte(kv))
                                sums[gi] = builder.add(sums[gi], simd.dot_u8s8(v, builder, [(
                                    byte(simd.load(builder, aba.data, at, vi)), signed)]))
                        qd = simd.splat(builder, simd.load_scalar(builder, qda.data, builder.add(
                            s_row, builder.mul(b, c(4))), F32), lanes)
                        for gi in range(n_groups):
                            kd = simd.load(builder, sa.data, builder.mul(builder.add(
                                builder.mul(b, c(BLOCK_KEYS)), c(key0 + lanes * gi)), c(4)), vf)
                            isum = builder.sitofp(sums[gi], vf)
                            builder.store(simd.muladd(builder, isum, builder.fmul(qd, kd),
                                                      builder.load(acc[gi])), acc[gi])
                    for gi in range(n_groups):
                        dst = simd.byte_ptr(builder, pa.data, builder.add(
                            p_row, c(4 * (key0 + lanes * gi))))
                        builder.store(builder.load(acc[gi]),
                                      builder.bitcast(dst, vf.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return scores
