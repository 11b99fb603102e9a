"""The Q5_0 and Q5_1 tile in LLVM IR (issue 34): GGUF's 5-bit 32-blocks, as imported, times
fermijit's Q8_0 activations (ops/matvec.py Q8Act in SSSE3's layout, which is natural order),
launched by ops/kquant_matvec.py; the spec is ops/kquant.py `reference`.

    Q5_0: y = sum_b d·dx_b·(sum_i q_i·x_i − 16·sum_i x_i)        q = nibble | bit << 4, 0..31
    Q5_1: y = sum_b d·dx_b·sum_i q_i·x_i + m·dx_b·sum_i x_i

llama.cpp takes Q8_0 activations for Q5_0 and Q8_1 for Q5_1 (ggml-cpu.c vec_dot_type); fermijit
rounds them as for every 32-block product (fp32 scale, the sums exact in xsum8 = 8·Σx).

Per block: the 32 fifth bits spread to bytes (each qh byte to 8 lanes, masked by its bit, 0x10
where set: ggml's `bytes_from_bits_32`), or'ed onto the nibbles (values 0..15 the low nibbles,
16..31 the high), `pmaddubsw` with the activations (pairs at most 2·31·127), `pmaddwd` by ones,
and one fp32 multiply-add of the block's i32 sums by d·dx into a vector accumulator; the offset
term (−16·Σx, or m·Σx) a scalar per block.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from fermijit.jit import simd
from fermijit.jit.simd import F32, I8, I16, I32, I64, Vec, vec
from fermijit.ops import kquant

PREFETCH_BYTES = 4096


def _call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module,
                                        ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _fifth_bits(builder, qh, first: int, n: int):
    """Bytes first..first+n-1 of the block: 0x10 where bit j of the u32 qh is set, else 0."""
    qh8 = builder.bitcast(qh, vec(I8, 4))
    spread = builder.shuffle_vector(qh8, qh8, ir.Constant(vec(I32, n), [
        (first + j) // 8 for j in range(n)]))
    bit = builder.and_(spread, ir.Constant(vec(I8, n), [1 << ((first + j) % 8)
                                                        for j in range(n)]))
    is_set = builder.icmp_unsigned("!=", bit, ir.Constant(vec(I8, n), None))
    return builder.select(is_set, ir.Constant(vec(I8, n), [0x10] * n),
                          ir.Constant(vec(I8, n), None))


def make_tile(fmt: kquant.Format, v: Vec, n_rows: int, n_tok: int):
    """An intrinsic: out[t0 + t, r0 + r] for r < n_rows, t < n_tok (rows of Q5_0/Q5_1 blocks,
    Q8Act tokens: xq [T, K], dx [T, K/32], xsum8 [T, K/32])."""
    w = v.nbytes                       # 16: a block's two halves apart; 32: one register
    has_min = fmt is kquant.Q5_1
    qh_at = 2 * len(fmt.scale_offsets)
    qs_at = qh_at + 4

    def codegen(context, builder, sig, args):
        blocks_a, xq_a, dx_a, xs_a, out_a = [context.make_array(ty)(context, builder, val)
                                             for ty, val in zip(sig.args[:5], args[:5])]
        r0, t0 = args[5], args[6]
        c = lambda n: ir.Constant(I64, n)  # noqa: E731
        _, row_bytes = cgutils.unpack_tuple(builder, blocks_a.shape, 2)
        _, k = cgutils.unpack_tuple(builder, xq_a.shape, 2)
        _, out_cols = cgutils.unpack_tuple(builder, out_a.shape, 2)
        nb = builder.udiv(k, c(32))

        def at(base, index, stride):
            return simd.byte_ptr(builder, base, builder.mul(index, stride))

        rows = [builder.add(r0, c(i)) for i in range(n_rows)]
        toks = [builder.add(t0, c(t)) for t in range(n_tok)]
        w_row = [at(blocks_a.data, r, row_bytes) for r in rows]
        x_row = [at(xq_a.data, t, k) for t in toks]
        dx_row = [at(dx_a.data, t, builder.mul(nb, c(4))) for t in toks]
        xs_row = [at(xs_a.data, t, builder.mul(nb, c(4))) for t in toks]
        facc = vec(F32, w // 4)
        acc = [[cgutils.alloca_once_value(builder, ir.Constant(facc, None))
                for _ in range(n_tok)] for _ in range(n_rows)]
        macc = [[cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0))
                 for _ in range(n_tok)] for _ in range(n_rows)]
        ones = ir.Constant(vec(I16, w // 2), [1] * (w // 2))

        with cgutils.for_range(builder, nb) as loop:
            b = loop.index
            w_off = builder.mul(b, c(fmt.block_bytes))
            units = []
            for i in range(n_rows):
                simd.prefetch(builder, w_row[i], builder.add(w_off, c(PREFETCH_BYTES)))
                scales = simd.fp16_to_f32(v, builder, simd.load(builder, w_row[i], w_off,
                                                                 vec(I16, 2)))
                d, m = (builder.extract_element(scales, ir.Constant(I32, j)) for j in (0, 1))
                qh = simd.load_scalar(builder, w_row[i], builder.add(w_off, c(qh_at)), I32)
                qs = simd.load(builder, w_row[i], builder.add(w_off, c(qs_at)), vec(I8, 16))
                halves = (builder.and_(qs, ir.Constant(vec(I8, 16), [0x0F] * 16)),
                          builder.lshr(qs, ir.Constant(vec(I8, 16), [4] * 16)))
                if w == 32:
                    regs = [builder.shuffle_vector(halves[0], halves[1], ir.Constant(
                        vec(I32, 32), list(range(32))))]
                else:
                    regs = list(halves)
                regs = [builder.or_(q, _fifth_bits(builder, qh, w * p, w))
                        for p, q in enumerate(regs)]
                units.append((regs, d, m))
            for t in range(n_tok):
                x_off = builder.mul(b, c(32))
                xs = [simd.load(builder, x_row[t], builder.add(x_off, c(w * p)), vec(I8, w))
                      for p in range(32 // w)]
                dx = simd.load_scalar(builder, dx_row[t], builder.mul(b, c(4)), F32)
                xsum8 = builder.sitofp(simd.load_scalar(builder, xs_row[t], builder.mul(b, c(4)),
                                                        I32), F32)
                for i, (regs, d, m) in enumerate(units):
                    s16 = None
                    for q, x in zip(regs, xs):   # i16 pairs: at most 2·2·31·127 = 15748
                        part = _call(builder, v.pmaddubsw, vec(I16, w // 2), [q, x])
                        s16 = part if s16 is None else builder.add(s16, part)
                    s32 = _call(builder, v.pmaddwd, vec(I32, w // 4), [s16, ones])
                    ddx = builder.fmul(d, dx)
                    scaled = builder.fmul(builder.sitofp(s32, facc),
                                          simd.splat(builder, ddx, w // 4))
                    builder.store(builder.fadd(builder.load(acc[i][t]), scaled), acc[i][t])
                    # Subtracted at the end: Q5_0 16·Σx·d·dx (= 2·xsum8·d·dx), Q5_1 −m·dx·Σx.
                    term = (builder.fmul(builder.fmul(m, dx), builder.fmul(
                        xsum8, ir.Constant(F32, -0.125))) if has_min
                        else builder.fmul(ddx, builder.fmul(xsum8, ir.Constant(F32, 2.0))))
                    builder.store(builder.fadd(builder.load(macc[i][t]), term), macc[i][t])

        for i in range(n_rows):
            for t in range(n_tok):
                y = builder.fsub(simd.hsum(builder, builder.load(acc[i][t])),
                                 builder.load(macc[i][t]))
                index = builder.add(builder.mul(toks[t], out_cols), rows[i])
                builder.store(y, builder.bitcast(at(out_a.data, index, c(4)), F32.as_pointer()))
        return context.get_dummy_value()

    @intrinsic
    def tile(typingctx, blocks, xq, dx, xsum8, out, r0, t0):
        return types.none(blocks, xq, dx, xsum8, out, r0, t0), codegen

    return tile
