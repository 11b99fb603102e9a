"""The CPU-prefill W4A8 GEMM (T > 1): rows in the vector lanes, tokens in registers.

The GEMV tile (ops.matvec) puts blocks in the lanes: per (row, token) and 16 blocks it pays 8
multiply-adds and ~15 more instructions to reduce the lanes to one sum per block and scale it.
Here one register holds one dword (4 weights) of each of D rows (D = register bytes / 4: 16 for
AVX-512, 8 for AVX2, 4 for SSE), so a block's integer sum for D rows is 8 multiply-adds of those
registers by the token's activation dwords broadcast, with no reduction at all; its scale is one
multiply (dW of D rows times the token's dx) and one fused multiply-add into D fp32 sums, which
are the output row's D values: stored as they are. Per (D rows, token, block): 8 multiply-adds
(vpdpbusd, or pmaddubsw and a pmaddwd per block) and 4 other instructions.

Q4_0 stores a row's block as 16 contiguous bytes, so a panel of D-row groups is first packed
("transposed") into a thread's scratch: per group and block 8 registers, 4 of low nibbles and 4 of
high nibbles (dword j of every row), and D fp32 scales. The packing is paid once per group per
launch and reused over all the tokens (of the expert, in the MoE).

Activations are Q8Act's, whatever its ISA layout: each block's two 16-byte halves are found at
offsets precomputed per layout (`_x_offsets`). The offset form is as in ops.matvec: unsigned
nibbles times signed activations, minus 8·Σxq per block in integers (exact), then
y += (isum · (dW·dx)). Every output element is computed by the same instructions whatever the
thread count or token tiling (lanes never mix rows, the token loop never mixes tokens).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from fermijit.jit import omp, simd
from fermijit import FermijitError
from fermijit.jit.cpu import Isa, bind, kernel, supported
from fermijit.jit.omp import jobs_starting_in
from fermijit.jit.simd import F32, I8, I16, I32, I64, Vec, vec
from fermijit.ops.quant import BLOCK

# Tokens per tile: the D-row group's 8 weight registers are loaded once per block and used for
# this many tokens, each with an fp32 accumulator register (AVX-512: 8 + 8 of 32 registers).
# Measured, 1 thread (GFLOP/s at 2048x2048x512, 1024x2048x32, 768x384x512): AVX-512 4: 301, 617,
# 685; 8: 340, 631, 691; 12: 289, 516, 643. AVX2 2: 370, 368, 334; 4: 326, 98, 315; 8: 400, 402,
# 378 (spills to L1 cost less than reloading the group's registers). SSSE3 2-8 alike (127-141).
TILE_TOKENS = {Isa.AVX512VNNI: 8, Isa.AVX2: 8, Isa.SSSE3: 2}
# A thread packs this many bytes of weight groups at a time (held in L2 with a block of tokens).
PANEL_BYTES = 1 << 17
# Tokens' activations read per panel pass: a block of this many bytes stays in L2 while the
# panel's groups run over it.
TOKEN_BYTES = 1 << 17
PF_LINES = 2  # lines of the next group's weights (and of its scales) a tile prefetches a block


def pf_every(isa: Isa) -> int:
    """Blocks between a tile's prefetches (0: none, the next group's weights prefetched at once
    before the tiles, as before): SSSE3's tiles of 2 tokens and 4 rows have too little work a
    block (every block: grouped GEMMs 9.5 % slower at the default model's shapes, hot; every
    4th: 4.5 %)."""
    return 0 if isa is Isa.SSSE3 else 16 // rows_per_group(isa)
UNITS = 8   # registers per group and block: dwords 0..3 of the low nibbles, then of the high


def rows_per_group(isa: Isa) -> int:
    return simd.VEC_OF[isa].nbytes // 4


@lru_cache(maxsize=None)
def x_offsets(isa: Isa, nb: int) -> np.ndarray:
    """[nb, 2] int64: byte offsets in a Q8Act token row of each block's elements 0..15 and
    16..31 (ops.matvec's layout: the full-width steps, then half-width steps, then natural)."""
    from fermijit.ops.matvec import blocks_per_step  # matvec imports this module
    v = simd.VEC_OF[isa]
    half = simd.HALF_OF.get(isa)
    step = blocks_per_step(v)
    whole = nb // step * step
    reg = 16 * v.lanes
    half_step = 4 * half.lanes if half else 0
    half_end = whole + ((nb - whole) // half_step * half_step if half else 0)
    offs = np.empty((nb, 2), np.int64)
    for b in range(nb):
        if b < whole:
            w = b % step
            lo = (b - w) * 32 + (w // v.lanes) * 2 * reg + (w % v.lanes) * 16
            hi = lo + reg
        elif b < half_end:
            w = (b - whole) % half_step
            lo = (b - w) * 32 + (w // half.lanes) * 32 * half.lanes + (w % half.lanes) * 16
            hi = lo + 16 * half.lanes
        else:
            lo = b * 32
            hi = lo + 16
        offs[b] = lo, hi
    offs.flags.writeable = False
    return offs


@lru_cache(maxsize=None)
def identity_rows(n: int) -> np.ndarray:
    """xrows for a product whose row t reads activation row t (read-only, made once per n)."""
    rows = np.arange(n, dtype=np.int64)
    rows.flags.writeable = False
    return rows


def _data(context, builder, ty, val):
    return context.make_array(ty)(context, builder, val)


def _transpose(builder, rows):
    """n vectors of n elements (n a power of two) -> their transpose: log2(n) rounds of
    interleaving row i with row i + n/2 (lower halves, then upper halves)."""
    n = len(rows)
    lo = ir.Constant(vec(I32, n), [j // 2 + (j % 2) * n for j in range(n)])
    hi = ir.Constant(vec(I32, n), [n // 2 + j // 2 + (j % 2) * n for j in range(n)])
    for _ in range(n.bit_length() - 1):
        pairs = [(rows[i], rows[i + n // 2]) for i in range(n // 2)]
        rows = [out for a, b in pairs for out in (builder.shuffle_vector(a, b, lo),
                                                  builder.shuffle_vector(a, b, hi))]
    return rows


def _concat(builder, parts):
    """Vectors of one type, concatenated in order."""
    while len(parts) > 1:
        n = 2 * parts[0].type.count
        parts = [builder.shuffle_vector(parts[i], parts[i + 1],
                                        ir.Constant(vec(I32, n), list(range(n))))
                 for i in range(0, len(parts), 2)]
    return parts[0]


def _lane_transpose(builder, regs):
    """4 registers of 32-bit elements -> the 4 x 4 transpose within each 128-bit lane: element
    4L + k of result j is element 4L + j of regs[k] (punpckldq/hdq, then punpcklqdq/hqdq)."""
    n = regs[0].type.count

    def unpack(a, b, width, high):  # per lane: a's and b's low (or high) halves, interleaved
        mask = []
        for lane in range(0, n, 4):
            base = lane + (2 if high else 0)
            for i in range(0, 2, width):
                mask += [base + i + w for w in range(width)]
                mask += [n + base + i + w for w in range(width)]
        return builder.shuffle_vector(a, b, ir.Constant(vec(I32, n), mask))

    t = [unpack(regs[0], regs[1], 1, False), unpack(regs[0], regs[1], 1, True),
         unpack(regs[2], regs[3], 1, False), unpack(regs[2], regs[3], 1, True)]
    return [unpack(t[0], t[2], 2, False), unpack(t[0], t[2], 2, True),
            unpack(t[1], t[3], 2, False), unpack(t[1], t[3], 2, True)]


def _make_pack(v: Vec):
    """pack(qs, d, r0, bq, bs, g): rows r0..r0+D-1 (clamped to the last row: lanes past the end
    are computed and never stored) of Q4_0 weights into group g of the scratch: bq [.., nb, 8, D]
    dwords of nibbles, bs [.., nb, D] fp32 scales."""
    n_rows = v.nbytes // 4

    @intrinsic
    def pack(typingctx, qs, d, r0, bq, bs, g):
        sig = types.none(qs, d, r0, bq, bs, g)

        def codegen(context, builder, sig, args):
            qs_a, d_a, bq_a, bs_a = (_data(context, builder, sig.args[i], args[i])
                                     for i in (0, 1, 3, 4))
            r0v, gv = args[2], args[5]
            c = lambda n: ir.Constant(I64, n)  # noqa: E731
            n_all, qs_stride = cgutils.unpack_tuple(builder, qs_a.shape, 2)
            _, nb = cgutils.unpack_tuple(builder, d_a.shape, 2)
            last = builder.sub(n_all, c(1))
            rows = []
            for i in range(n_rows):
                r = builder.add(r0v, c(i))
                rows.append(builder.select(builder.icmp_signed(">", r, last), last, r))
            qs_row = [simd.byte_ptr(builder, qs_a.data, builder.mul(r, qs_stride)) for r in rows]
            d_row = [simd.byte_ptr(builder, d_a.data, builder.mul(r, builder.mul(nb, c(2))))
                     for r in rows]
            q_base = builder.mul(builder.mul(gv, nb), c(UNITS * v.nbytes))
            s_base = builder.mul(builder.mul(gv, nb), c(4 * n_rows))
            v4 = vec(I32, 4)
            vq = vec(I32, n_rows)
            lo_mask = ir.Constant(vq, [0x0F0F0F0F] * n_rows)
            four = ir.Constant(vq, [4] * n_rows)
            n_lanes = n_rows // 4  # 128-bit lanes of a register
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                blk = [simd.load(builder, p, builder.mul(b, c(BLOCK // 2)), v4) for p in qs_row]
                # Register m holds row 4L + m's 16 bytes in lane L; a 4 x 4 transpose of dwords
                # within each lane (unpack dwords, then qwords) leaves dword j of all D rows in
                # order in one register (a shuffle of the D rows concatenated was twice as many
                # instructions: vpermt2d from 4 zmm per j).
                regs = [_concat(builder, [blk[4 * lane + m] for lane in range(n_lanes)])
                        for m in range(4)]
                dwords = _lane_transpose(builder, regs)
                dst = builder.add(q_base, builder.mul(b, c(UNITS * v.nbytes)))
                for j, dword in enumerate(dwords):
                    for half, val in ((0, builder.and_(dword, lo_mask)),
                                      (4, builder.and_(builder.lshr(dword, four), lo_mask))):
                        off = builder.add(dst, c((j + half) * v.nbytes))
                        builder.store(val, builder.bitcast(simd.byte_ptr(builder, bq_a.data, off),
                                                           vq.as_pointer()), align=1)

            def store_scales(b, s):  # block b's D fp32 scales
                off = builder.add(s_base, builder.mul(b, c(4 * n_rows)))
                builder.store(s, builder.bitcast(simd.byte_ptr(builder, bs_a.data, off),
                                                 vec(F32, n_rows).as_pointer()), align=1)

            # Scales D blocks at a time: each row's D scales one load and one conversion, then a
            # D x D transpose (16 scalar loads and inserts a block were a third of the pack).
            whole = builder.mul(builder.sdiv(nb, c(n_rows)), c(n_rows))
            with cgutils.for_range_slice(builder, c(0), whole, c(n_rows)) as (b0, _):
                rows_s = [simd.fp16_to_f32(v, builder, simd.load(
                    builder, p, builder.mul(b0, c(2)), vec(I16, n_rows))) for p in d_row]
                for k, s in enumerate(_transpose(builder, rows_s)):
                    store_scales(builder.add(b0, c(k)), s)
            with cgutils.for_range_slice(builder, whole, nb, c(1)) as (b, _):
                h = ir.Constant(vec(I16, n_rows), None)
                for i, p in enumerate(d_row):
                    h = builder.insert_element(h, simd.load_scalar(builder, p, builder.mul(b, c(2)),
                                                                   I16), ir.Constant(I32, i))
                store_scales(b, simd.fp16_to_f32(v, builder, h))
            return context.get_dummy_value()

        return sig, codegen

    return pack


L2 = 2  # LLVM's prefetch locality for prefetcht1: into L2, where the packs and tiles read


@intrinsic
def prefetch_bytes(typingctx, a, lo, hi):
    """Prefetch (into L2) the lines of bytes lo..hi-1 of array a's data (all at once: a burst of
    hundreds is mostly dropped, so a group's weights go a few lines a tile block instead)."""
    sig = types.none(a, lo, hi)

    def codegen(context, builder, sig, args):
        data = _data(context, builder, sig.args[0], args[0]).data
        lo, hi = args[1], args[2]
        n_lines = builder.sdiv(builder.add(builder.sub(hi, lo), ir.Constant(I64, 63)),
                               ir.Constant(I64, 64))
        with cgutils.for_range(builder, n_lines) as loop:
            simd.prefetch(builder, data, builder.add(
                lo, builder.mul(loop.index, ir.Constant(I64, 64))), L2)
        return context.get_dummy_value()

    return sig, codegen


def _make_tile(v: Vec, n_tok: int):
    """tile(bq, bs, g, xq, dx, xsum8, xoff, xrows, out, r0, n_valid, t0, pq, q_lo, q_hi, pd,
    d_lo, d_hi): out[t0+t, r0+i] for t < n_tok, i < n_valid (<= D), from packed group g and
    activation rows xrows[t0+t] (the MoE's slots read their tokens' rows in place: no gathered
    copy). Every pf_every(isa)-th block step i also prefetches the cache lines at bytes q_lo +
    64·PF_LINES·i + 64·j (j < PF_LINES) of pq while below q_hi, and likewise of pd (the next
    group's weights and scales, a few lines at a time: `_run_group`)."""
    n_rows = v.nbytes // 4
    has_fma = v.isa is not Isa.SSSE3

    @intrinsic
    def tile(typingctx, bq, bs, g, xq, dx, xsum8, xoff, xrows, out, r0, n_valid, t0, pq, q_lo,
             q_hi, pd, d_lo, d_hi):
        sig = types.none(bq, bs, g, xq, dx, xsum8, xoff, xrows, out, r0, n_valid, t0, pq, q_lo,
                         q_hi, pd, d_lo, d_hi)

        def codegen(context, builder, sig, args):
            bq_a, bs_a, xq_a, dx_a, xs_a, xo_a, xr_a, out_a = (
                _data(context, builder, sig.args[i], args[i]) for i in (0, 1, 3, 4, 5, 6, 7, 8))
            gv, r0v, n_valid, t0v = args[2], args[9], args[10], args[11]
            c = lambda n: ir.Constant(I64, n)  # noqa: E731
            _, nb = cgutils.unpack_tuple(builder, dx_a.shape, 2)
            _, out_cols = cgutils.unpack_tuple(builder, out_a.shape, 2)
            vi, vf = vec(I32, n_rows), vec(F32, n_rows)
            q_base = simd.byte_ptr(builder, bq_a.data,
                                   builder.mul(builder.mul(gv, nb), c(UNITS * v.nbytes)))
            s_base = simd.byte_ptr(builder, bs_a.data,
                                   builder.mul(builder.mul(gv, nb), c(4 * n_rows)))
            toks = [builder.add(t0v, c(t)) for t in range(n_tok)]
            x_toks = [simd.load_scalar(builder, xr_a.data, builder.mul(t, c(8)), I64)
                      for t in toks]
            xq_row = [simd.byte_ptr(builder, xq_a.data, builder.mul(t, builder.mul(nb, c(32))))
                      for t in x_toks]
            dx_row = [simd.byte_ptr(builder, dx_a.data, builder.mul(t, builder.mul(nb, c(4))))
                      for t in x_toks]
            xs_row = [simd.byte_ptr(builder, xs_a.data, builder.mul(t, builder.mul(nb, c(4))))
                      for t in x_toks]
            acc = [cgutils.alloca_once_value(builder, ir.Constant(vf, None)) for _ in toks]
            fma = (cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(vf, [vf, vf, vf]), f"llvm.fma.v{n_rows}f32")
                if has_fma else None)
            pf_ranges = [(_data(context, builder, sig.args[i], args[i]).data, args[i + 1],
                          args[i + 2]) for i in (12, 15)]
            # The next group's output line of each token, for writing: small K leaves too few
            # multiply-adds per output line to hide its fetch (the default model's 512-token
            # prefill 1.05-1.15x faster at 1 thread, 5 rounds).
            every = pf_every(v.isa)
            for t in (toks if every else ()):
                nxt = builder.add(builder.add(builder.mul(t, out_cols), r0v), c(n_rows))
                simd.prefetch(builder, out_a.data, builder.mul(nxt, c(4)), L2, write=True)
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                is_pf = builder.icmp_signed("==", builder.srem(b, c(max(every, 1))), c(0))
                with builder.if_then(is_pf):
                    for base, lo, hi in (pf_ranges if every else ()):
                        for j in range(PF_LINES):
                            off = builder.add(lo, builder.mul(builder.sdiv(b, c(every)),
                                                              c(64 * PF_LINES)))
                            off = builder.add(off, c(64 * j))
                            with builder.if_then(builder.icmp_signed("<", off, hi)):
                                simd.prefetch(builder, base, off, L2)
                units = [simd.load(builder, q_base, builder.add(
                    builder.mul(b, c(UNITS * v.nbytes)), c(j * v.nbytes)), vec(I8, v.nbytes))
                    for j in range(UNITS)]
                dw = simd.load(builder, s_base, builder.mul(b, c(4 * n_rows)), vf)
                offs = simd.load(builder, xo_a.data, builder.mul(b, c(16)), vec(I64, 2))
                x_off = [builder.extract_element(offs, ir.Constant(I32, h)) for h in range(2)]
                for t in range(n_tok):
                    xs = [simd.splat(builder, simd.load_scalar(
                        builder, xq_row[t], builder.add(x_off[j // 4], c(4 * (j % 4))), I32),
                        n_rows) for j in range(UNITS)]
                    pairs = [(u, builder.bitcast(x, vec(I8, v.nbytes))) for u, x in zip(units, xs)]
                    isum = simd.dot_u8s8(v, builder, pairs)
                    corr = simd.load_scalar(builder, xs_row[t], builder.mul(b, c(4)), I32)
                    isum = builder.sub(isum, simd.splat(builder, corr, n_rows))
                    dxs = simd.load_scalar(builder, dx_row[t], builder.mul(b, c(4)), F32)
                    scale = builder.fmul(dw, simd.splat(builder, dxs, n_rows))
                    f = builder.sitofp(isum, vf)
                    old = builder.load(acc[t])
                    new = (builder.call(fma, [f, scale, old]) if has_fma
                           else builder.fadd(old, builder.fmul(f, scale)))
                    builder.store(new, acc[t])
            full = builder.icmp_signed("==", n_valid, c(n_rows))
            for t in range(n_tok):
                start = builder.add(builder.mul(toks[t], out_cols), r0v)
                dst = simd.byte_ptr(builder, out_a.data, builder.mul(start, c(4)))
                y = builder.load(acc[t])
                with builder.if_else(full) as (then, otherwise):
                    with then:
                        builder.store(y, builder.bitcast(dst, vf.as_pointer()), align=4)
                    with otherwise:
                        slot = cgutils.alloca_once(builder, vf)
                        builder.store(y, slot)
                        lane = builder.bitcast(slot, F32.as_pointer())
                        with cgutils.for_range(builder, n_valid) as lp:
                            builder.store(builder.load(builder.gep(lane, [lp.index])),
                                          builder.bitcast(simd.byte_ptr(
                                              builder, dst, builder.mul(lp.index, c(4))),
                                              F32.as_pointer()))
            return context.get_dummy_value()

        return sig, codegen

    return tile


# --- launches -----------------------------------------------------------------------------------

def _panel_groups(nb):
    return max(1, PANEL_BYTES // (nb * UNITS * 4 * ROWS))


def _run_group(bq, bs, g, xq, dx, xsum8, xoff, xrows, out, r0, n_valid, t_first, t_end,
               pq, q_lo, q_hi, pd, d_lo, d_hi):
    """Packed group g over tokens t_first..t_end-1: whole tiles, then the rest in tiles of half
    and a quarter of that and single tokens (an expert's tokens are rarely whole tiles; one token
    at a time reloads the group's registers per token). The tiles prefetch bytes q_lo..q_hi-1 of
    pq and d_lo..d_hi-1 of pd a few lines a block (`_make_tile`); what they leave, at the end."""
    if PF_EVERY == 0:  # all at once, before the tiles
        prefetch_bytes(pq, q_lo, q_hi)
        prefetch_bytes(pd, d_lo, d_hi)
        q_lo, d_lo = q_hi, d_hi
    step = (dx.shape[1] + PF_EVERY - 1) // max(PF_EVERY, 1) * 64 * PF_LINES  # bytes a tile
    t = t_first
    while t + TOKS <= t_end:
        tile(bq, bs, g, xq, dx, xsum8, xoff, xrows, out, r0, n_valid, t, pq, q_lo, q_hi, pd,
             d_lo, d_hi)
        t += TOKS
        q_lo += step
        d_lo += step
    if t + HALF <= t_end:
        tile_half(bq, bs, g, xq, dx, xsum8, xoff, xrows, out, r0, n_valid, t, pq, q_lo, q_hi,
                  pd, d_lo, d_hi)
        t += HALF
        q_lo += step
        d_lo += step
    if t + QUARTER <= t_end:
        tile_quarter(bq, bs, g, xq, dx, xsum8, xoff, xrows, out, r0, n_valid, t, pq, q_lo,
                     q_hi, pd, d_lo, d_hi)
        t += QUARTER
        q_lo += step
        d_lo += step
    while t < t_end:
        tile1(bq, bs, g, xq, dx, xsum8, xoff, xrows, out, r0, n_valid, t, pq, q_lo, q_hi, pd,
              d_lo, d_hi)
        t += 1
        q_lo += step
        d_lo += step
    prefetch_bytes(pq, q_lo, q_hi)
    prefetch_bytes(pd, d_lo, d_hi)


def _product_groups(args, bq, bs, first, last):
    """Row groups first..last-1, in panels packed once (into bq, bs), each meeting blocks of
    tokens that stay in L2 with it."""
    qs, d, xq, dx, xsum8, xoff, xrows, out = args
    n_rows = qs.shape[0]
    nb = d.shape[1]
    panel = _panel_groups(nb)
    n_tok = out.shape[0]
    tok_block = max(TOKS, TOKEN_BYTES // (nb * 32) // TOKS * TOKS)
    for g0 in range(first, last, panel):
        g1 = min(g0 + panel, last)
        for g in range(g0, g1):
            pack(qs, d, g * ROWS, bq, bs, g - g0)
        if g1 < last:  # the next panel, at once (its tiles run over all the tokens)
            r1 = min(min(g1 + panel, last) * ROWS, n_rows)
            prefetch_bytes(qs, g1 * ROWS * qs.shape[1], r1 * qs.shape[1])
            prefetch_bytes(d, g1 * ROWS * nb * 2, r1 * nb * 2)
        for t0 in range(0, n_tok, tok_block):
            t1 = min(t0 + tok_block, n_tok)
            for g in range(g0, g1):
                _run_group(bq, bs, g - g0, xq, dx, xsum8, xoff, xrows, out, g * ROWS,
                           min(ROWS, n_rows - g * ROWS), t0, t1, qs, 0, 0, d, 0, 0)


def _product_share(thread, n_threads, args, counter):
    """A thread's row groups: the runs of fine units it claims, or with the claims off its
    static equal run (jit.omp.prefill_first). Each group's tiles, whoever runs them, the same."""
    qs, d = args[0], args[1]
    groups = (qs.shape[0] + ROWS - 1) // ROWS
    first, last = omp.prefill_first(counter, thread, n_threads, groups)
    if first >= last:
        return
    panel = _panel_groups(d.shape[1])
    bq = np.empty(panel * d.shape[1] * UNITS * 4 * ROWS, np.uint8)
    bs = np.empty(panel * d.shape[1] * ROWS, np.float32)
    while first < last:
        _product_groups(args, bq, bs, first, last)
        first, last = omp.prefill_next(counter, thread, n_threads, groups)


def _product_body(qs, d, xq, dx, xsum8, xoff, xrows, out):
    fork((qs, d, xq, dx, xsum8, xoff, xrows, out))


def _grouped_jobs(args, bq, bs, lo, hi, extra):
    """Jobs (expert, row group), in order, each worth its expert's tokens plus `extra`: those
    that start in the work [lo, hi) (routing leaves experts unevenly loaded)."""
    qs, d, offsets, xq, dx, xsum8, xoff, xrows, out = args
    n_experts, n_rows = qs.shape[0], qs.shape[1]
    nb = d.shape[2]
    groups = (n_rows + ROWS - 1) // ROWS
    q_row, d_row = qs.shape[2], nb * 2  # bytes a row
    done = np.int64(0)  # (as in ops/matvec.py: a literal 0 compiled jobs_starting_in twice)
    for e in range(n_experts):
        t0, t1 = offsets[e], offsets[e + 1]
        n = t1 - t0
        if n == 0:
            continue
        if done >= hi:
            break
        g_first, g_end = jobs_starting_in(lo, hi, done, n + extra, groups)
        for g in range(g_first, g_end):
            pack(qs[e], d[e], g * ROWS, bq, bs, 0)
            # The next group's rows (the next expert's first ones after the last group: the
            # experts lie one after another), prefetched while this group's tiles run.
            r_next = e * n_rows + min((g + 1) * ROWS, n_rows)
            r_end = min(r_next + ROWS, n_experts * n_rows)
            _run_group(bq, bs, 0, xq, dx, xsum8, xoff, xrows, out, g * ROWS,
                       min(ROWS, n_rows - g * ROWS), t0, t1, qs, r_next * q_row, r_end * q_row,
                       d, r_next * d_row, r_end * d_row)
        done += (n + extra) * groups


# A grouped job's packing costs about this many tokens' tiles whatever its tokens (1 thread,
# AVX-512, 1024 rows, K 2048: ~1.3 us a job plus ~0.22 a token): claimed runs weigh a job as its
# tokens plus these, so a unit of light experts' jobs costs what a unit of a heavy one's does.
PACK_TOKENS = 6


def _grouped_share(thread, n_threads, args, counter):
    """A thread's jobs: those starting in the runs of the work it claims in fine units (a job
    weighs its tokens plus PACK_TOKENS), or with the claims off those starting in its equal
    share of the work (each job its tokens, as before) (jit.omp.prefill_first)."""
    qs, d, offsets = args[0], args[1], args[2]
    n_experts, n_rows = qs.shape[0], qs.shape[1]
    groups = (n_rows + ROWS - 1) // ROWS
    extra = PACK_TOKENS if omp.prefill_claims() else 0
    total = offsets[n_experts] * groups
    for e in range(n_experts if extra else 0):
        if offsets[e + 1] > offsets[e]:
            total += extra * groups
    lo, hi = omp.prefill_first(counter, thread, n_threads, total)
    if lo >= hi:
        return
    bq = np.empty(d.shape[2] * UNITS * 4 * ROWS, np.uint8)
    bs = np.empty(d.shape[2] * ROWS, np.float32)
    while lo < hi:
        _grouped_jobs(args, bq, bs, lo, hi, extra)
        lo, hi = omp.prefill_next(counter, thread, n_threads, total)


def _grouped_body(qs, d, offsets, xq, dx, xsum8, xoff, xrows, out):
    fork((qs, d, offsets, xq, dx, xsum8, xoff, xrows, out))


def _array(dtype, ndim, readonly=False):
    return types.Array(dtype, ndim, "C", readonly=readonly)


_ACT = (_array(types.int8, 2, True), _array(types.float32, 2, True), _array(types.int32, 2, True),
        _array(types.int64, 2, True), _array(types.int64, 1, True))
_SIGNATURES = {
    _product_body: [types.void(_array(types.uint8, 2, True), _array(types.uint16, 2, True), *_ACT,
                               _array(types.float32, 2))],
    _grouped_body: [types.void(_array(types.uint8, 3, True), _array(types.uint16, 3, True),
                               _array(types.int64, 1, True), *_ACT, _array(types.float32, 2))],
}
_SHARES = {_product_body: _product_share, _grouped_body: _grouped_share}
_kernels: dict = {}


def gemm_kernel(isa: Isa, body, n_tok: int | None = None):
    """The launch `body` (product or grouped) for `isa` and tiles of `n_tok` tokens (default
    TILE_TOKENS), made on first use (so no AVX2 code is compiled for a Westmere target)."""
    n_tok = n_tok or TILE_TOKENS[isa]
    key = (body.__name__, isa, n_tok)
    if key not in _kernels:
        if not supported(isa):  # compiling it here could abort the process (pitfall 5)
            raise FermijitError(f"gemm: this CPU or Numba target cannot run {isa.label}")
        v = simd.VEC_OF[isa]
        threads = "omp" if omp.available() else "serial"
        variant = f"gemm-{isa.label}-{n_tok}-{threads}"
        half, quarter = max(1, n_tok // 2), max(1, n_tok // 4)
        tiles = {n: _make_tile(v, n) for n in {n_tok, half, quarter, 1}}
        helpers = dict(ROWS=v.nbytes // 4, TOKS=n_tok, HALF=half, QUARTER=quarter,
                       tile=tiles[n_tok], tile_half=tiles[half], tile_quarter=tiles[quarter],
                       tile1=tiles[1], PF_EVERY=pf_every(isa))
        run_group = kernel(_run_group, fastmath=False, variant=variant, **helpers)
        bound = dict(helpers, pack=_make_pack(v), _run_group=run_group,
                     _panel_groups=kernel(_panel_groups, fastmath=False, variant=variant,
                                          ROWS=helpers["ROWS"]))
        bound.update({name: kernel(fn, fastmath=False, variant=variant, **bound)
                      for name, fn in (("_product_groups", _product_groups),
                                       ("_grouped_jobs", _grouped_jobs))})
        _kernels[key] = kernel(body, fastmath=False, variant=variant,
                               signatures=_SIGNATURES[body],
                               fork=omp.fork(bind(_SHARES[body], variant, **bound),
                                             chunked=True))
    return _kernels[key]


def product_kernel(isa: Isa):
    """out [T, R] = x · Wᵀ: (qs, d_bits, xq, dx, xsum8, x_offsets, identity_rows(T), out)."""
    return _kernels.get((_product_body.__name__, isa, TILE_TOKENS[isa])) or gemm_kernel(
        isa, _product_body)


def grouped_kernel(isa: Isa):
    """matvec.grouped's launch: (qs, d_bits, offsets, xq, dx, xsum8, x_offsets, xrows, out):
    slot s (row s of out) reads activation row xrows[s]."""
    return _kernels.get((_grouped_body.__name__, isa, TILE_TOKENS[isa])) or gemm_kernel(
        isa, _grouped_body)
