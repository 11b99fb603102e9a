"""Prefill's activation quantisation (matvec.quantize_act for T > 1): the same Q8Act, bit for bit,
in explicit vectors and on every thread.

matvec's kernel (decode's: the fused decode steps call it inside their own kernels) runs at
~1.2 ns an element: LLVM leaves its per-block loops scalar (nothing tells it that the int8 stores
do not alias the fp32 loads) and it finds each block's halves in the ISA layout with four integer
divisions per block. Here a block is two IR sequences of 16-float vectors (`_block_amax`: |x|,
max; `_block_round`: round half away from zero, int8 stores, integer sum: with the scale between
them, the reference's operations in its order, so the same bits), the halves' places come from
`gemm.x_offsets` (the layout, cached per ISA and K), and the token rows are split over the
threads (each row by one thread: the same bits whatever the thread count).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic

from fermijit.jit import simd
from fermijit.jit.cpu import kernel
from fermijit.jit.simd import F32, I8, I32, I64, vec

HALF = 16  # elements of a block's half: one run of xq


def _halves(context, builder, sig, args):
    """Block b of row t of x (args 0, 1, 2): its two 16-float halves."""
    x_a = context.make_array(sig.args[0])(context, builder, args[0])
    tv, bv = args[1], args[2]
    x_row = builder.mul(tv, builder.extract_value(x_a.strides, 0))
    start = builder.add(x_row, builder.mul(bv, ir.Constant(I64, 32 * 4)))
    return [simd.load(builder, x_a.data, builder.add(start, ir.Constant(I64, h * HALF * 4)),
                      vec(F32, HALF)) for h in range(2)]


@intrinsic
def _block_amax(typingctx, x, t, b):
    """max |x[t, 32b:32b+32]|."""
    sig = types.float32(x, t, b)

    def codegen(context, builder, sig, args):
        vf, vi = vec(F32, HALF), vec(I32, HALF)
        # the sign bit cleared (exact), then the larger of each pair down to one
        sign_off = ir.Constant(vi, [0x7FFFFFFF] * HALF)
        mags = [builder.bitcast(builder.and_(builder.bitcast(h, vi), sign_off), vf)
                for h in _halves(context, builder, sig, args)]
        m = builder.select(builder.fcmp_ordered(">", mags[1], mags[0]), mags[1], mags[0])
        n = HALF
        while n > 1:
            n //= 2
            lo_part = builder.shuffle_vector(m, m, ir.Constant(vec(I32, n), list(range(n))))
            hi_part = builder.shuffle_vector(m, m, ir.Constant(vec(I32, n),
                                                               list(range(n, 2 * n))))
            m = builder.select(builder.fcmp_ordered(">", hi_part, lo_part), hi_part, lo_part)
        return builder.extract_element(m, ir.Constant(I32, 0))

    return sig, codegen


@intrinsic
def _block_round(typingctx, x, t, b, xq, lo, hi, inv, xsum8):
    """xq[t, lo:lo+16], xq[t, hi:hi+16] = round-half-away(x[t, 32b:32b+32] · inv),
    xsum8[t, b] = 8·Σ xq."""
    sig = types.none(x, t, b, xq, lo, hi, inv, xsum8)

    def codegen(context, builder, sig, args):
        xq_a, xs_a = (context.make_array(sig.args[i])(context, builder, args[i]) for i in (3, 7))
        tv, bv, lov, hiv = args[1], args[2], args[4], args[5]
        c = lambda n: ir.Constant(I64, n)  # noqa: E731
        vf, vi = vec(F32, HALF), vec(I32, HALF)
        xq_row = builder.mul(tv, builder.extract_value(xq_a.strides, 0))
        inv_v = simd.splat(builder, args[6], HALF)
        total = ir.Constant(vi, None)
        for h, place in zip(_halves(context, builder, sig, args), (lov, hiv)):
            v = builder.fmul(h, inv_v)
            half = builder.select(builder.fcmp_ordered(">=", v, ir.Constant(vf, None)),
                                  ir.Constant(vf, [0.5] * HALF), ir.Constant(vf, [-0.5] * HALF))
            q = builder.fptosi(builder.fadd(v, half), vi)
            total = builder.add(total, q)
            dst = simd.byte_ptr(builder, xq_a.data, builder.add(xq_row, place))
            builder.store(builder.trunc(q, vec(I8, HALF)),
                          builder.bitcast(dst, vec(I8, HALF).as_pointer()), align=1)
        cell = builder.add(builder.mul(tv, builder.extract_value(xs_a.strides, 0)),
                           builder.mul(bv, c(4)))
        sum8 = builder.mul(simd.hsum(builder, total), ir.Constant(I32, 8))
        builder.store(sum8, builder.bitcast(simd.byte_ptr(builder, xs_a.data, cell),
                                            I32.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@kernel(fastmath=False)
def quantize_row(x, t, offsets, xq, dx, xsum8):
    """Row t of x [T, K] into rows t of xq [T, K] (block b's elements 0..15 at offsets[b, 0],
    16..31 at offsets[b, 1]), dx, xsum8 [T, K/32]: the row's maxima first, then its blocks'
    scales and rounding, so that no block's chain of max tree, two divisions and rounding waits
    on the last (T 512, K 384, 1 thread, 2 interleaved rounds: 61-67 -> 55-61 us; K 512: 79-87
    -> 71-72)."""
    for b in range(x.shape[1] // 32):
        dx[t, b] = _block_amax(x, t, b) / np.float32(127.0)
    for b in range(x.shape[1] // 32):
        db = dx[t, b]
        inv = np.float32(1.0) / db if db != 0 else np.float32(0.0)
        _block_round(x, t, b, xq, offsets[b, 0], offsets[b, 1], inv, xsum8)


@kernel(parallel=True, fastmath=False)
def _quantize_rows(x, offsets, xq, dx, xsum8):
    """x [T, K] -> xq [T, K], dx, xsum8 [T, K/32], a row a thread (`quantize_row`)."""
    for t in prange(x.shape[0]):
        quantize_row(x, t, offsets, xq, dx, xsum8)


@kernel(fastmath=False)
def rows_serial(x, offsets, xq, dx, xsum8):
    """`_quantize_rows` on the calling thread, for decode's plans (a token's, or a verify
    step's few rows): matvec's scalar kernel took ~4.5 us a full-size row (2048), each
    residual step's, twice a layer, on the calling thread while the others waited."""
    for t in range(x.shape[0]):
        quantize_row(x, t, offsets, xq, dx, xsum8)


def quantize_rows(x, act) -> None:
    """x [T, K] fp32, C-contiguous (checked by the caller) into `act` (a matvec.Q8Act of that
    shape)."""
    from fermijit.ops import gemm

    _quantize_rows(x, gemm.x_offsets(act.vec.isa, x.shape[1] // 32), act.xq, act.dx, act.xsum8)
