"""W4A8 products: Q4_0 weights times activations quantised to int8 per 32-block.

    y[t, r] = sum_b  dW[r, b] · dx[t, b] · sum_j (q[r, b, j] - 8) · xq[t, b, j]

Letters: T tokens, R output rows, K inputs, nb = K/32 blocks. Weights are ops.quant's Q4_0
structure-of-arrays (`qs` uint8 [R, K/2], `d` float16 [R, nb]). Activations are quantised per
token and block with an fp32 scale dx (DESIGN.md, Numerics); `quantize_act` lays them out for the
kernel (`Q8Act`).

One tile body, emitted in LLVM IR from fermijit.jit.simd, serves every ISA and both shapes: the
decode GEMV (a tile of 1 row x 1 token, prefetching its weight stream) and a GEMM whose every
token's row is the GEMV's bit for bit (a tile of rows x tokens: `like_gemv`, for batched decode).
CPU prefill's GEMM is ops.gemm (rows in the lanes: 2-5x this tile's rate). Each launch forks
one OpenMP team (fermijit.jit.omp) and each thread takes one contiguous run of rows: a single
sequential stream of memory per thread.

The inner step takes 4 registers of weight bytes (4·lanes blocks): unsigned nibbles times signed
activations with pmaddubsw+pmaddwd (or vpdpbusd), a phaddd tree to one i32 per block, minus 8·Σxq
in integers (the offset form of notes §1, exact), then one fp32 multiply-add by dW·dx per block.
Blocks past the last whole step go through a one-block SSE step (any K that is whole blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from fermijit import FermijitError
from fermijit.jit import omp, simd
from fermijit.jit.checks import check_array, output
from fermijit.jit.cpu import Isa, bind, decode_isa, kernel, selected_isa, supported
from fermijit.jit.omp import jobs_starting_in
from fermijit.jit.simd import F32, I8, I16, I32, I64, SSE, Vec, vec
from fermijit.ops import fp32_rows, gemm
from fermijit.ops.quant import BLOCK
from fermijit.ops.quantize_rows import quantize_rows

VECTORS_PER_STEP = 4       # the phaddd tree reduces 4 registers at once
# Software prefetch distance in the weight stream. Rows are adjacent in memory, so with one row
# per tile each thread reads one sequential stream and this runs straight ahead of it. Measured
# cold, 2 threads, this machine: 2 KB (one row at K=2048, the notes' best for a single long row)
# 39 GB/s; 4, 8 and 16 KB 41-43 alike (512x2048: 33 -> 36).
PREFETCH_BYTES = 4096
# Rows a GEMV tile reads side by side, sharing its activation loads: each from its own
# sequential run of the thread's rows (row r and r + n/2 of n), since interleaved adjacent rows
# (r, r + 1) broke the hardware prefetcher's streams: cold 2048x2048 at 33-56 % of the read
# probe against 78-87 % for one row. Same-run A/B, this machine (decode-scripts/s4/tileab.py):
# AVX-512 1 thread hot 28 -> 37 GB/s, cold 78 -> 90-96 % of the probe (K 512: 72 -> 93 %);
# 2 threads cold 87 -> 95 %; AVX2 cold 79 -> 104 %. Three streams were about as good, four
# worse (86 %, 2 threads). SSE (16 registers) gained nothing: 1.
GEMV_STREAMS = {Isa.SSSE3: 1, Isa.AVX2: 2, Isa.AVX512VNNI: 2}
# The one-token GEMV's rows side by side, where more streams than GEMV_STREAMS read faster, by
# decode variant and format (the MoE's gate_up pairs stay GEMV_STREAMS'; a verify step's few
# tokens' tiles take these too: FEW_TOKENS). Intel AVX-512 2-core VM (AVX2 decode, its Q8_0 with vpdpbusd on ymm: _few_tokens_vec),
# cold, 2 threads, one process, 7 interleaved rounds, each walk against a read-probe pass just
# before it, load ~1.7 (issue 29's session, its GEMVs with other tiles): reap128's 80 dense Q4_0
# matrices 2 rows 79.5 % of the probe, 3 rows 83.2, 4 82.7; its 62080x2048 Q8_0 LM head 2 rows
# 74.6 % (85.3 with vpdpbusd), 3 88.3, 4 90.0; a full-size decode token 1.06x (plans of either
# tiles interleaved token by token, load ~1.5). Every row's bits are the one-row tile's anyway.
# Only where decode's AVX2 runs in an AVX-512 VNNI process (as measured: 32 vector registers
# hold the extra rows' weights); with AVX2's 16 not measured, GEMV_STREAMS kept.
GEMV_ROWS = {(Isa.AVX2, "q4_0"): 3, (Isa.AVX2, "q8_0"): 4}
# Activation rows are K bytes (whole 32-blocks) and every load of them is at a multiple of 16, so
# from a 16-byte aligned buffer each is aligned: legacy SSE can then fold them into pmaddubsw's
# memory operand (8 fewer instructions of 60 per 4-block step in the Westmere code).
X_ALIGN = 16
# Prefill's activation and output buffers start on a cache line: a misaligned one splits every
# 64-byte store (the GEMM tiles' zmm rows) over two lines (the default model's 512-token prefill
# ~5 % slower at 1 thread, numpy's buffers starting 16 or 48 bytes into a line).
LINE = 64
# The tile's GEMM shape, for `like_gemv` products (batched decode); prefill runs ops.gemm.
GEMM_TILE = (2, 4)
# A speculative verify step's 2-3 rows (Q4_0 like_gemv, and the Q8_0 LM head) take a tile of
# all of them and the GEMV's rows read side by side (gemv_shape), as the GEMV's (`_few_body`): each weight
# block unpacked once for all tokens, each thread's rows two sequential streams. Earlier, a tile
# of one row (one stream): 1 thread, AVX2, 2 tokens, cold: reap128's 12288x2048 in-projection
# 910 us against 1050-1170 for the (2, 4) tile's one-token tails, 1230-1310 for two GEMVs (one:
# 610-680); its Q8_0 head 47-51 ms against 68-71 two GEMVs (one: 34). Then the side-by-side
# rows, medians of interleaved rounds of each product's ratio to the GEMV, 2 threads, this
# machine (rocketlake, 2 cores, load 2.5-3.5), cold (40 x 12288x2048 Q4_0; 5 x 62080x2048 Q8_0):
# 2 tokens Q4_0 1x2 tile 1.21x, 2x2 tile 1.07x, 2x2 with vpdpbusd (_few_tokens_vec) 1.03x; Q8_0
# 1.72x, 1.11x, 1.03x (1x2 with vpdpbusd 1.05x); 3 tokens Q4_0 1x3 1.51x, 2x3 1.15x, 1.09x;
# Q8_0 1.13x, 1.12x, 1.03x. Since the GEMV reads GEMV_ROWS rows side by side, the few tokens'
# tile reads as many (gemv_shape): cold, 8 full-size layers' dense Q4_0 matrices and the Q8_0 LM
# head, against the 1-token GEMV, medians of interleaved rounds' ratios (dev/prod_probe.py, this
# machine, load ~1.5): 2 tokens, 2 threads, products 1.071 / 1.074 -> 1.030 / 1.033, head 1.061 /
# 1.065 -> 1.021 / 1.025; 1 thread 1.064 -> 1.021, 1.081 -> 1.023; 3 tokens, 2 threads 1.185 ->
# 1.147, 1.076 -> 1.053. Every row's bits are the one-row tile's either way.
FEW_TOKENS = 3
# GEMM cache blocking: a panel of this many bytes of weight rows meets a block of this many bytes
# of activations, both held in L2 (1-2 MiB), instead of every row group reading all T tokens.
PANEL_BYTES = 1 << 17
TOKEN_BYTES = 1 << 17


def blocks_per_step(v: Vec) -> int:
    return VECTORS_PER_STEP * v.lanes


@dataclass(frozen=True)
class Q8Act:
    """Activations quantised for the W4A8 kernels of one ISA.

    Within each step of `blocks_per_step` blocks, register j holds blocks j·lanes..j·lanes+lanes-1:
    first the low halves (elements 0..15) of those blocks, then the high halves, matching the
    nibble split of the weights. After the last whole step, whole steps of the half width
    (simd.HALF_OF, AVX-512 only) are laid out the same way for its lanes; the blocks after those
    keep the natural order (SSE's step layout, then single blocks).
    """

    xq: np.ndarray     # [T, K] int8, in the layout above
    dx: np.ndarray     # [T, nb] float32 scale per block
    xsum8: np.ndarray  # [T, nb] int32, 8·Σ xq per block: the offset correction
    vec: Vec

    def __post_init__(self):
        # Checked once here, not per use: a decode token quantises into the same Q8Acts dozens
        # of times. Aligned, since the kernels fold xq loads into SSE memory operands.
        check_array("Q8Act", "xq", self.xq, np.int8, ndim=2)
        n_tok, k = self.xq.shape
        check_array("Q8Act", "dx", self.dx, np.float32, (n_tok, k // BLOCK))
        check_array("Q8Act", "xsum8", self.xsum8, np.int32, (n_tok, k // BLOCK))
        if k % BLOCK or self.xq.ctypes.data % X_ALIGN:
            raise FermijitError(f"Q8Act: xq must be whole {BLOCK}-blocks, {X_ALIGN}-byte aligned")

    def rows(self, t: np.ndarray, out: "Q8Act | None" = None) -> "Q8Act":
        """The activations of tokens `t` (a copy, aligned as the kernels want), into `out` (a
        Q8Act of len(t) rows of this layout) if given."""
        if out is None:
            out = Q8Act(aligned_empty((len(t), self.xq.shape[1]), np.int8, X_ALIGN),
                        np.empty((len(t), self.dx.shape[1]), np.float32),
                        np.empty((len(t), self.dx.shape[1]), np.int32), self.vec)
        elif out.vec is not self.vec or out.xq.shape != (len(t), self.xq.shape[1]):
            raise FermijitError(f"Q8Act.rows: out holds {list(out.xq.shape)} for "
                                f"{out.vec.isa.label}, need {[len(t), self.xq.shape[1]]} for "
                                f"{self.vec.isa.label}")
        np.take(self.xq, t, axis=0, out=out.xq)
        np.take(self.dx, t, axis=0, out=out.dx)
        np.take(self.xsum8, t, axis=0, out=out.xsum8)
        return out


# --- reference ----------------------------------------------------------------------------------

def quantize_act_reference(x):
    """x [T, K] -> (xq int8 [T, nb, 32], dx float32 [T, nb]), the rounding the kernel uses."""
    xb = x.astype(np.float32).reshape(x.shape[0], -1, BLOCK)
    dx = (np.abs(xb).max(axis=-1) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(dx != 0, np.float32(1) / dx, np.float32(0)).astype(np.float32)
    v = xb * inv[..., None]
    half = np.where(v >= 0, np.float32(0.5), np.float32(-0.5))
    return (v + half).astype(np.int8), dx


def reference(qs, d, x):
    """y = W4A8 product, exact integer block sums, float64 scaling. x [K] or [T, K]."""
    x2 = np.atleast_2d(x)
    xq, dx = quantize_act_reference(x2)                                  # [T, nb, 32], [T, nb]
    rows, nb = d.shape
    q = qs.reshape(rows, nb, BLOCK // 2)
    w = np.concatenate([q & 0x0F, q >> 4], axis=-1).astype(np.int64) - 8  # [R, nb, 32]
    isum = np.einsum("rbj,tbj->trb", w, xq.astype(np.int64))             # [T, R, nb]
    y = np.einsum("trb,rb,tb->tr", isum.astype(np.float64), d.astype(np.float64),
                  dx.astype(np.float64))
    return y[0] if np.ndim(x) == 1 else y


# --- activation quantisation --------------------------------------------------------------------

@kernel(fastmath={"nnan", "nsz", "reassoc"})
def _block_amax(xb):
    """max |x| of one block. A maximum is exact in any order, so fast-math may vectorise it
    (without, LLVM kept a 32-step dependent chain)."""
    amax = np.float32(0.0)
    for j in range(xb.size):
        amax = max(amax, abs(xb[j]))
    return amax


@kernel(fastmath=False)
def _round_half(xb, inv, dst):
    """dst = round-half-away(xb · inv) as int8; returns the sum (contiguous: vectorisable)."""
    total = 0
    for j in range(xb.size):
        v = xb[j] * inv
        q = np.int32(v + np.float32(0.5)) if v >= 0 else np.int32(v - np.float32(0.5))
        total += q
        dst[j] = q
    return total


# No fast-math: the rounding must be the reference's, bit for bit.
@kernel(fastmath=False)
def quantize_blocks(x_t, xq_t, dx_t, xsum8_t, b0, b1, lanes, step_blocks, half_lanes):
    """Blocks [b0, b1) of one token's row x_t [K] into its Q8Act row (xq_t [K], dx_t and
    xsum8_t [nb]): each block's codes, scale and sum depend on that block alone, so a thread may
    quantise the blocks it wrote (the decode MoE's SwiGLU rows, GDN's heads) with the bits of
    the whole row's call."""
    nb = x_t.size // 32
    whole = nb // step_blocks * step_blocks
    reg = 16 * lanes
    half_step = 4 * half_lanes
    half_end = whole + ((nb - whole) // half_step * half_step if half_lanes else 0)
    for b in range(b0, b1):
        xb = x_t[b * 32:b * 32 + 32]
        amax = _block_amax(xb)
        db = amax / np.float32(127.0)
        inv = np.float32(1.0) / db if db != 0 else np.float32(0.0)
        if b < whole:
            w = b % step_blocks
            lo = (b - w) * 32 + (w // lanes) * 2 * reg + (w % lanes) * 16
            hi = lo + reg
        elif b < half_end:
            w = (b - whole) % half_step
            lo = (b - w) * 32 + (w // half_lanes) * 32 * half_lanes + (w % half_lanes) * 16
            hi = lo + 16 * half_lanes
        else:
            lo = b * 32
            hi = lo + 16
        # The two halves go to two places (the layout above): two contiguous runs.
        total = (_round_half(xb[:16], inv, xq_t[lo:lo + 16])
                 + _round_half(xb[16:], inv, xq_t[hi:hi + 16]))
        dx_t[b] = db
        xsum8_t[b] = 8 * total


@kernel(fastmath=False)
def _quantize_act_kernel(x, xq, dx, xsum8, lanes, step_blocks, half_lanes):
    for t in range(x.shape[0]):
        quantize_blocks(x[t], xq[t], dx[t], xsum8[t], 0, x.shape[1] // 32, lanes, step_blocks,
                        half_lanes)


def aligned_empty(shape, dtype=np.float32, align=LINE):
    """np.empty whose data starts on an `align`-byte boundary (malloc gives 16 on x86-64, but
    that is the allocator's choice, not numpy's promise)."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(n + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + n].view(dtype).reshape(shape)


def default_isa(n_tokens: int) -> Isa:
    """The variant products of `n_tokens` run by default: one token is decode's
    (jit.cpu.DECODE_VARIANT), several the process's."""
    return decode_isa() if n_tokens == 1 else selected_isa()


def quantize_act(x: np.ndarray, isa: Isa | None = None, out: Q8Act | None = None) -> Q8Act:
    """x float32 [K] or [T, K] -> Q8Act for the kernels of `isa` (default: `out`'s layout, else
    `default_isa` of x's tokens)."""
    x2 = check_array("quantize_act", "x", np.atleast_2d(x), np.float32)
    v = simd.VEC_OF[isa or (out.vec.isa if out is not None else default_isa(x2.shape[0]))]
    if x2.ndim != 2 or x2.shape[1] % BLOCK:
        raise FermijitError(f"quantize_act: x has shape {list(np.shape(x))}; the last axis must "
                            f"be whole {BLOCK}-blocks")
    n_tok, k = x2.shape
    if out is None:
        out = Q8Act(aligned_empty((n_tok, k), np.int8), np.empty((n_tok, k // BLOCK), np.float32),
                    np.empty((n_tok, k // BLOCK), np.int32), v)
    elif out.vec is not v:
        raise FermijitError(f"quantize_act: out is laid out for {out.vec.isa.label}, "
                            f"not {v.isa.label}")
    elif out.xq.shape != x2.shape:  # the rest was checked when `out` was made
        raise FermijitError(f"quantize_act: out holds {list(out.xq.shape)}, x is "
                            f"{list(x2.shape)}")
    if n_tok > 1:  # prefill: vectors and threads, the same bits (~4x: ops/quantize_rows.py)
        quantize_rows(x2, out)
        return out
    half = simd.HALF_OF.get(v.isa)
    _quantize_act_kernel(x2, out.xq, out.dx, out.xsum8, v.lanes, blocks_per_step(v),
                         half.lanes if half else 0)
    return out


# --- the tile, in IR ----------------------------------------------------------------------------

@dataclass(frozen=True)
class _Format:
    """A weight format as the tile sees it: bytes per 32-block, and whether the weights are
    unsigned nibbles q+8 (Q4_0: subtract 8·Σxq per block) or signed bytes (Q8_0)."""

    name: str
    block_bytes: int
    is_offset: bool


Q4_0 = _Format("q4_0", 16, True)
Q8_0 = _Format("q8_0", 32, False)


def _load_units(fmt: _Format, v: Vec, builder, ptr, off, count: int):
    """`count` weight units at byte `off`; unit j meets activation registers 2j and 2j+1.

    Q4_0: one register of `lanes` blocks, split into its low and high nibbles. Q8_0: two
    registers of `lanes` whole blocks, regrouped per 128-bit lane into the blocks' first halves
    and their second halves (the activations' layout, Q8Act), each with its magnitude, for
    pmaddubsw's unsigned operand.
    """
    c = lambda n: ir.Constant(I64, n)  # noqa: E731
    w = v.nbytes
    if fmt.is_offset:
        return [simd.nibbles(builder, simd.load(builder, ptr, builder.add(off, c(j * w)),
                                                vec(I8, w))) for j in range(count)]
    units = []
    for j in range(count):
        a, b = (simd.load(builder, ptr, builder.add(off, c((2 * j + h) * w)), vec(I8, w))
                for h in range(2))
        if v.lanes == 1:
            halves = (a, b)
        else:  # a | b holds blocks 0..lanes-1 whole: block i's halves at 32i and 32i + 16
            halves = tuple(builder.shuffle_vector(a, b, ir.Constant(vec(I32, w), [
                32 * i + 16 * h + e for i in range(v.lanes) for e in range(16)]))
                for h in range(2))
        if v.dpbusd:  # w + 128 as unsigned bytes (the offset form; see _offset_shift)
            units.append(tuple(builder.xor(q, ir.Constant(q.type, [0x80] * q.type.count))
                               for q in halves))
        else:
            units.append(tuple((simd.abs_i8(builder, q), q) for q in halves))
    return units


def _offset_shift(fmt: _Format, v: Vec) -> int | None:
    """How the tile corrects a block's integer sum for unsigned weights w + offset: subtract
    xsum8 (8·Σxq) shifted left by this, or nothing (None: the weights were multiplied signed).
    Q4_0: q = w + 8, always. Q8_0 with VNNI: w + 128 (w xor 0x80) times x in vpdpbusd's exact i32
    sums, less 128·Σxq: 2 instructions a register instead of the sign trick's |w| and sign(x, w)
    (pmaddubsw's i16 pairs would saturate at 255·127·2, hence the sign trick without VNNI)."""
    if fmt.is_offset:
        return 0
    return 4 if v.dpbusd else None


def _unit_sums(fmt: _Format, v: Vec, builder, unit, x_lo, x_hi):
    """Partial sums per block of one unit times its activations (see simd.block_sums)."""
    if fmt.is_offset:
        lo, hi = unit
        pairs = [(lo, x_lo), (hi, x_hi)]
        # Without VNNI stay in i16: block_sums' phaddw tree then needs one pmaddwd, not four.
        return (simd.dot_u8s8(v, builder, pairs) if v.dpbusd
                else simd.dot_u8s8_i16(v, builder, pairs))
    if v.dpbusd:
        return simd.dot_u8s8(v, builder, [(unit[0], x_lo), (unit[1], x_hi)])
    # |w|·sign(x, w) = w·x; each half its own pmaddwd, since two halves of 8-bit products can
    # overflow i16 (2·2·128·127 > 32767).
    (a0, w0), (a1, w1) = unit
    return builder.add(simd.dot_u8s8(v, builder, [(a0, simd.sign_i8(builder, x_lo, w0))]),
                       simd.dot_u8s8(v, builder, [(a1, simd.sign_i8(builder, x_hi, w1))]))


def _make_tile(fmt: _Format, v: Vec, n_rows: int, n_tok: int, spread: bool = False):
    """An intrinsic computing out[o0+t, r0+r] from activations t0+t, for r < n_rows, t < n_tok.
    `spread`: rows r0 + r·gap instead (a last argument, gap), each its own sequential stream."""
    bps = blocks_per_step(v)

    def codegen(context, builder, sig, args):
        arr = [context.make_array(ty)(context, builder, val)
               for ty, val in zip(sig.args[:6], args[:6])]
        qs_a, d_a, xq_a, dx_a, xs_a, out_a = arr
        r0v, t0v, o0v = args[6], args[7], args[8]
        out_cols, qs_stride = cgutils.unpack_tuple(builder, qs_a.shape, 2)  # out [T, R] or [R]
        _, nb = cgutils.unpack_tuple(builder, d_a.shape, 2)
        c = lambda n: ir.Constant(I64, n)  # noqa: E731

        def at(base, index, stride_bytes):
            return simd.byte_ptr(builder, base, builder.mul(index, stride_bytes))

        step_rows = args[9] if spread else c(1)
        rows = [builder.add(r0v, builder.mul(step_rows, c(i))) for i in range(n_rows)]
        toks = [builder.add(t0v, c(t)) for t in range(n_tok)]
        qs_row = [at(qs_a.data, r, qs_stride) for r in rows]
        d_row = [at(d_a.data, r, builder.mul(nb, c(2))) for r in rows]
        xq_row = [at(xq_a.data, t, builder.mul(nb, c(32))) for t in toks]
        dx_row = [at(dx_a.data, t, builder.mul(nb, c(4))) for t in toks]
        xs_row = [at(xs_a.data, t, builder.mul(nb, c(4))) for t in toks]

        qs_ahead = c(PREFETCH_BYTES)
        d_ahead = c(PREFETCH_BYTES * 2 // fmt.block_bytes)

        def steps(sv: Vec, first_block, n_steps):
            """n_steps steps of blocks_per_step(sv) blocks from `first_block` at sv's width,
            into per-(row, token) accumulators of that width, which it returns."""
            sbps, sw = blocks_per_step(sv), sv.nbytes
            facc = vec(F32, sbps)
            acc = [[cgutils.alloca_once_value(builder, ir.Constant(facc, None))
                    for _ in range(n_tok)] for _ in range(n_rows)]
            step_bytes = sbps * fmt.block_bytes
            # Two tokens on 256-bit VNNI registers go side by side in 512-bit ones (PAIRED).
            paired = PAIRED and n_tok == 2 and sv is simd.AVX512VNNI_256
            if paired:
                wide = vec(F32, 2 * sbps)
                acc2 = [cgutils.alloca_once_value(builder, ir.Constant(wide, None))
                        for _ in range(n_rows)]
            with cgutils.for_range(builder, n_steps) as loop:
                b0 = builder.add(first_block, builder.mul(loop.index, c(sbps)))
                qs_off = builder.mul(b0, c(fmt.block_bytes))
                d_off = builder.mul(b0, c(2))
                x_off = builder.mul(b0, c(32))
                f_off = builder.mul(b0, c(4))
                units, scales = [], []
                for i in range(n_rows):
                    for line in range(0, step_bytes, 64):
                        simd.prefetch(builder, qs_row[i],
                                      builder.add(builder.add(qs_off, qs_ahead), c(line)))
                    # The scales are a second stream, as far ahead in rows: a row's scales
                    # are a cache line or two that the hardware prefetcher alone fetched late.
                    simd.prefetch(builder, d_row[i], builder.add(d_off, d_ahead))
                    units.append(_load_units(fmt, sv, builder, qs_row[i], qs_off,
                                             VECTORS_PER_STEP))
                    scales.append(simd.fp16_to_f32(
                        sv, builder, simd.load(builder, d_row[i], d_off, vec(I16, sbps))))
                per_tok = []
                for t in range(n_tok):
                    xs = [simd.load(builder, xq_row[t], builder.add(x_off, c(j * sw)),
                                    vec(I8, sw), X_ALIGN)
                          for j in range(2 * VECTORS_PER_STEP)]
                    dxv = simd.load(builder, dx_row[t], f_off, facc)
                    shift = _offset_shift(fmt, sv)
                    if shift is not None:
                        corr = simd.load(builder, xs_row[t], f_off, vec(I32, sbps))
                        if shift:
                            corr = builder.shl(corr, ir.Constant(corr.type, [shift] * sbps))
                    per_tok.append((xs, dxv, corr if shift is not None else None))
                    if paired:
                        continue
                    for i in range(n_rows):
                        parts = [_unit_sums(fmt, sv, builder, u, xs[2 * j], xs[2 * j + 1])
                                 for j, u in enumerate(units[i])]
                        isum = simd.block_sums(sv, builder, parts)
                        if shift is not None:
                            isum = builder.sub(isum, corr)
                        scaled = builder.fmul(builder.fmul(builder.sitofp(isum, facc), dxv),
                                              scales[i])
                        builder.store(builder.fadd(builder.load(acc[i][t]), scaled),
                                      acc[i][t])
                if paired:
                    _paired_step(builder, fmt, per_tok, units, scales, acc2)
            if paired:  # each token's half, as its own accumulator
                for i in range(n_rows):
                    both = builder.load(acc2[i])
                    for t in range(2):
                        builder.store(_half(builder, both, t), acc[i][t])
            return acc

        n_steps = builder.udiv(nb, c(bps))
        accs = [steps(v, c(0), n_steps)]
        whole = builder.mul(n_steps, c(bps))
        half = simd.HALF_OF.get(v.isa) if v.nbytes > simd.AVX512VNNI_256.nbytes else None
        if half is not None:  # whole half-width steps next, laid out so by Q8Act
            n_half = builder.udiv(builder.sub(nb, whole), c(blocks_per_step(half)))
            accs.append(steps(half, whole, n_half))
            whole = builder.add(whole, builder.mul(n_half, c(blocks_per_step(half))))
        if v.nbytes > SSE.nbytes:
            # The rest in natural order (Q8Act), which is SSE's step layout: whole SSE steps
            # there, so small K (the default model's 96-512) is not all one-block steps.
            n_sse = builder.udiv(builder.sub(nb, whole), c(blocks_per_step(SSE)))
            accs.append(steps(SSE, whole, n_sse))
            whole = builder.add(whole, builder.mul(n_sse, c(blocks_per_step(SSE))))
        tail = [[cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0))
                 for _ in range(n_tok)] for _ in range(n_rows)]

        # Blocks past the last whole step: one block, at SSE width, at a time.
        with cgutils.for_range(builder, builder.sub(nb, whole)) as lp:
            b = builder.add(whole, lp.index)
            for i in range(n_rows):
                (unit,) = _load_units(fmt, SSE, builder, qs_row[i],
                                      builder.mul(b, c(fmt.block_bytes)), 1)
                dw = simd.fp16_to_f32(SSE, builder, simd.load(
                    builder, d_row[i], builder.mul(b, c(2)), vec(I16, 1)))
                dw = builder.extract_element(dw, ir.Constant(I32, 0))
                for t in range(n_tok):
                    x_lo = simd.load(builder, xq_row[t], builder.mul(b, c(32)), vec(I8, 16),
                                     X_ALIGN)
                    x_hi = simd.load(builder, xq_row[t], builder.add(builder.mul(b, c(32)),
                                                                     c(16)), vec(I8, 16),
                                     X_ALIGN)
                    part = _unit_sums(fmt, SSE, builder, unit, x_lo, x_hi)
                    if part.type.element.width == 16:
                        part = simd.widen_i16(SSE, builder, part)
                    isum = simd.hsum(builder, part)
                    if _offset_shift(fmt, SSE) is not None:  # Q4_0 (SSE's Q8_0: signed)
                        isum = builder.sub(isum, simd.load_scalar(
                            builder, xs_row[t], builder.mul(b, c(4)), I32))
                    dxs = simd.load_scalar(builder, dx_row[t], builder.mul(b, c(4)), F32)
                    term = builder.fmul(builder.fmul(builder.sitofp(isum, F32), dxs), dw)
                    builder.store(builder.fadd(builder.load(tail[i][t]), term), tail[i][t])

        for i in range(n_rows):
            for t in range(n_tok):
                y = builder.load(tail[i][t])
                for acc in accs:
                    y = builder.fadd(simd.hsum(builder, builder.load(acc[i][t])), y)
                out_row = builder.add(o0v, c(t))
                index = builder.add(builder.mul(out_row, out_cols), rows[i])
                builder.store(y, builder.bitcast(at(out_a.data, index, c(4)),
                                                 F32.as_pointer()))
        return context.get_dummy_value()

    if spread:
        @intrinsic
        def tile(typingctx, qs, d, xq, dx, xsum8, out, r0, t0, o0, gap):
            return types.none(qs, d, xq, dx, xsum8, out, r0, t0, o0, gap), codegen
    else:
        @intrinsic
        def tile(typingctx, qs, d, xq, dx, xsum8, out, r0, t0, o0):
            return types.none(qs, d, xq, dx, xsum8, out, r0, t0, o0), codegen
    return tile


# A verify step's two tokens, where the few-token tile runs 256-bit VNNI registers
# (_few_tokens_vec), take one 512-bit register for both: each step's weight units and scales
# loaded once in both halves, token 0's activations in the low half and token 1's in the high,
# so one vpdpbusd and one set of float operations serve the two tokens. Every lane's float
# operations are those of the 256-bit tile in the same order (the block sums are exact integers
# whatever their order): the same bits. In cache (compute-bound, as a verify step is when memory
# is fast), 2 threads, Zen 5, 2 tokens against 1: Q4_0 12288x2048 1.68 -> 1.30x, 2048x4096
# 1.64-1.70 -> 1.27-1.28x, Q8_0 8192x2048 1.12 -> 1.05x (medians of 30 rounds, two processes
# each); cold in a slow-bandwidth phase no change (1.01-1.03x either way).
PAIRED = True


def _concat(builder, a, b):
    n = a.type.count
    return builder.shuffle_vector(a, b, ir.Constant(vec(I32, 2 * n), list(range(2 * n))))


def _half(builder, x, h):
    n = x.type.count // 2
    return builder.shuffle_vector(x, x, ir.Constant(vec(I32, n), list(range(h * n, h * n + n))))


def _paired_step(builder, fmt: _Format, per_tok, units, scales, acc2):
    """One step of the two-token tile on 512-bit registers (PAIRED): per_tok [(activation
    registers, dx, corr or None)] of the 256-bit step for tokens 0 and 1, units and scales per
    row (256-bit), acc2 per row: [token 0's accumulator | token 1's]."""
    wide = simd.AVX512VNNI
    (xs0, dx0, corr0), (xs1, dx1, corr1) = per_tok
    xs = [_concat(builder, a, b) for a, b in zip(xs0, xs1)]
    dxv = _concat(builder, dx0, dx1)
    corr = None if corr0 is None else _concat(builder, corr0, corr1)
    n = dx0.type.count                                          # blocks of a 256-bit step
    for i, row_units in enumerate(units):
        parts = []
        for j, u in enumerate(row_units):  # a unit: two registers (VNNI), both in both halves
            u2 = tuple(_concat(builder, q, q) for q in u)
            parts.append(_unit_sums(fmt, wide, builder, u2, xs[2 * j], xs[2 * j + 1]))
        isum = simd.block_sums(wide, builder, parts, runs=2)  # token 0's blocks, then token 1's
        if corr is not None:
            isum = builder.sub(isum, corr)
        scale = _concat(builder, scales[i], scales[i])
        scaled = builder.fmul(builder.fmul(builder.sitofp(isum, vec(F32, 2 * n)), dxv), scale)
        builder.store(builder.fadd(builder.load(acc2[i]), scaled), acc2[i])


@intrinsic
def _warm(typingctx, a, row):
    """Prefetch the first PREFETCH_BYTES of a weight stream (qs, or its scales d in proportion)
    from `row` on, where a thread's stream starts: that much is then in flight at once, not one
    row of demand misses (cold 512x2048: +1.3 %, 2383 pairs)."""
    def codegen(context, builder, sig, args):
        ty = sig.args[0]
        arr = context.make_array(ty)(context, builder, args[0])
        _, cols = cgutils.unpack_tuple(builder, arr.shape, 2)
        item = context.get_abi_sizeof(context.get_data_type(ty.dtype))
        start = builder.mul(builder.mul(args[1], cols), ir.Constant(I64, item))
        nbytes = PREFETCH_BYTES if item == 1 else PREFETCH_BYTES * 2 // Q4_0.block_bytes
        for line in range(0, nbytes, 64):
            simd.prefetch(builder, arr.data, builder.add(start, ir.Constant(I64, line)))
        return context.get_dummy_value()

    return types.none(a, row), codegen


def _product_share(thread, n_threads, args):
    """One thread's run of row groups (a static split: each thread streams one run of memory),
    cut into panels of rows times blocks of tokens that stay in L2 (PANEL_BYTES, TOKEN_BYTES).
    One token (the GEMV) is one block: rows in order, as before."""
    qs, d, xq, dx, xsum8, out = args
    row_groups = qs.shape[0] // ROWS
    n_tok, k = xq.shape
    tok_whole = n_tok // TOKS * TOKS
    tok_block = max(1, TOKEN_BYTES // (k * TOKS)) * TOKS
    panel = max(1, PANEL_BYTES // (ROWS * qs.shape[1]))
    first = thread * row_groups // n_threads
    last = (thread + 1) * row_groups // n_threads
    _warm(qs, first * ROWS)
    _warm(d, first * ROWS)
    for g0 in range(first, last, panel):
        g1 = min(g0 + panel, last)
        for t0 in range(0, tok_whole, tok_block):
            for g in range(g0, g1):
                for t in range(t0, min(t0 + tok_block, tok_whole), TOKS):
                    tile(qs, d, xq, dx, xsum8, out, g * ROWS, t, t)
        for g in range(g0, g1):
            for t in range(tok_whole, n_tok):
                rows_by_1(qs, d, xq, dx, xsum8, out, g * ROWS, t, t)


def _product_body(qs, d, xq, dx, xsum8, out):
    fork((qs, d, xq, dx, xsum8, out))
    for r in range(qs.shape[0] // ROWS * ROWS, qs.shape[0]):
        for t in range(xq.shape[0]):
            one_by_1(qs, d, xq, dx, xsum8, out, r, t, t)


def _gemv_share(thread, n_threads, args, counter):
    """A thread's runs of rows (jit.omp.first_run / next_run: claimed while any are left, so
    threads that stream faster take more), each cut into ROWS equal runs read side by side
    (GEMV_STREAMS), the rows left over one by one, token by token: the GEMV's (one token) and a
    verify step's few tokens' (`_few_body`: a tile of all of them). Every row the tile's bits,
    whichever run takes it."""
    qs, d, xq, dx, xsum8, out = args
    n_rows = qs.shape[0]
    least = omp.least_units(qs.shape[1] + 2 * d.shape[1])
    first, last = omp.first_run(counter, thread, n_threads, n_rows, least, ROWS)
    while first < last:
        per = (last - first) // ROWS
        for s in range(ROWS):
            _warm(qs, first + s * per)
            _warm(d, first + s * per)
        for j in range(per):
            spread_tile(qs, d, xq, dx, xsum8, out, first + j, 0, 0, per)
        for r in range(first + per * ROWS, last):
            for t in range(xq.shape[0]):
                one_by_1(qs, d, xq, dx, xsum8, out, r, t, t)
        first, last = omp.next_run(counter, thread, n_threads, n_rows, least, ROWS)


def _few_body(qs, d, xq, dx, xsum8, out):
    """A product of a few tokens (FEW_TOKENS) by spread tiles of all of them: out [T, R]; every
    row the GEMV's bits."""
    fork((qs, d, xq, dx, xsum8, out))


def _gemv_body(qs, d, xq, dx, xsum8, out):
    """The decode GEMV (one token): out [R] or [1, R]; every row is the tile's, bit for bit
    the `like_gemv` GEMM's."""
    fork((qs, d, xq, dx, xsum8, out))


def _gemv_rows_share(thread, n_threads, args, counter):
    """The thread's run of rows of an fp32 product of the same input (fp32_rows.rows_range, as
    residual_step's fork splits them: each output its bits), then the GEMV's share, whose claimed
    runs even out the static one."""
    gemv, (x, w, p) = args
    n_rows = w.shape[0]
    fp32_rows.rows_range(x, w, p, thread * n_rows // n_threads,
                         (thread + 1) * n_rows // n_threads)
    gemv_share(thread, n_threads, gemv, counter)


def _gemv_rows_body(qs, d, xq, dx, xsum8, out, x, w, p):
    """The decode GEMV (or a verify step's few tokens') and p [T, R'] = x [T, K] · wᵀ (fp32
    rows: the GDN gates, read from the mixer's input as its projection) in one fork: one launch
    a layer fewer where residual_step would fork the product (3 threads and more), and the
    product over the threads where it would run on the calling thread (fewer)."""
    fork(((qs, d, xq, dx, xsum8, out), (x, w, p)))


@kernel(fastmath=False)
def _expert(qs, d, idx, sqs, sd, i):
    """Matrix i of a gathered launch: routed expert idx[i], then the always-on ones (sqs, sd)."""
    n = idx.size
    return (qs[idx[i]], d[idx[i]]) if i < n else (sqs[i - n], sd[i - n])


def _gathered_share(thread, n_threads, args, counter):
    """A thread's runs of (matrix, row) jobs (jit.omp.first_run: claimed while any are left),
    matrix by matrix, each matrix's run read as ROWS side-by-side streams (GEMV_STREAMS): a
    division-free inner loop (a per-row job // rows cost
    ~14 % against a plain product on the same memory). No `_warm` bursts: prefetching the next
    matrix's first rows near the end of this one (or each matrix's at its start) was slower than
    the tile's own prefetch alone (8 random experts + the shared one, 8 full-size layers, paired
    passes in one process: gate_up 1.07x at 1 and 2 threads, down 1.01-1.03x)."""
    qs, d, idx, sqs, sd, xq, dx, xsum8, out = args
    n_rows = qs.shape[1]
    n_jobs = (idx.size + sqs.shape[0]) * n_rows
    least = omp.least_units(qs.shape[2] + 2 * d.shape[2])
    shared_x = xq.shape[0] == 1
    first, last = omp.first_run(counter, thread, n_threads, n_jobs, least, ROWS)
    while first < last:
        i = first // n_rows
        while i * n_rows < last:
            w, s = _expert(qs, d, idx, sqs, sd, i)
            g0 = max(first - i * n_rows, 0)
            g1 = min(last - i * n_rows, n_rows)
            per = (g1 - g0) // ROWS
            t = 0 if shared_x else i
            for j in range(per):
                spread_tile(w, s, xq, dx, xsum8, out, g0 + j, t, i, per)
            for r in range(g0 + per * ROWS, g1):
                one_by_1(w, s, xq, dx, xsum8, out, r, t, i)
            i += 1
        first, last = omp.next_run(counter, thread, n_threads, n_jobs, least, ROWS)


def _gathered_body(qs, d, idx, sqs, sd, xq, dx, xsum8, out):
    """out[i] = W[idx[i]] · x[i] for the routed experts, then out[idx.size + j] = S[j] · x[...]
    for each always-on matrix S (the shared expert; none: an empty [0, R, K/2]), x[0] for every
    row when x holds one token: all in one parallel launch, so decode pays one thread wake-up per
    projection, not nine."""
    for i in range(idx.size):  # here, not in numpy: a per-call min/max cost more than the GEMV
        if idx[i] < 0 or idx[i] >= qs.shape[0]:
            raise IndexError("expert index out of range")
    fork((qs, d, idx, sqs, sd, xq, dx, xsum8, out))


def _grouped_share(thread, n_threads, args):
    """Jobs (expert, row group), in order, each worth its expert's tokens: every thread takes the
    jobs that start in its equal share of the work (routing leaves experts unevenly loaded)."""
    qs, d, offsets, xq, dx, xsum8, out = args
    n_experts = qs.shape[0]
    row_groups = qs.shape[1] // ROWS
    total = offsets[n_experts] * row_groups
    lo = thread * total // n_threads
    hi = (thread + 1) * total // n_threads
    done = np.int64(0)  # not a literal 0: typing the call with one compiled jobs_starting_in twice
    for e in range(n_experts):
        t0, t1 = offsets[e], offsets[e + 1]
        n = t1 - t0
        if n == 0:
            continue
        g_first, g_end = jobs_starting_in(lo, hi, done, n, row_groups)
        tok_whole = t0 + n // TOKS * TOKS
        if g_first < g_end:
            _warm(qs[e], g_first * ROWS)
            _warm(d[e], g_first * ROWS)
        for g in range(g_first, g_end):
            for t in range(t0, tok_whole, TOKS):
                tile(qs[e], d[e], xq, dx, xsum8, out, g * ROWS, t, t)
            for t in range(tok_whole, t1):
                rows_by_1(qs[e], d[e], xq, dx, xsum8, out, g * ROWS, t, t)
        done += n * row_groups


def _grouped_body(qs, d, offsets, xq, dx, xsum8, out):
    """out[o_e:o_e+1] = x[o_e:o_e+1] · W[e]ᵀ for every expert e (o = offsets): the MoE prefill's
    experts in one parallel launch per projection, tokens sorted by expert."""
    fork((qs, d, offsets, xq, dx, xsum8, out))
    for e in range(qs.shape[0]):
        for r in range(qs.shape[1] // ROWS * ROWS, qs.shape[1]):
            for t in range(offsets[e], offsets[e + 1]):
                one_by_1(qs[e], d[e], xq, dx, xsum8, out, r, t, t)


_SHARES = {_product_body: _product_share, _gemv_body: _gemv_share, _few_body: _gemv_share,
           _gathered_body: _gathered_share, _grouped_body: _grouped_share}
_CHUNKED = (_gemv_body, _few_body, _gathered_body)  # decode's: runs claimed (jit.omp.first_run)


def _array(dtype, ndim, readonly=False):
    return types.Array(dtype, ndim, "C", readonly=readonly)


# Inputs are declared read-only (a writable array passes for a read-only one, not the reverse):
# weights come from memory-mapped files.
_ACT = (_array(types.int8, 2, True), _array(types.float32, 2, True), _array(types.int32, 2, True))
_SIGNATURES = {
    _product_body: [types.void(_array(types.uint8, 2, True), _array(types.uint16, 2, True), *_ACT,
                               _array(types.float32, n_out)) for n_out in (1, 2)],
    _gemv_body: [types.void(_array(types.uint8, 2, True), _array(types.uint16, 2, True), *_ACT,
                            _array(types.float32, n_out)) for n_out in (1, 2)],
    _few_body: [types.void(_array(types.uint8, 2, True), _array(types.uint16, 2, True), *_ACT,
                           _array(types.float32, 2))],
    _gathered_body: [types.void(_array(types.uint8, 3, True), _array(types.uint16, 3, True),
                                _array(types.int32, 1, True), _array(types.uint8, 3, True),
                                _array(types.uint16, 3, True), *_ACT, _array(types.float32, 2))],
    _grouped_body: [types.void(_array(types.uint8, 3, True), _array(types.uint16, 3, True),
                               _array(types.int64, 1, True), *_ACT, _array(types.float32, 2))],
}
_products: dict = {}


def _tiles(isa: Isa, shape: tuple[int, int], fmt: _Format,
           v: Vec | None = None) -> tuple[str, dict]:
    """The variant name and tile intrinsics of a kernel for an ISA, tile shape and format; `v`
    the registers and instructions, if not the ISA's own (`_few_tokens_vec`)."""
    if not supported(isa) or (v is not None and not supported(v.isa)):  # else compiling it
        raise FermijitError(f"matvec: this CPU or Numba target cannot run {isa.label}")  # could
    dot = "" if v is None else f"-{v.isa.label}{v.nbytes * 8}"          # abort (pitfall 5)
    v = v or simd.VEC_OF[isa]
    n_rows, n_tok = shape
    tiles = dict(ROWS=n_rows, TOKS=n_tok, tile=_make_tile(fmt, v, n_rows, n_tok),
                 spread_tile=_make_tile(fmt, v, n_rows, n_tok, True),
                 rows_by_1=_make_tile(fmt, v, n_rows, 1), one_by_1=_make_tile(fmt, v, 1, 1))
    threads = "omp" if omp.available() else "serial"
    return f"{fmt.name}-{isa.label}{dot}-{n_rows}x{n_tok}-{threads}", tiles


def _product(isa: Isa, shape: tuple[int, int], body=_product_body, fmt: _Format = Q4_0,
             v: Vec | None = None):
    """The kernel for a body, ISA, tile shape and weight format (and registers `v`, if not the
    ISA's), made on first use (so no AVX2 code is ever compiled for a Westmere target:
    pitfall 5)."""
    key = (body.__name__, isa.label, shape, fmt.name, v)  # cheap to hash: looked up per call
    if key not in _products:
        variant, tiles = _tiles(isa, shape, fmt, v)
        # No fast-math: the tile's IR says exactly what to compute (and function-wide fast-math
        # let fresh and cached code round differently: first and later runs disagreed by ulps).
        _products[key] = kernel(
            body, fastmath=False, variant=variant, signatures=_SIGNATURES[body],
            fork=omp.fork(bind(_SHARES[body], variant, **tiles), chunked=body in _CHUNKED),
            **tiles)
    return _products[key]


_gemv_rows_kernels: dict = {}


def gemv_rows_kernel(isa: Isa, n_tok: int = 1):
    """`_gemv_rows_body`'s kernel for `isa` and n_tok tokens (1: the GEMV's tile; up to
    FEW_TOKENS: `_few_body`'s spread tiles of every token, a verify step's rows): (qs, d_bits,
    xq, dx, xsum8, out, x, w, p)."""
    key = (isa, n_tok)
    if key not in _gemv_rows_kernels:
        if n_tok == 1:
            variant, tiles = _tiles(isa, gemv_shape(isa), Q4_0)
        else:
            variant, tiles = _tiles(isa, (gemv_shape(isa)[0], n_tok), Q4_0, _few_tokens_vec(isa))
        variant += "-rows"
        share = kernel(_gemv_share, fastmath=False, variant=variant, **tiles)
        _gemv_rows_kernels[key] = kernel(
            _gemv_rows_body, fastmath=False, variant=variant,
            fork=omp.fork(bind(_gemv_rows_share, variant, gemv_share=share), chunked=True))
    return _gemv_rows_kernels[key]


def launch_with_rows(w: Q4Matrix, act: Q8Act, out, x, w_rows, p):
    """`launch` of one token's GEMV (or a verify step's few tokens', `like_gemv`: each row the
    GEMV's bits) with p [T, R'] = x [T, K] · w_rowsᵀ (fp32, fp32_rows' bits) in its fork:
    (kernel, args), for decode's plan."""
    n_tok = act.xq.shape[0]
    if not 1 <= n_tok <= FEW_TOKENS:
        raise FermijitError(f"matvec: a GEMV with fp32 rows takes 1 to {FEW_TOKENS} tokens, "
                            f"not {n_tok}")
    _, args = launch(w, act, out, like_gemv=True)
    check_array("matvec", "x", x, np.float32, (n_tok, act.xq.shape[1]))
    check_array("matvec", "w_rows", w_rows, np.float32, (None, act.xq.shape[1]))
    check_array("matvec", "p", p, np.float32, (n_tok, w_rows.shape[0]))
    return gemv_rows_kernel(act.vec.isa, n_tok), args + (x, w_rows, p)


def gemv_shape(isa: Isa, fmt: _Format = Q4_0) -> tuple[int, int]:
    """The decode tile of `isa`: GEMV_ROWS (else GEMV_STREAMS) rows, each its own stream, x 1
    token."""
    rows = GEMV_ROWS.get((isa, fmt.name)) if _few_tokens_vec(isa) is not None else None
    return rows or GEMV_STREAMS[isa], 1


def gemv_kernel(isa: Isa, fmt: _Format = Q4_0):
    """The decode GEMV kernel: (qs, d_bits, xq, dx, xsum8, out [R] or [1, R]); Q8_0 with
    `_few_tokens_vec`'s registers (the same bits)."""
    return _product(isa, gemv_shape(isa, fmt), _gemv_body, fmt,
                    _few_tokens_vec(isa) if fmt is Q8_0 else None)


def gemv_fork(isa: Isa, share, name: str, rows: int | None = None, chunked: bool = False,
              **extra):
    """(variant name, a fork intrinsic of `share`) with the decode GEMV's tiles bound as its
    globals (ROWS, spread_tile, one_by_1, tile, rows_by_1: `_tiles`), and `extra`, for a kernel
    of another op; `name` makes the variant's symbols its own (jit.cpu.bind). `rows`: tiles of
    that many rows instead of the GEMV's; `chunked`: the share takes the launch's work counter
    (omp.fork)."""
    variant, tiles = _tiles(isa, (rows, 1) if rows else gemv_shape(isa), Q4_0)
    variant += "-" + name
    return variant, omp.fork(bind(share, variant, **tiles, **extra), chunked=chunked)


def spread_tile_of(isa: Isa, rows: int):
    """The decode GEMV's tile of `rows` rows a gap apart (each its own stream), one token."""
    return _make_tile(Q4_0, simd.VEC_OF[isa], rows, 1, True)


def _call(op: str, kernel_, *args):
    """`kernel_` on arrays whose shapes are checked: its signatures check dtypes and layouts
    (Numba's dispatch refuses the rest before any code runs)."""
    if omp.in_forked_child:
        omp.check_process()
    try:
        kernel_(*args)
    except TypeError:
        raise FermijitError(f"{op}: an array has the wrong dtype or layout (need C-contiguous; "
                            f"out writable float32): {_describe(args)}") from None
    except IndexError as e:
        raise FermijitError(f"{op}: {e}") from None


def _describe(arrays) -> str:
    return ", ".join(f"{getattr(a, 'dtype', type(a).__name__)} {list(getattr(a, 'shape', []))}"
                     for a in arrays)


def _check_weights(op, qs, d, ndim=2, d_name="d", d_dtype=np.float16):
    check_array(op, d_name, d, d_dtype, ndim=ndim)
    *lead, nb = d.shape
    check_array(op, "qs", qs, np.uint8, (*lead, nb * BLOCK // 2))
    return lead[-1], nb


def _isa_of(x) -> Isa:
    """The variant a product on `x` runs by default: a Q8Act's own, else `default_isa`."""
    return x.vec.isa if isinstance(x, Q8Act) else default_isa(np.atleast_2d(x).shape[0])


def _as_act(op, x, nb, isa):
    if isinstance(x, Q8Act):
        if x.vec.isa != isa:
            raise FermijitError(f"{op}: activations are laid out for {x.vec.isa.label}, "
                                f"the kernel is {isa.label}")
        act = x
    else:
        act = quantize_act(x, isa)
    if act.xq.shape[1] != nb * BLOCK:
        raise FermijitError(f"{op}: x has {act.xq.shape[1]} inputs, weights have {nb * BLOCK}")
    return act


@dataclass(frozen=True)
class Q4Matrix:
    """Q4_0 weights checked once (shapes, dtypes, layout) for products repeated every token: the
    per-call checks of `cpu` were ~2 of the ~18 us of a cold 512x2048 GEMV (bench kernels)."""

    qs: np.ndarray      # [R, K/2] uint8
    d_bits: np.ndarray  # [R, nb] the fp16 scales' bits as uint16 (Numba has no float16)

    def __post_init__(self):
        _check_weights("matvec", self.qs, self.d_bits, d_name="d_bits", d_dtype=np.uint16)

    @classmethod
    def of(cls, qs, d) -> "Q4Matrix":
        check_array("matvec", "d", d, np.float16, ndim=2)
        return cls(qs, d.view(np.uint16))


def product(w: Q4Matrix, act: Q8Act, out: np.ndarray, *, isa: Isa | None = None,
            like_gemv: bool = False) -> np.ndarray:
    """`cpu` for prepared weights and activations into `out` ([R] for one token, or [T, R]):
    decode's path, with only the checks that depend on this call (~0.5 us of Python). The kernel
    is the ISA the activations are laid out for; `isa`, if given, must be that one.

    Several tokens run the prefill GEMM (ops.gemm), which rounds in another order than the GEMV;
    `like_gemv` runs this module's tile instead, each token's row bit for bit the GEMV's."""
    kernel_, args = launch(w, act, out, isa=isa, like_gemv=like_gemv)
    _call("matvec", kernel_, *args)
    return out


def launch(w: Q4Matrix, act: Q8Act, out, *, isa: Isa | None = None, like_gemv: bool = False):
    """`product`'s kernel and arguments, checked once, for a caller that repeats the call every
    token (model/forward.py's decode plan): (kernel, args)."""
    act_isa = act.vec.isa
    if isa is not None and act_isa is not isa:
        raise FermijitError(f"matvec: activations are laid out for {act_isa.label}, "
                            f"the kernel is {isa.label}")
    xq, qs = act.xq, w.qs
    n_tok, k = xq.shape
    rows, half_k = qs.shape
    if k != 2 * half_k:
        raise FermijitError(f"matvec: x has {k} inputs, weights have {2 * half_k}")
    shape = getattr(out, "shape", None)
    if shape != (n_tok, rows) and (n_tok != 1 or shape != (rows,)):
        raise FermijitError(f"matvec: out has shape {list(shape or [])}, expected [{n_tok}, "
                            f"{rows}] (or [{rows}] for one token)")
    if n_tok > 1 and not like_gemv:
        return gemm.product_kernel(act_isa), (qs, w.d_bits, xq, act.dx, act.xsum8,
                                              gemm.x_offsets(act_isa, k // BLOCK),
                                              gemm.identity_rows(n_tok), out)
    key = (act_isa, min(n_tok, FEW_TOKENS + 1))  # each made on first use: decode alone never
    kernel_ = _gemm_gemv.get(key)                 # needs the GEMM's
    if kernel_ is None:
        kernel_ = _gemm_gemv[key] = (gemv_kernel(act_isa) if n_tok == 1 else
                                     _few_tokens_kernel(act_isa, n_tok, Q4_0, GEMM_TILE))
    return kernel_, (qs, w.d_bits, xq, act.dx, act.xsum8, out)


def _few_tokens_kernel(isa: Isa, n_tok: int, fmt: _Format, more: tuple[int, int]):
    """The kernel of a product of n_tok > 1 tokens: up to FEW_TOKENS, spread tiles of the GEMV's
    rows side by side and every token (`_few_body`), else `_product_body`'s tiles of `more`."""
    if n_tok > FEW_TOKENS:
        return _product(isa, more, fmt=fmt)
    return _product(isa, (gemv_shape(isa, fmt)[0], n_tok), _few_body, fmt, _few_tokens_vec(isa))


def _few_tokens_vec(isa: Isa) -> Vec | None:
    """The registers of a few-token tile (a verify step's rows) on activations laid out for
    `isa`: AVX-512 VNNI's vpdpbusd on 256-bit registers where decode runs AVX2 in an AVX-512 VNNI
    process (DECODE_VARIANT), else the ISA's own (None). The layout and every block's integer sum
    are AVX2's (exact either way), so each token's row keeps the GEMV's bits, while one vpdpbusd
    a register and token replaces pmaddubsw + pmaddwd (Q8_0: and the sign trick's psignb), the
    work each token adds (FEW_TOKENS' figures); AVX-512VL's 32 registers also hold the spread
    tile's two rows of weights."""
    if isa is Isa.AVX2 and selected_isa() is Isa.AVX512VNNI and supported(Isa.AVX512VNNI):
        return simd.AVX512VNNI_256
    return None


_gemm_gemv: dict = {}  # (Isa, tokens of the tile, FEW_TOKENS + 1 for more) -> the kernel


def cpu(qs, d, x, out=None, *, isa: Isa | None = None, like_gemv: bool = False):
    """W4A8 GEMV (x [K]) or GEMM (x [T, K]) -> fp32 [R] or [T, R].

    x may be float32 (quantised here) or a Q8Act from `quantize_act` (reused across the matrices
    that read the same input, as decode does). `isa` defaults to x's (`_isa_of`);
    `like_gemv` as for `product`.
    """
    isa = isa or _isa_of(x)
    w = Q4Matrix.of(qs, d)
    act = _as_act("matvec", x, d.shape[1], isa)
    n_tok = act.xq.shape[0]
    # A vector in gives a vector out; a prepared Q8Act of one token may write a [R] `out`.
    is_vector = n_tok == 1 and (x.ndim == 1 if isinstance(x, np.ndarray)
                                else out is not None and out.ndim == 1)
    y = output("matvec", out, (d.shape[0],) if is_vector else (n_tok, d.shape[0]))
    return product(w, act, y, isa=isa, like_gemv=like_gemv)


def q8_reference(qs, d, x):
    """The same product with Q8_0 weights (qs int8 [R, K], d float16 [R, nb]): the LM-head
    option. Exact integer block sums, float64 scaling."""
    x2 = np.atleast_2d(x)
    xq, dx = quantize_act_reference(x2)
    rows, nb = d.shape
    isum = np.einsum("rbj,tbj->trb", qs.reshape(rows, nb, BLOCK).astype(np.int64),
                     xq.astype(np.int64))
    y = np.einsum("trb,rb,tb->tr", isum.astype(np.float64), d.astype(np.float64),
                  dx.astype(np.float64))
    return y[0] if np.ndim(x) == 1 else y


def q8_cpu(qs, d, x, out=None, *, isa: Isa | None = None):
    """`q8_reference` in Numba; x float32 [K]/[T, K] or a Q8Act (the LM-head option: at the
    ISA's width, as the LM head is the largest matrix read per token; at SSE width it streamed at
    56% of the read bandwidth on an AVX-512 machine)."""
    kernel_, args = q8_launch(qs, d, x, out, isa=isa)
    _call("matvec.q8", kernel_, *args)
    return args[-1]


def q8_launch(qs, d, x, out=None, *, isa: Isa | None = None):
    """`q8_cpu`'s kernel and arguments (the output made if not given), checked once, for a
    caller that repeats the call every token (model/forward.py's decode plan): (kernel, args)."""
    check_array("matvec.q8", "d", d, np.float16, ndim=2)
    rows, nb = d.shape
    check_array("matvec.q8", "qs", qs, np.int8, (rows, nb * BLOCK))
    isa = isa or _isa_of(x)
    act = _as_act("matvec.q8", x, nb, isa)
    n_tok = act.xq.shape[0]
    is_vector = n_tok == 1 and (x.ndim == 1 if isinstance(x, np.ndarray)
                                else out is not None and out.ndim == 1)
    y = output("matvec.q8", out, (rows,) if is_vector else (n_tok, rows))
    # Several tokens (eval's logits of every position): the tile of one row and one token,
    # which reads the weights once for a panel of rows and all tokens (_product_share); a few,
    # a verify step's: FEW_TOKENS.
    kernel_ = (gemv_kernel(isa, Q8_0) if n_tok == 1 else
               _few_tokens_kernel(isa, n_tok, Q8_0, (1, 1)))
    return kernel_, (qs.view(np.uint8), d.view(np.uint16), act.xq, act.dx, act.xsum8, y)


def gathered_reference(qs, d, idx, x, shared=None):
    """out[i] = W[idx[i]] · x (x [K]) or W[idx[i]] · x[i] (x [n, K]); qs [E, R, K/2]. With
    `shared` = (sqs [S, R, K/2], sd), rows n + j are S[j] · x (or · x[n + j])."""
    mats = [(qs[e], d[e]) for e in idx] + list(zip(*shared) if shared is not None else [])
    xs = np.broadcast_to(np.atleast_2d(x), (len(mats), np.shape(x)[-1]))
    return np.stack([reference(w, s, xi) for (w, s), xi in zip(mats, xs)])


def gathered_cpu(qs, d, idx, x, out=None, *, shared=None, isa: Isa | None = None):
    """`gathered_reference` in one parallel launch (the MoE's selected experts, and its shared
    expert with `shared`); out [n (+ S), R]."""
    isa = isa or _isa_of(x)
    rows, nb = _check_weights("matvec.gathered", qs, d, ndim=3)
    check_array("matvec.gathered", "idx", idx, np.int32, ndim=1)
    n_shared = 0
    if shared is not None:
        sqs, sd = shared
        _check_weights("matvec.gathered shared", sqs, sd, ndim=3)
        shared = (sqs, sd.view(np.uint16))
        n_shared = sqs.shape[0]
    act = _as_act("matvec.gathered", x, nb, isa)
    return gathered(qs, d.view(np.uint16), idx, act,
                    output("matvec.gathered", out, (idx.size + n_shared, rows)), shared)


def gathered(qs, d_bits, idx, act: Q8Act, out, shared=None):
    """`gathered_cpu` for decode: the checks that depend on this call (the kernel refuses
    out-of-range experts, and its signature wrong dtypes and layouts); d as its uint16 bits,
    `shared` as (sqs, sd_bits)."""
    sqs, sd_bits = shared if shared is not None else _no_shared(qs.shape)
    n_out = idx.size + sqs.shape[0]
    n_act, k = act.xq.shape
    if n_act not in (1, n_out):
        raise FermijitError(f"matvec.gathered: {n_act} activation rows for {n_out} experts "
                            f"(give 1 shared or one per expert)")
    if (k != 2 * qs.shape[-1] or getattr(out, "shape", None) != (n_out, qs.shape[1])
            or d_bits.shape != (*qs.shape[:2], k // BLOCK) or sqs.shape[1:] != qs.shape[1:]
            or sd_bits.shape != (*sqs.shape[:2], k // BLOCK)):
        raise FermijitError(f"matvec.gathered: weights {list(qs.shape)} (bytes) with scales "
                            f"{list(d_bits.shape)}, shared {list(sqs.shape)} with "
                            f"{list(sd_bits.shape)}, x of {k} inputs, out "
                            f"{list(getattr(out, 'shape', []))}: inconsistent")
    isa = act.vec.isa
    _call("matvec.gathered", _product(isa, gemv_shape(isa), _gathered_body), qs, d_bits, idx,
          sqs, sd_bits, act.xq, act.dx, act.xsum8, out)
    return out


def grouped_reference(qs, d, offsets, x):
    """out[offsets[e]:offsets[e+1]] = W[e] · x[offsets[e]:offsets[e+1]] (rows of x grouped by
    expert); qs [E, R, K/2], offsets [E+1] -> [n, R]."""
    parts = [np.zeros((0, d.shape[1]))]
    parts += [reference(qs[e], d[e], x[offsets[e]:offsets[e + 1]]).reshape(-1, d.shape[1])
              for e in range(qs.shape[0]) if offsets[e + 1] > offsets[e]]
    return np.concatenate(parts)


def grouped_cpu(qs, d, offsets, x, out=None, *, isa: Isa | None = None):
    """`grouped_reference` in one parallel launch; x float32 [n, K] or a Q8Act; out [n, R]."""
    isa = isa or _isa_of(x)
    rows, nb = _check_weights("matvec.grouped", qs, d, ndim=3)
    act = _as_act("matvec.grouped", x, nb, isa)
    return grouped(qs, d.view(np.uint16), offsets, act,
                   output("matvec.grouped", out, (act.xq.shape[0], rows)))


def grouped(qs, d_bits, offsets, act: Q8Act, out, *, like_gemv: bool = False,
            x_rows: np.ndarray | None = None):
    """`grouped_cpu` for checked weights (MoeWeights): offsets int64 [E+1], from 0 to the
    number of activation rows, non-decreasing; d as its uint16 bits. The prefill GEMM
    (ops.gemm), or with `like_gemv` this module's tile (each row bit for bit the GEMV's).
    `x_rows` (int64, the prefill GEMM only): row s of the grouped input is act's row x_rows[s],
    read in place (the MoE's slots sorted by expert, without a gathered copy)."""
    n_act, k = act.xq.shape
    n_experts, rows = qs.shape[:2]
    check_array("matvec.grouped", "offsets", offsets, np.int64, (n_experts + 1,))
    if x_rows is not None:
        check_array("matvec.grouped", "x_rows", x_rows, np.int64, ndim=1)
        if like_gemv or (x_rows.size and (x_rows.min() < 0 or x_rows.max() >= n_act)):
            raise FermijitError(f"matvec.grouped: x_rows must index the {n_act} activation rows "
                                f"(the prefill GEMM only)")
        n_act = x_rows.size
    if offsets[0] != 0 or offsets[-1] != n_act or np.any(offsets[1:] < offsets[:-1]):
        raise FermijitError(f"matvec.grouped: offsets must rise from 0 to the {n_act} activation "
                            f"rows, got [{offsets[0]}, ..., {offsets[-1]}]")
    if (k != 2 * qs.shape[-1] or getattr(out, "shape", None) != (n_act, rows)
            or d_bits.shape != (n_experts, rows, k // BLOCK)):
        raise FermijitError(f"matvec.grouped: weights {list(qs.shape)} (bytes) with scales "
                            f"{list(d_bits.shape)}, x of {k} inputs, out "
                            f"{list(getattr(out, 'shape', []))}: inconsistent")
    return grouped_launch(qs, d_bits, offsets, act, out, like_gemv=like_gemv, x_rows=x_rows)


def grouped_launch(qs, d_bits, offsets, act: Q8Act, out, *, like_gemv: bool = False,
                   x_rows: np.ndarray | None = None):
    """`grouped` without its checks, for a caller whose offsets, rows and buffers are made to
    fit the weights it checked (ops.moe: _sort_slots of checked ids, FfnBuffers): the checks'
    numpy reductions were 8 us of a call's 15 at small shapes, 0.26 ms of a default-model
    prefill's 32 launches. Out-of-range offsets or rows here read and write out of bounds."""
    isa, n_act, k = act.vec.isa, act.xq.shape[0], act.xq.shape[1]
    if like_gemv:
        _call("matvec.grouped", _product(isa, GEMM_TILE, _grouped_body), qs, d_bits, offsets,
              act.xq, act.dx, act.xsum8, out)
    else:
        _call("matvec.grouped", gemm.grouped_kernel(isa), qs, d_bits, offsets, act.xq, act.dx,
              act.xsum8, gemm.x_offsets(isa, k // BLOCK),
              gemm.identity_rows(n_act) if x_rows is None else x_rows, out)
    return out


_no_shared_of: dict = {}


def _no_shared(shape) -> tuple[np.ndarray, np.ndarray]:
    """Empty always-on matrices for a gathered launch of routed experts only (made once per
    shape: decode looks them up per call)."""
    if shape not in _no_shared_of:
        _, rows, half_k = shape
        _no_shared_of[shape] = (np.empty((0, rows, half_k), np.uint8),
                                np.empty((0, rows, half_k // (BLOCK // 2)), np.uint16))
    return _no_shared_of[shape]


def simd_variant(isa: Isa) -> str:
    """The GEMV of decode's variant (jit.cpu.decode_isa) and the prefill GEMM of `isa`'s."""
    dec = decode_isa() if isa is selected_isa() else isa
    v = simd.VEC_OF[dec]
    ops = "vpdpbusd" if v.dpbusd else "pmaddubsw+pmaddwd"
    return (f"decode GEMV {dec.label}: {8 * v.nbytes}-bit {ops}, {blocks_per_step(v)} "
            f"blocks/step, {gemv_shape(dec)[0]} row stream(s) a tile; prefill GEMM {isa.label}: "
            f"{gemm.rows_per_group(isa)} rows in the lanes x {gemm.TILE_TOKENS[isa]} tokens")


def warm_up() -> None:
    """One tiny product, so the kernel is compiled (or loaded) and the threads are started."""
    qs, d = np.zeros((2, BLOCK // 2), np.uint8), np.zeros((2, 1), np.float16)
    cpu(qs, d, np.zeros(BLOCK, np.float32))
