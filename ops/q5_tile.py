"""The Q5_0 and Q5_1 tile in LLVM IR: GGUF's 5-bit 32-blocks, as imported, times
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
from numba.core import cgutils

from fermijit.jit import simd
from fermijit.jit.simd import F32, I8, I16, I32, Vec, vec
from fermijit.ops import kquant
from fermijit.ops.tile_frame import Frame, tile_intrinsic

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
        f = Frame(context, builder, sig, args, n_rows, n_tok, w, 32, 4)
        c = f.c
        ones = ir.Constant(vec(I16, w // 2), [1] * (w // 2))
        with cgutils.for_range(builder, f.nb) as loop:
            b = loop.index
            w_off = builder.mul(b, c(fmt.block_bytes))
            units = []
            for i in range(n_rows):
                simd.prefetch(builder, f.w_row[i], builder.add(w_off, c(PREFETCH_BYTES)))
                scales = simd.fp16_to_f32(v, builder, simd.load(builder, f.w_row[i], w_off,
                                                                 vec(I16, 2)))
                d, m = (builder.extract_element(scales, ir.Constant(I32, j)) for j in (0, 1))
                qh = simd.load_scalar(builder, f.w_row[i], builder.add(w_off, c(qh_at)), I32)
                qs = simd.load(builder, f.w_row[i], builder.add(w_off, c(qs_at)), vec(I8, 16))
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
                xs = [simd.load(builder, f.x_row[t], builder.add(x_off, c(w * p)), vec(I8, w))
                      for p in range(32 // w)]
                dx = simd.load_scalar(builder, f.s_row[t], builder.mul(b, c(4)), F32)
                xsum8 = builder.sitofp(simd.load_scalar(builder, f.m_row[t],
                                                        builder.mul(b, c(4)), I32), F32)
                for i, (regs, d, m) in enumerate(units):
                    s16 = None
                    for q, x in zip(regs, xs):   # i16 pairs: at most 2·2·31·127 = 15748
                        part = _call(builder, v.pmaddubsw, vec(I16, w // 2), [q, x])
                        s16 = part if s16 is None else builder.add(s16, part)
                    s32 = _call(builder, v.pmaddwd, vec(I32, w // 4), [s16, ones])
                    ddx = builder.fmul(d, dx)
                    f.add(f.acc[i][t], builder.fmul(builder.sitofp(s32, f.facc),
                                                    simd.splat(builder, ddx, w // 4)))
                    # Subtracted at the end: Q5_0 16·Σx·d·dx (= 2·xsum8·d·dx), Q5_1 −m·dx·Σx.
                    f.add(f.macc[i][t], builder.fmul(builder.fmul(m, dx), builder.fmul(
                        xsum8, ir.Constant(F32, -0.125))) if has_min
                        else builder.fmul(ddx, builder.fmul(xsum8, ir.Constant(F32, 2.0))))
        f.finish()
        return context.get_dummy_value()

    return tile_intrinsic(codegen)
