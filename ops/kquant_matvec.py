"""K-quant products on the CPU: GGUF Q4_K blocks, as imported, times Q8_K activations (the
spec is ops/kquant.py `reference`).

    y[t, r] = sum_blocks  d·dx·(sum_j sc_j · sum_i q_ji·x_ji)  −  dmin·dx·(sum_j m_j · bsum_j)

Letters: T tokens, R rows, K inputs, nb = K/256 super-blocks, j the 8 sub-blocks of 32.

llama.cpp's q4_K x q8_K dot (ggml-cpu arch/x86 quants.c `ggml_vec_dot_q4_K_q8_K`) in LLVM IR:
the 12 packed bytes of scales and mins unpacked in vector registers (`_scale_bytes`: two
shuffles, shifts and masks), into every 128-bit lane, so that a sub-block's scale is splat to
its i16 lanes by one in-lane pshufb; each 32-value sub-block's nibbles times its activations by
`pmaddubsw` (unsigned nibble, signed byte: pairs in i16, at most 2·15·127), scaled and paired
into i32 by one `pmaddwd` with that splat (VNNI: `vpdpwssd`, the add in the same instruction);
the mins' term by one `pmaddwd` a row with the token's 32-value sums (one phaddw of Q8_K's
16-value sums). A super-block's integer sums are one i32 vector (Q8_K has one scale per 256), so
there is one fp32 multiply-add per super-block and accumulator (the sums' by d, the mins' by
dmin), not per 32-block as in Q4_0; Q6_K's offset (q − 32) is subtracted in i32.

Where the GEMV lost against Q4_0's, in cache (one thread, 256x2048 in L2, tok/s per byte, AVX2,
this machine: 0.50 before, 0.75 now): the scalar kmask unpacking and a horizontal sum per
super-block and row for the mins (without them, +15 %), the scale splats as cross-lane
vpermt2b and a register copy each (+25 %); what remains is the sub-block scaling itself (8
splats and 8 pmaddwd a super-block and row, where Q4_0 sums in i16). Cold, the GEMV keeps up
by reading more rows side by side (GEMV_STREAMS).

Widths: SSSE3 16 bytes, AVX2 32; the AVX-512 VNNI variant runs the 256-bit code (decode's
width there, jit.cpu.DECODE_VARIANT) with vpdpwssd. vpdpbusd would not shorten it: its i32 sums
would still need a multiply by the scale, where pmaddwd scales and pairs in the one instruction.

One tile of rows x tokens serves the decode GEMV (1 x 1, prefetching its weight stream) and the
prefill GEMM (GEMM_TILE: each row's unpacked nibbles meet several tokens). A launch forks one
OpenMP team (fermijit.jit.omp); each thread takes a contiguous run of row groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils

from fermijit import FermijitError
from fermijit.jit import omp, simd
from fermijit.jit.checks import check_array, output
from fermijit.jit.cpu import Isa, bind, decode_isa, kernel, selected_isa, supported
from fermijit.jit.simd import F32, I8, I16, I32, I64, Vec, vec
from fermijit.ops import kquant, matvec, q5_tile
from fermijit.ops.kquant import QK_K, Q8K_GROUP
from fermijit.ops.tile_frame import Frame, tile_intrinsic

# The weight stream prefetched this far ahead (as ops/matvec.py PREFETCH_BYTES: one sequential
# stream per thread with one row a tile).
PREFETCH_BYTES = 4096
# Rows x tokens of the prefill tile: a row's unpacked nibbles are read by 4 tokens.
GEMM_TILE = (2, 4)
GEMV_TILE = (1, 1)
# 2..FEW_TOKENS tokens (a speculative verify step's rows, a server batch of a few sequences, an
# MTP draft's) run the GEMV's row streams with every token in each tile, shape (1, T): a weight
# block read and unpacked once for all of them (the GEMM tile they do not fill ran a row pair by
# one token at a time). Q6_K 124160x2048 (half the full-size LM head), 2 threads, this Zen 5
# under load 3-5, medians of 15-30 interleaved calls, against one token: 2 tokens 2.02 / 1.56 ->
# 1.29 / 1.21x, 3 tokens 2.92 / 2.48 -> 1.76 / 1.44x; Q4_K 2 tokens 2.02 -> 1.50x, 3 tokens
# 2.92 -> 2.16x; 1, 2 or 3 streams alike within the noise (2 kept). A 2-row verify step of a
# 1-layer reap128 slice with a Q6_K head: 2.15 -> 1.30-1.40x a token. Past one token the
# K-quant tile's arithmetic, not its reads, sets the pace (Q4_0 / Q8_0 2 tokens: 1.03-1.1x).
FEW_TOKENS = matvec.FEW_TOKENS
FEW_STREAMS = 2
# Rows the decode GEMV reads side by side, each from its own run of the thread's rows (sharing
# the activation loads), as ops/matvec.py's GEMV_STREAMS for Q4_0. A K-quant row is one stream
# of memory (a Q4_0 row two: qs and d). Cold 2048x2048 walks of 1 GiB, the K-quant GEMV of 1, 2,
# 3 (4) streams beside Q4_0's GEMV, tok/s per byte, this machine (2 cores, load 2-7), 1 thread:
# AVX2 Q4_K 2 streams 1.12, 3 1.28, 4 1.24 (Q6_K 1.04, 1.17, 1.13); SSSE3 (Westmere code) Q4_K
# 0.85, 1.10, 1.21 (Q6_K 0.93, 1.03, 1.11); 2 threads: AVX2 Q4_K 0.81 -> 1.06, Q6_K 0.94 -> 1.17,
# SSSE3 Q4_K 0.98, 1.12, 1.24. Hot (L2) the same speed with 1, 2 or 3.
GEMV_STREAMS = {Isa.SSSE3: 3, Isa.AVX2: 3, Isa.AVX512VNNI: 3}
VEC_OF = {Isa.SSSE3: simd.SSE, Isa.AVX2: simd.AVX2, Isa.AVX512VNNI: simd.AVX512VNNI_256}
_PMADDWD_128 = "llvm.x86.sse2.pmadd.wd"


@dataclass(frozen=True)
class Q8KAct:
    """Activations in Q8_K (ops/kquant.py quantize_q8_k), natural order; xq 16-byte aligned
    (the tile's loads of it fold into legacy SSE's pmaddubsw)."""

    xq: np.ndarray     # [T, K] int8
    d: np.ndarray      # [T, K/256] float32
    bsums: np.ndarray  # [T, K/16] int16: the sums of each 16 values

    def __post_init__(self):
        check_array("Q8KAct", "xq", self.xq, np.int8, ndim=2)
        n_tok, k = self.xq.shape
        check_array("Q8KAct", "d", self.d, np.float32, (n_tok, k // QK_K))
        check_array("Q8KAct", "bsums", self.bsums, np.int16, (n_tok, k // Q8K_GROUP))
        if k % QK_K or self.xq.ctypes.data % matvec.X_ALIGN:
            raise FermijitError(f"Q8KAct: xq must be whole {QK_K}-blocks, {matvec.X_ALIGN}-byte "
                                f"aligned")


# --- activation quantisation --------------------------------------------------------------------

@kernel(fastmath=False)
def _quantize_q8_k_kernel(x, xq, d, bsums):
    """quantize_row_q8_K_ref per 256-block (no fast-math: the rounding is the reference's)."""
    n_tok, k = x.shape
    for t in range(n_tok):
        for b in range(k // 256):
            xb = x[t, b * 256:(b + 1) * 256]
            amax = np.float32(0.0)
            mx = np.float32(0.0)
            for j in range(256):
                ax = abs(xb[j])
                if ax > amax:
                    amax = ax
                    mx = xb[j]
            if amax == 0:
                d[t, b] = 0
                for j in range(256):
                    xq[t, b * 256 + j] = 0
                for g in range(16):
                    bsums[t, b * 16 + g] = 0
                continue
            iscale = np.float32(-127.0) / mx
            for g in range(16):
                total = 0
                for j in range(g * 16, g * 16 + 16):
                    q = min(127, np.int32(np.rint(iscale * xb[j])))
                    xq[t, b * 256 + j] = q
                    total += q
                bsums[t, b * 16 + g] = total
            d[t, b] = np.float32(1.0) / iscale


def quantize_act(x: np.ndarray, out: Q8KAct | None = None) -> Q8KAct:
    """x float32 [K] or [T, K] -> Q8KAct (ops/kquant.py quantize_q8_k, bit for bit)."""
    x2 = check_array("kquant.quantize_act", "x", np.atleast_2d(x), np.float32, ndim=2)
    n_tok, k = x2.shape
    if k % QK_K:
        raise FermijitError(f"kquant.quantize_act: {k} inputs are not whole {QK_K}-blocks")
    if out is None:
        out = Q8KAct(matvec.aligned_empty((n_tok, k), np.int8),
                     np.empty((n_tok, k // QK_K), np.float32),
                     np.empty((n_tok, k // Q8K_GROUP), np.int16))
    elif out.xq.shape != x2.shape:
        raise FermijitError(f"kquant.quantize_act: out holds {list(out.xq.shape)}, x is "
                            f"{list(x2.shape)}")
    _quantize_q8_k_kernel(x2, out.xq, out.d, out.bsums)
    return out


# --- the tile, in IR ----------------------------------------------------------------------------

def _call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module,
                                        ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _scale_bytes(builder, wp, off, w):
    """The 12 packed bytes at wp + off + 4 -> <w x i8>, each 128-bit lane sc[0..7], then
    m[0..7], 0..63 (get_scale_min_k4), in vector registers: bytes 0-3 hold sc[0..3] and the top
    bits of sc[4..7], bytes 4-7 m[0..3] and the top bits of m[4..7], bytes 8-11 the low bits of
    sc[4..7] (low nibbles) and m[4..7] (high nibbles). Loaded into every lane (a broadcast load),
    so that the scales' splats below are in-lane shuffles (pshufb), not cross-lane permutes."""
    n = w // 16
    c8 = lambda values: ir.Constant(vec(I8, w), values * n)  # noqa: E731
    # The block's first 16 bytes (d, dmin, the 12), which never straddle a cache line.
    s = _lanes(builder, simd.load(builder, wp, off, vec(I8, 16)), list(range(16)) * n)
    in_lanes = lambda idx: _lanes(builder, s, [16 * i + 4 + j for i in range(n)  # noqa: E731
                                               for j in idx])
    low = in_lanes([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11])
    top = in_lanes([0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7])
    and_, shr = builder.and_, builder.lshr
    out = and_(low, c8([63] * 4 + [15] * 4 + [63] * 4 + [0] * 4))
    out = builder.or_(out, and_(shr(low, c8([4] * 16)), c8([0] * 12 + [15] * 4)))
    return builder.or_(out, and_(shr(top, c8([2] * 16)), c8(([0] * 4 + [0x30] * 4) * 2)))


def _widened(builder, b, idx):
    """Bytes idx of b (<w x i8>, each 0..127) zero-extended to i16 lanes, by one shuffle."""
    w = b.type.count
    pairs = [j for i in idx for j in (i, w)]
    zero = ir.Constant(b.type, None)
    return builder.bitcast(builder.shuffle_vector(b, zero, ir.Constant(vec(I32, len(pairs)),
                                                                        pairs)),
                           vec(I16, len(idx)))


def _lanes(builder, v16, idx):
    return builder.shuffle_vector(v16, v16, ir.Constant(vec(I32, len(idx)), idx))


def _madd4(builder, a, b):
    """Σ a_i·b_i over i16 lanes (8 or 16), by 128-bit pmaddwd (every ISA has them) -> the
    <4 x i32> of partial sums."""
    halves = [[builder.shuffle_vector(x, x, ir.Constant(vec(I32, 8), list(range(h, h + 8))))
               for x in (a, b)] for h in range(0, a.type.count, 8)]
    parts = [_call(builder, _PMADDWD_128, vec(I32, 4), pair) for pair in halves]
    return parts[0] if len(parts) == 1 else builder.add(*parts)


def _scaled_sum(builder, v: Vec, acc, s16, scale):
    """acc + s16 · scale, adjacent i16 pairs summed into acc's i32 lanes: pmaddwd and an add,
    or VNNI's vpdpwssd (the two in one)."""
    if v.dpbusd:
        return _call(builder, v.dpbusd.replace("vpdpbusd", "vpdpwssd"), acc.type,
                     [acc] + [builder.bitcast(a, acc.type) for a in (s16, scale)])
    return builder.add(acc, _call(builder, v.pmaddwd, acc.type, [s16, scale]))


def _splat8(n, value):
    return ir.Constant(vec(I8, n), [value] * n)


class _Emit:
    """How the tile reads one format's super-block (the rest of the tile is shared):
    `header` per row and block (scales, as IR values); `offset` the integer term subtracted
    per token (i32 from the activations' 16-value sums) and its fp32 factor; `units` of chunk c:
    ([(quant register, activation byte offset)], scale per i16 lane) whose pmaddubsw pairs are
    added in i16 and scaled and paired by one pmaddwd."""

    def __init__(self, builder, v: Vec, wp, w_off):
        self.b, self.v, self.w = builder, v, v.nbytes
        self.wp, self.w_off = wp, w_off

    def load(self, offset):
        return simd.load(self.b, self.wp, self.b.add(self.w_off, ir.Constant(I64, offset)),
                         vec(I8, self.w))

    def fp16s(self, offset, n):
        """n fp16 scales at `offset` -> <n x f32>."""
        return simd.fp16_to_f32(self.v, self.b, simd.load(
            self.b, self.wp, self.b.add(self.w_off, ir.Constant(I64, offset)), vec(I16, n)),
            self.subnormal_scales)

    def add_scaled(self, slot, isum, scale, lane):
        """slot (fp32 vector) += isum (i32, as wide) · lane `lane` of `scale`."""
        b = self.b
        n = isum.type.count
        b.store(simd.muladd(b, b.sitofp(isum, vec(F32, n)), _lanes(b, scale, [lane] * n),
                            b.load(slot)), slot)


class _Q4K(_Emit):
    fmt = kquant.Q4_K
    chunks = 4           # 64 values each: sub-blocks 2c (low nibbles) and 2c + 1 (high)
    qs_offset = 16
    # Whether the super-block scales are mostly below fp16's normal range, so that code without
    # F16C converts them without a denormal multiply (simd.fp16_to_f32 subnormal_safe). The
    # quantiser on weights of std 0.02: Q4_K's d ~1.1e-4 and dmin ~9e-4 (normal; the safe way
    # cost its Westmere GEMV 7 %), Q5_K's d ~5e-5 (91 % subnormal), Q6_K's ~1.5e-5 (all): cold
    # 2048x2048 GEMVs of Westmere code with those scales, 2 threads (bench kernels, 3 rounds
    # against the code before): Q6_K 18.5 -> 32.9 GB/s, 0.43 -> 0.77x Q4_0's.
    subnormal_scales = False

    def header(self):
        self.sb = _scale_bytes(self.b, self.wp, self.w_off, self.w)  # sc[0..7], m[0..7]
        self.d_dmin = self.fp16s(0, 2)

    @staticmethod
    def sums(builder, bsums):
        """A token's 16-value sums -> its sub-blocks' 32-value sums (8 i16: at most 32·127)."""
        halves = [_lanes(builder, bsums, list(range(h, h + 8))) for h in (0, 8)]
        return _call(builder, simd.PHADDW[16], vec(I16, 8), halves)

    def accumulate(self, acc, macc, sumi, sums, dx):
        """acc += d·dx·sumi; macc += dmin·dx·Σ_j m_j·sum_j (the mins, subtracted at the end)."""
        b = self.b
        scale = b.fmul(self.d_dmin, simd.splat(b, dx, 2))
        self.add_scaled(acc, sumi, scale, 0)
        self.add_scaled(macc, _madd4(b, _widened(b, self.sb, range(8, 16)), sums), scale, 1)

    def high_bits(self, chunk, part):
        return None, None

    def units(self, chunk):
        b, w = self.b, self.w
        out = []
        for h in (0, 1):
            regs = []
            for p in range(32 // w):
                q = self.load(self.qs_offset + 32 * chunk + w * p)
                q = b.and_(q, _splat8(w, 0x0F)) if h == 0 else b.lshr(q, _splat8(w, 4))
                extra = self.high_bits(chunk, p)[h]
                if extra is not None:
                    q = b.or_(q, extra)
                regs.append((q, 64 * chunk + 32 * h + w * p))
            j = 2 * chunk + h  # sub-block j's scale in each i16 lane, from its 128-bit lane
            out.append((regs, _widened(b, self.sb, [16 * (i // 8) + j for i in range(w // 2)])))
        return out


class _Q5K(_Q4K):
    fmt = kquant.Q5_K
    qs_offset = 48
    subnormal_scales = True

    def high_bits(self, chunk, part):
        """The fifth bits of sub-blocks 2c and 2c + 1: bits 2c and 2c + 1 of qh[l], as 16."""
        b, w = self.b, self.w
        qh = self.load(16 + w * part)
        return tuple(b.shl(b.and_(b.lshr(qh, _splat8(w, 2 * chunk + h)), _splat8(w, 1)),
                           _splat8(w, 4)) for h in (0, 1))


class _Q6K(_Emit):
    fmt = kquant.Q6_K
    chunks = 2           # 128 values each: ql 64 bytes, qh 32 bytes, 8 scales of 16 values
    subnormal_scales = True

    def header(self):
        sc = simd.load(self.b, self.wp, self.b.add(self.w_off, ir.Constant(I64, 192)),
                       vec(I8, 16))
        self.sc = self.b.sext(sc, vec(I16, 16))
        self.d = self.fp16s(208, 1)

    @staticmethod
    def sums(builder, bsums):
        return bsums

    def accumulate(self, acc, macc, sumi, sums, dx):
        """acc += d·dx·(sumi − 32·Σ_g sc_g·bsum_g) (q − 32), exact in i32 (at most ~2^28)."""
        b = self.b
        corr = b.shl(_madd4(b, sums, self.sc), ir.Constant(vec(I32, 4), [5] * 4))
        n = sumi.type.count
        if n > 4:
            corr = b.shuffle_vector(corr, ir.Constant(corr.type, None), ir.Constant(
                vec(I32, n), list(range(4)) + [4] * (n - 4)))
        self.add_scaled(acc, b.sub(sumi, corr), b.fmul(self.d, simd.splat(b, dx, 1)), 0)

    def units(self, chunk):
        b, w = self.b, self.w
        out = []
        for p in range(32 // w):
            ql = [self.load(64 * chunk + 32 * half + w * p) for half in (0, 1)]
            qh = self.load(128 + 32 * chunk + w * p)
            for nib in (0, 1):
                for half in (0, 1):
                    m = 2 * nib + half                  # values 32m + l of this 128
                    lo = (b.and_(ql[half], _splat8(w, 0x0F)) if nib == 0
                          else b.lshr(ql[half], _splat8(w, 4)))
                    hi = b.and_(b.lshr(qh, _splat8(w, 2 * m)), _splat8(w, 3))
                    q = b.or_(lo, b.shl(hi, _splat8(w, 4)))   # 0..63: pairs at most 16002
                    first = 128 * chunk + 32 * m + w * p
                    groups = [8 * chunk + (32 * m + w * p + 2 * lane) // 16
                              for lane in range(w // 2)]
                    out.append(([(q, first)], _lanes(b, self.sc, groups)))
        return out


EMITTERS = {e.fmt.name: e for e in (_Q4K, _Q5K, _Q6K)}
# The block kinds this module multiplies (model/gguf_convert.py): the K-quants by the tile below,
# Q5_0/Q5_1 (on Q8_0 activations) by ops/q5_tile.py's.
PRODUCTS = tuple(EMITTERS) + ("q5_0", "q5_1")


def _make_tile(fmt: kquant.Format, v: Vec, n_rows: int, n_tok: int, spread: bool = False):
    """An intrinsic: out[t0 + t, r0 + r] for r < n_rows, t < n_tok (rows of `fmt` blocks, Q8_K
    tokens); `spread`: rows r0 + r·stride (tile_frame)."""
    w = v.nbytes
    emit = EMITTERS[fmt.name]

    def codegen(context, builder, sig, args):
        f = Frame(context, builder, sig, args, n_rows, n_tok, w, QK_K, 32, spread)
        c = f.c
        macc = [[cgutils.alloca_once_value(builder, ir.Constant(vec(F32, 4), None))
                 for _ in range(n_tok)] for _ in range(n_rows)]
        with cgutils.for_range(builder, f.nb) as loop:
            sb = loop.index
            w_off = builder.mul(sb, c(fmt.block_bytes))
            x_off = builder.mul(sb, c(QK_K))
            ems = []
            for i in range(n_rows):
                for line in range(0, fmt.block_bytes, 64):
                    simd.prefetch(builder, f.w_row[i], builder.add(w_off,
                                                                   c(PREFETCH_BYTES + line)))
                e = emit(builder, v, f.w_row[i], w_off)
                e.header()
                ems.append(e)
            dx = [simd.load_scalar(builder, f.s_row[t], builder.mul(sb, c(4)), F32)
                  for t in range(n_tok)]
            sums = [emit.sums(builder, simd.load(builder, f.m_row[t], builder.mul(sb, c(32)),
                                                 vec(I16, 16))) for t in range(n_tok)]
            sumi = [[ir.Constant(vec(I32, w // 4), None)] * n_tok for _ in range(n_rows)]
            for chunk in range(emit.chunks):
                units = [e.units(chunk) for e in ems]
                for t in range(n_tok):
                    xs = {}
                    for i in range(n_rows):
                        for regs, scale in units[i]:
                            s16 = None
                            for q, x_at in regs:  # i16 pairs, within range (see the formats)
                                if x_at not in xs:
                                    xs[x_at] = simd.load(builder, f.x_row[t], builder.add(
                                        x_off, c(x_at)), vec(I8, w), matvec.X_ALIGN)
                                part = _call(builder, v.pmaddubsw, vec(I16, w // 2),
                                             [q, xs[x_at]])
                                s16 = part if s16 is None else builder.add(s16, part)
                            sumi[i][t] = _scaled_sum(builder, v, sumi[i][t], s16, scale)
            for i, e in enumerate(ems):
                for t in range(n_tok):
                    e.accumulate(f.acc[i][t], macc[i][t], sumi[i][t], sums[t], dx[t])
        for i in range(n_rows):
            for t in range(n_tok):
                f.add(f.macc[i][t], simd.hsum(builder, builder.load(macc[i][t])))
        f.finish()
        return context.get_dummy_value()

    return tile_intrinsic(codegen, spread)


# --- launches -----------------------------------------------------------------------------------

def _share(thread, n_threads, args):
    """One thread's contiguous run of row groups, each over every token in tiles of TOKS."""
    blocks, xq, d, bsums, out = args
    groups = blocks.shape[0] // ROWS
    n_tok = xq.shape[0]
    tok_whole = n_tok // TOKS * TOKS
    first = thread * groups // n_threads
    last = (thread + 1) * groups // n_threads
    for g in range(first, last):
        for t in range(0, tok_whole, TOKS):
            tile(blocks, xq, d, bsums, out, g * ROWS, t, t)
        for t in range(tok_whole, n_tok):
            rows_by_1(blocks, xq, d, bsums, out, g * ROWS, t, t)


def _body(blocks, xq, d, bsums, out):
    fork((blocks, xq, d, bsums, out))
    for r in range(blocks.shape[0] // ROWS * ROWS, blocks.shape[0]):
        for t in range(xq.shape[0]):
            one_by_1(blocks, xq, d, bsums, out, r, t, t)


def _gemv_share(thread, n_threads, args):
    """The decode GEMV's share (K-quants): one thread's run of rows cut into ROWS equal runs
    read side by side (GEMV_STREAMS), the rows left over one by one; every token of the call
    (1..FEW_TOKENS) in each tile."""
    blocks, xq, d, bsums, out = args
    n_rows = blocks.shape[0]
    first = thread * n_rows // n_threads
    last = (thread + 1) * n_rows // n_threads
    per = (last - first) // ROWS
    for j in range(per):
        spread_tile(blocks, xq, d, bsums, out, first + j, 0, 0, per)
    for r in range(first + per * ROWS, last):
        one_row(blocks, xq, d, bsums, out, r, 0, 0)


def _gemv_body(blocks, xq, d, bsums, out):
    fork((blocks, xq, d, bsums, out))


def _gathered_spread_share(thread, n_threads, args):
    """`_gathered_share` with each matrix's run read as ROWS side-by-side streams."""
    blocks, shared, idx, xq, d, sums, out = args
    n_rows = blocks.shape[1]
    n_mats = idx.size + shared.shape[0]
    first = thread * n_mats * n_rows // n_threads
    last = (thread + 1) * n_mats * n_rows // n_threads
    shared_x = xq.shape[0] == 1
    i = first // n_rows
    while i * n_rows < last:
        w = blocks[idx[i]] if i < idx.size else shared[i - idx.size]
        t = 0 if shared_x else i
        g0 = max(first - i * n_rows, 0)
        g1 = min(last - i * n_rows, n_rows)
        per = (g1 - g0) // ROWS
        for j in range(per):
            spread_tile(w, xq, d, sums, out, g0 + j, t, i, per)
        for r in range(g0 + per * ROWS, g1):
            one_row(w, xq, d, sums, out, r, t, i)
        i += 1


def _gathered_share(thread, n_threads, args):
    """One thread's run of (matrix, row) jobs, matrix by matrix: out[i, r] = W[idx[i]][r] · x
    for the routed experts, then out[idx.size + j, r] = S[j][r] · x for each always-on matrix
    S (the shared expert; none: shared [0, R, bytes]); x one token for every row, or x[i]."""
    blocks, shared, idx, xq, d, sums, out = args
    n_rows = blocks.shape[1]
    n_mats = idx.size + shared.shape[0]
    first = thread * n_mats * n_rows // n_threads
    last = (thread + 1) * n_mats * n_rows // n_threads
    shared_x = xq.shape[0] == 1
    i = first // n_rows
    while i * n_rows < last:
        w = blocks[idx[i]] if i < idx.size else shared[i - idx.size]
        t = 0 if shared_x else i
        for r in range(max(first - i * n_rows, 0), min(last - i * n_rows, n_rows)):
            one_by_1(w, xq, d, sums, out, r, t, i)
        i += 1


def _gathered_body(blocks, shared, idx, xq, d, sums, out):
    """The MoE decode's experts of one projection in one launch (model/block_moe.py)."""
    for i in range(idx.size):
        if idx[i] < 0 or idx[i] >= blocks.shape[0]:
            raise IndexError("expert index out of range")
    gathered_fork((blocks, shared, idx, xq, d, sums, out))


def _moe_body(x, xq, d, bsums, ids, weights, gu, shared_gu, dn, shared_dn, w_sg, gu_out, h, hq,
              hd, hbs, routed, out):
    """A decode token's MoE over K-quant experts, the shared expert riding in the routed
    launches, in one dispatch (as ops/moe.py's Q4_0 `_fused_body`): gate_up of the k routed and
    the shared expert (one parallel launch), SwiGLU, each row's Q8_K, down (one launch), the
    weighted sum with the gated shared expert's row."""
    idx = ids[0]
    gu_fork((gu, shared_gu, idx, xq, d, bsums, gu_out))
    swiglu(gu_out, h)
    _quantize_q8_k_kernel(h, hq, hd, hbs)
    dn_fork((dn, shared_dn, idx, hq, hd, hbs, routed))
    k = idx.size
    combine(routed[:k], weights[0], routed[k], x[0], w_sg, out[0])


def _array(dtype, ndim, readonly=False):
    return types.Array(dtype, ndim, "C", readonly=readonly)


# (blocks, xq, scales, sums, out): Q8_K's sums are int16 per 16 values, Q8Act's int32 per 32.
_SIGNATURES = [types.void(_array(types.uint8, 2, True), _array(types.int8, 2, True),
                          _array(types.float32, 2, True), _array(sums, 2, True),
                          _array(types.float32, 2)) for sums in (types.int16, types.int32)]
_GATHERED_SIGNATURES = [types.void(_array(types.uint8, 3, True), _array(types.uint8, 3, True),
                                   _array(types.int32, 1, True), _array(types.int8, 2, True),
                                   _array(types.float32, 2, True), _array(sums, 2, True),
                                   _array(types.float32, 2))
                        for sums in (types.int16, types.int32)]
_kernels: dict = {}


def product_kernel(fmt: kquant.Format, isa: Isa, shape: tuple[int, int]):
    """The kernel of a K-quant format, ISA and tile shape, made on first use (no AVX2 code is
    compiled for a Westmere target: notes/cpu-kernels.md pitfall 5)."""
    key = (fmt.name, isa, shape)
    if key not in _kernels:
        if not supported(isa):
            raise FermijitError(f"kquant: this CPU or Numba target cannot run {isa.label}")
        v = VEC_OF[isa]
        n_rows, n_tok = shape
        make = _make_tile if fmt.name in EMITTERS else q5_tile.make_tile
        tiles = dict(ROWS=n_rows, TOKS=n_tok, tile=make(fmt, v, n_rows, n_tok),
                     rows_by_1=make(fmt, v, n_rows, 1), one_by_1=make(fmt, v, 1, 1))
        threads = "omp" if omp.available() else "serial"
        variant = f"{fmt.name}-{isa.label}-{n_rows}x{n_tok}-{threads}"
        sums = 0 if fmt.name in EMITTERS else 1
        if n_rows == 1 and fmt.name in EMITTERS:   # the decode GEMV, few tokens: row streams
            streams = GEMV_STREAMS[isa] if n_tok == 1 else FEW_STREAMS
            spread = dict(ROWS=streams, spread_tile=_make_tile(fmt, v, streams, n_tok, True),
                          one_row=tiles["tile"])
            variant = (f"{fmt.name}-{isa.label}-gemv{streams}"
                       f"{f'x{n_tok}' if n_tok > 1 else ''}-{threads}")
            _kernels[key] = kernel(_gemv_body, fastmath=False, variant=variant,
                                   signatures=[_SIGNATURES[sums]],
                                   fork=omp.fork(bind(_gemv_share, variant, **spread)))
            if n_tok > 1:
                return _kernels[key]
            _kernels[key + ("gathered",)] = kernel(
                _gathered_body, fastmath=False, variant=variant,
                signatures=[_GATHERED_SIGNATURES[sums]],
                gathered_fork=omp.fork(bind(_gathered_spread_share, variant, **spread)))
            return _kernels[key]
        _kernels[key] = kernel(_body, fastmath=False, variant=variant,
                               signatures=[_SIGNATURES[sums]],
                               fork=omp.fork(bind(_share, variant, **tiles)), **tiles)
        _kernels[key + ("gathered",)] = kernel(
            _gathered_body, fastmath=False, variant=variant,
            signatures=[_GATHERED_SIGNATURES[sums]],
            gathered_fork=omp.fork(bind(_gathered_share, variant, **tiles)))
    return _kernels[key]


def gathered_kernel(fmt: kquant.Format, isa: Isa):
    """The gathered launch of a format and ISA: (blocks [E, R, bytes], shared [S, R, bytes],
    idx, xq, scales, sums, out [n + S, R])."""
    product_kernel(fmt, isa, GEMV_TILE)
    return _kernels[(fmt.name, isa, GEMV_TILE, "gathered")]


def _gathered_fork(fmt: kquant.Format, isa: Isa):
    """(variant, fork intrinsic) of `fmt`'s gathered launch for another kernel to call inside
    its own dispatch (as ops/moe.py's down fork)."""
    v = VEC_OF[isa]
    streams = GEMV_STREAMS[isa]
    tiles = dict(ROWS=streams, spread_tile=_make_tile(fmt, v, streams, 1, True),
                 one_row=_make_tile(fmt, v, 1, 1))
    variant = (f"{fmt.name}-{isa.label}-inner{streams}-"
               f"{'omp' if omp.available() else 'serial'}")
    return variant, omp.fork(bind(_gathered_spread_share, variant, **tiles))


def moe_kernel(gu_fmt: kquant.Format, dn_fmt: kquant.Format, isa: Isa):
    """The fused MoE decode (`_moe_body`) of K-quant experts: gate_up in `gu_fmt`, down in
    `dn_fmt` (routed and shared alike)."""
    from fermijit.ops import moe

    key = ("moe", gu_fmt.name, dn_fmt.name, isa)
    if key not in _kernels:
        if not (is_k_quant(gu_fmt) and is_k_quant(dn_fmt)) or not supported(isa):
            raise FermijitError(f"kquant: no fused MoE for {gu_fmt.name}/{dn_fmt.name} on "
                                f"{isa.label}")
        gu_variant, gu_fork = _gathered_fork(gu_fmt, isa)
        dn_variant, dn_fork = _gathered_fork(dn_fmt, isa)
        _kernels[key] = kernel(_moe_body, fastmath=False,
                               variant=f"{gu_variant}-{dn_variant}", gu_fork=gu_fork,
                               dn_fork=dn_fork, swiglu=moe._swiglu, combine=moe._combine)
    return _kernels[key]


def default_isa(n_tokens: int) -> Isa:
    return decode_isa() if n_tokens == 1 else selected_isa()


def is_k_quant(fmt: kquant.Format) -> bool:
    """True for the formats that take Q8_K activations (else Q8_0: matvec.Q8Act)."""
    return fmt.name in EMITTERS


def quantize_for(fmt: kquant.Format, x: np.ndarray):
    """x float32 [K] or [T, K] as `fmt`'s products take it: Q8KAct, or a Q8Act in natural
    order (SSSE3's layout) for Q5_0/Q5_1."""
    return quantize_act(x) if is_k_quant(fmt) else matvec.quantize_act(x, Isa.SSSE3)


def product(fmt: kquant.Format, blocks: np.ndarray, act, out: np.ndarray,
            isa: Isa | None = None) -> np.ndarray:
    """out [T, R] (or [R] for one token) = W · x for activations from `quantize_for`; the GEMV
    for one token, the GEMM tile for several."""
    kernel_, args = launch(fmt, blocks, act, out, isa)
    try:
        kernel_(*args)
    except TypeError:
        raise FermijitError("kquant: an array has the wrong dtype or layout (need "
                            "C-contiguous; out writable float32)") from None
    return out


def launch(fmt: kquant.Format, blocks: np.ndarray, act, out: np.ndarray,
           isa: Isa | None = None):
    """`product`'s kernel and arguments, checked once, for a caller that repeats the call every
    token (model/forward.py's decode plan): (kernel, args)."""
    if fmt.name not in PRODUCTS:
        raise FermijitError(f"kquant: no CPU kernel for {fmt.name} weights")
    wants = Q8KAct if is_k_quant(fmt) else matvec.Q8Act
    if not isinstance(act, wants) or (wants is matvec.Q8Act and act.vec.isa is not Isa.SSSE3):
        raise FermijitError(f"kquant: {fmt.name} takes activations from quantize_for")
    n_tok, k = act.xq.shape
    rows = blocks.shape[0]
    if blocks.shape[1] != fmt.n_bytes(k):
        raise FermijitError(f"kquant: {fmt.name} rows of {blocks.shape[1]} bytes for x of {k} "
                            f"inputs (need {fmt.n_bytes(k)})")
    out2 = out.reshape(1, rows) if out.ndim == 1 else out
    if out2.shape != (n_tok, rows):
        raise FermijitError(f"kquant: out has shape {list(out.shape)}, expected [{n_tok}, "
                            f"{rows}]")
    isa = isa or default_isa(n_tok)
    kernel_ = product_kernel(fmt, isa, (1, n_tok) if n_tok <= FEW_TOKENS else GEMM_TILE)
    sums = (act.d, act.bsums) if is_k_quant(fmt) else (act.dx, act.xsum8)
    return kernel_, (blocks, act.xq, *sums, out2)


def quantize_launch(fmt: kquant.Format, x: np.ndarray, act):
    """(kernel, args) that quantise x float32 [T, K] into `act` (from `quantize_for` of an x
    of that shape) as `fmt`'s products take it, for a caller that repeats it every token."""
    if is_k_quant(fmt):
        check_array("kquant.quantize_launch", "x", x, np.float32, act.xq.shape)
        return _quantize_q8_k_kernel, (x, act.xq, act.d, act.bsums)
    return matvec.quantize_act, (x, Isa.SSSE3, act)


def cpu(fmt: kquant.Format, blocks: np.ndarray, x, out=None, *, isa: Isa | None = None):
    """`kquant.reference` on the CPU: x float32 [K] or [T, K] (or activations from
    `quantize_for`) -> [R] or [T, R]."""
    check_array("kquant", "blocks", blocks, np.uint8, ndim=2)
    if isinstance(x, np.ndarray):
        if x.shape[-1] % fmt.block_values:
            raise FermijitError(f"kquant: {x.shape[-1]} inputs are not whole "
                                f"{fmt.block_values}-blocks")
        act = quantize_for(fmt, x)
    else:
        act = x
    n_tok = act.xq.shape[0]
    is_vector = isinstance(x, np.ndarray) and x.ndim == 1
    y = output("kquant", out, (blocks.shape[0],) if is_vector else (n_tok, blocks.shape[0]))
    return product(fmt, blocks, act, y, isa)


def gathered(fmt: kquant.Format, blocks: np.ndarray, idx: np.ndarray, act, out=None, *,
             isa: Isa | None = None, shared: np.ndarray | None = None) -> np.ndarray:
    """out [n + S, R] = W[idx[i]] · x for the experts idx (int32 [n]) of blocks [E, R, bytes],
    then S[j] · x for the always-on matrices `shared` [S, R, bytes] (default none); `act` (from
    `quantize_for`) one token for all, or one row per matrix: the MoE decode's experts of a
    projection in one parallel launch."""
    shared = blocks[:0] if shared is None else shared
    check_array("kquant.gathered", "blocks", blocks, np.uint8, ndim=3)
    check_array("kquant.gathered", "shared", shared, np.uint8, (None,) + blocks.shape[1:])
    check_array("kquant.gathered", "idx", idx, np.int32, ndim=1)
    n_act, k = act.xq.shape
    n_mats = idx.size + shared.shape[0]
    if blocks.shape[2] != fmt.n_bytes(k) or n_act not in (1, n_mats):
        raise FermijitError(f"kquant.gathered: {fmt.name} experts {list(blocks.shape)} for "
                            f"{n_act} activation rows of {k} (need 1 or {n_mats}, and rows "
                            f"of {fmt.n_bytes(k)} bytes)")
    y = output("kquant.gathered", out, (n_mats, blocks.shape[1]))
    sums = (act.d, act.bsums) if is_k_quant(fmt) else (act.dx, act.xsum8)
    try:
        gathered_kernel(fmt, isa or decode_isa())(blocks, shared, idx, act.xq, *sums, y)
    except TypeError:
        raise FermijitError("kquant.gathered: an array has the wrong dtype or layout") from None
    except IndexError as e:
        raise FermijitError(f"kquant.gathered: {e}") from None
    return y
