"""The frame every GGUF-block tile shares (ops/kquant_matvec.py's K-quant tile, ops/q5_tile.py's
Q5 tile): inside an intrinsic's codegen, the row and token pointers of a tile of n_rows x n_tok,
its accumulators (an fp32 vector and a scalar offset term per row and token), and the stores of
out[o0 + t, r0 + r] = hsum(vector) − offset at the end (activation rows t0 + t).

Arguments, in order: blocks uint8 [R, bytes], xq int8 [T, K], scales float32 [T, K/Q], sums
[T, ...] (Q8_K's int16 per 16, or Q8Act's int32 per 32), out float32 [T', R], r0, t0, o0 (o0 is
t0 for a product; a gathered launch writes expert i's rows to out row i), and for a `spread`
tile a row stride: its rows are r0, r0 + stride, ... (separate streams of memory, as
ops/matvec.py's GEMV_STREAMS), not r0, r0 + 1, ....
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from fermijit.jit import simd
from fermijit.jit.simd import F32, I64, vec


class Frame:
    def __init__(self, context, builder, sig, args, n_rows: int, n_tok: int, width: int,
                 block_values: int, sums_per_block_bytes: int, spread: bool = False):
        self.builder = b = builder
        blocks_a, xq_a, s_a, m_a, out_a = [context.make_array(ty)(context, builder, val)
                                           for ty, val in zip(sig.args[:5], args[:5])]
        r0, t0, o0 = args[5], args[6], args[7]
        _, row_bytes = cgutils.unpack_tuple(b, blocks_a.shape, 2)
        _, k = cgutils.unpack_tuple(b, xq_a.shape, 2)
        _, self.out_cols = cgutils.unpack_tuple(b, out_a.shape, 2)
        self.nb = nb = b.udiv(k, self.c(block_values))
        self.out_data = out_a.data
        step = args[8] if spread else self.c(1)
        self.rows = [b.add(r0, b.mul(self.c(i), step)) for i in range(n_rows)]
        self.toks = [b.add(t0, self.c(t)) for t in range(n_tok)]
        self.outs = [b.add(o0, self.c(t)) for t in range(n_tok)]
        self.w_row = [self.at(blocks_a.data, r, row_bytes) for r in self.rows]
        self.x_row = [self.at(xq_a.data, t, k) for t in self.toks]
        self.s_row = [self.at(s_a.data, t, b.mul(nb, self.c(4))) for t in self.toks]
        self.m_row = [self.at(m_a.data, t, b.mul(nb, self.c(sums_per_block_bytes)))
                      for t in self.toks]
        self.facc = vec(F32, width // 4)
        self.acc = [[cgutils.alloca_once_value(b, ir.Constant(self.facc, None))
                     for _ in range(n_tok)] for _ in range(n_rows)]
        self.macc = [[cgutils.alloca_once_value(b, ir.Constant(F32, 0.0))
                      for _ in range(n_tok)] for _ in range(n_rows)]

    @staticmethod
    def c(n: int):
        return ir.Constant(I64, n)

    def at(self, base, index, stride):
        return simd.byte_ptr(self.builder, base, self.builder.mul(index, stride))

    def add(self, slot, value) -> None:
        self.builder.store(self.builder.fadd(self.builder.load(slot), value), slot)

    def finish(self) -> None:
        b = self.builder
        for i, r in enumerate(self.rows):
            for t, o in enumerate(self.outs):
                y = b.fsub(simd.hsum(b, b.load(self.acc[i][t])), b.load(self.macc[i][t]))
                index = b.add(b.mul(o, self.out_cols), r)
                b.store(y, b.bitcast(self.at(self.out_data, index, self.c(4)), F32.as_pointer()))


def tile_intrinsic(codegen, spread: bool = False):
    """The intrinsic `tile(blocks, xq, scales, sums, out, r0, t0, o0)` of a codegen (with
    `spread`, a last argument `stride`: the rows' distance)."""
    if spread:
        @intrinsic
        def spread_tile(typingctx, blocks, xq, scales, sums, out, r0, t0, o0, stride):
            return types.none(blocks, xq, scales, sums, out, r0, t0, o0, stride), codegen

        return spread_tile

    @intrinsic
    def tile(typingctx, blocks, xq, scales, sums, out, r0, t0, o0):
        return types.none(blocks, xq, scales, sums, out, r0, t0, o0), codegen

    return tile
