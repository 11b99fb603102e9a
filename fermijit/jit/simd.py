"""The SIMD vocabulary kernels are written in: small LLVM IR emitters, one per idiom, each taking a
`Vec` that says how wide the registers are and which x86 instructions exist (ggml builds every dot
product from `mul_sum_i8_pairs`, `hsum_float_8`, `bytes_from_nibbles_32` the same way).

A kernel body calls these from a Numba `@intrinsic` codegen; the body is written once and
instantiated per ISA by passing another `Vec` (STYLE.md, CPU ISA variants). Facts behind the
choices are in notes/cpu-kernels.md: unaligned loads only (Q4_0 data is never 16-byte aligned for
a whole block stream), fp16 scales converted with integer ops on Westmere (pitfall 4), intrinsic
names as LLVM 22 spells them.
"""

from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir
from numba.core import cgutils

from fermijit.jit.cpu import Isa

I8, I16, I32, I64, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
LANE_BYTES = 16  # one SSE register; wider registers are 2 or 4 such lanes


def vec(elem: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(elem, n)


@dataclass(frozen=True)
class Vec:
    """One ISA's registers: `nbytes` wide, and the instructions the vocabulary may emit."""

    isa: Isa
    nbytes: int
    pmaddubsw: str       # u8 x s8 -> adjacent pairs summed to i16
    pmaddwd: str         # i16 x i16 -> adjacent pairs summed to i32
    phaddd: str | None   # per-128-bit-lane horizontal add of i32 pairs (None: emulate)
    dpbusd: str | None   # VNNI: u8 x s8 -> groups of 4 summed into i32, accumulating
    has_f16c: bool       # vcvtph2ps for fp16 scales

    @property
    def lanes(self) -> int:
        return self.nbytes // LANE_BYTES


SSE = Vec(Isa.SSSE3, 16, "llvm.x86.ssse3.pmadd.ub.sw.128", "llvm.x86.sse2.pmadd.wd",
          "llvm.x86.ssse3.phadd.d.128", None, False)
AVX2 = Vec(Isa.AVX2, 32, "llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd",
           "llvm.x86.avx2.phadd.d", None, True)
AVX512VNNI = Vec(Isa.AVX512VNNI, 64, "llvm.x86.avx512.pmaddubs.w.512",
                 "llvm.x86.avx512.pmaddw.d.512", None, "llvm.x86.avx512.vpdpbusd.512", True)
VEC_OF = {v.isa: v for v in (SSE, AVX2, AVX512VNNI)}
# AVX-512 VNNI on 256-bit registers (AVX512VL): the half-width steps of a kernel whose wide steps
# leave whole 8-block runs (K = 384 is none of 16-block steps but one of these and one of SSE's).
AVX512VNNI_256 = Vec(Isa.AVX512VNNI, 32, "llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd",
                     "llvm.x86.avx2.phadd.d", "llvm.x86.avx512.vpdpbusd.256", True)
# The width a kernel steps at between its full-width steps and SSE's, where there is one.
HALF_OF = {AVX512VNNI.isa: AVX512VNNI_256}


def _call(builder, name: str, ret: ir.Type, args: list):
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


# --- memory -------------------------------------------------------------------------------------

def byte_ptr(builder, ptr, offset):
    """`ptr` (any pointer) advanced by `offset` bytes (an i64 value or int), as i8*."""
    base = builder.bitcast(ptr, I8.as_pointer())
    off = offset if isinstance(offset, ir.Value) else ir.Constant(I64, offset)
    return builder.gep(base, [off])


def load(builder, ptr, offset, vty: ir.VectorType, align: int = 1):
    """Vector load; unaligned (movdqu) unless the caller guarantees `align`. Only a 16-byte
    aligned operand can be folded into a legacy-SSE instruction (pmaddubsw xmm, m128), and a
    non-VEX movdqa on a misaligned address faults (pitfall 3): claim alignment only where the
    layout guarantees it."""
    return builder.load(builder.bitcast(byte_ptr(builder, ptr, offset), vty.as_pointer()),
                        align=align)


def load_scalar(builder, ptr, offset, ty: ir.Type):
    return builder.load(builder.bitcast(byte_ptr(builder, ptr, offset), ty.as_pointer()), align=1)


# LLVM's locality hint: 3 is prefetcht0 (into L1 and below), 2 prefetcht1, 1 prefetcht2. Measured
# (cold 2048x2048 GEMV, 1 thread, AVX-512): t0 30.6-32.4 GB/s, t1 28.6, t2 27.0-27.9.
PREFETCH_LOCALITY = 3


def prefetch(builder, ptr, offset, locality: int = PREFETCH_LOCALITY, write: bool = False):
    """Software prefetch of the line at ptr + offset, for reading (or `write`: prefetchw);
    essential for cold weights (notes §5)."""
    p = byte_ptr(builder, ptr, offset)
    _call(builder, "llvm.prefetch.p0", ir.VoidType(),
          [p, ir.Constant(I32, int(write)), ir.Constant(I32, locality), ir.Constant(I32, 1)])


# --- integer idioms -----------------------------------------------------------------------------

def splat(builder, value, n: int):
    v = builder.insert_element(ir.Constant(vec(value.type, n), ir.Undefined), value,
                               ir.Constant(I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(vec(I32, n), [0] * n))


def nibbles(builder, q):
    """Bytes of Q4_0 data -> (low nibbles, high nibbles) as unsigned bytes."""
    n = q.type.count
    lo = builder.and_(q, ir.Constant(vec(I8, n), [0x0F] * n))
    hi = builder.lshr(q, ir.Constant(vec(I8, n), [4] * n))
    return lo, hi


def abs_i8(builder, q):
    """|q| per byte (pabsb); -128 gives 128 read as unsigned, which pmaddubsw wants."""
    return _call(builder, f"llvm.abs.v{q.type.count}i8", q.type,
                 [q, ir.Constant(ir.IntType(1), 0)])


# psignb by width: LLVM left the compare-and-select form below as 5 instructions (pcmpgtb,
# pcmpeqb, pxor, psubb, pandn), not the one psignb.
PSIGNB = {16: "llvm.x86.ssse3.psign.b.128", 32: "llvm.x86.avx2.psign.b"}


def sign_i8(builder, x, q):
    """x with the sign of q per byte (psignb), so |q|·sign(x, q) = q·x; zero where q is zero."""
    if q.type.count in PSIGNB:
        return _call(builder, PSIGNB[q.type.count], q.type, [x, q])
    zero = ir.Constant(q.type, None)
    neg = builder.select(builder.icmp_signed("<", q, zero), builder.sub(zero, x), x)
    return builder.select(builder.icmp_signed("==", q, zero), zero, neg)


def dot_u8s8_i16(v: Vec, builder, pairs):
    """Sum over `pairs` of u8·s8 products in adjacent pairs, as i16 [nbytes/2] (no VNNI).
    Exact while the sums stay within i16: true for 4-bit weights (2·2·15·127 = 7620), and the
    block_sums tree keeps it so (4 units: 30480)."""
    n = v.nbytes
    s16 = None
    for u, s in pairs:
        p = _call(builder, v.pmaddubsw, vec(I16, n // 2), [u, s])
        s16 = p if s16 is None else builder.add(s16, p)
    return s16


def dot_u8s8(v: Vec, builder, pairs):
    """Sum over `pairs` of u8·s8 products, in groups of 4 adjacent bytes -> i32 [nbytes/4].

    Without VNNI the pmaddubsw results are added as i16 before one pmaddwd; that is exact only
    while each sum of pairs stays within i16, which holds for 4-bit weights (2·2·15·128 = 7680),
    not for 8-bit ones (use one call per pair there).
    """
    n = v.nbytes
    if v.dpbusd:
        acc = ir.Constant(vec(I32, n // 4), None)
        for u, s in pairs:
            acc = dpbusd(v, builder, acc, u, s)
        return acc
    return widen_i16(v, builder, dot_u8s8_i16(v, builder, pairs))


def dpbusd(v: Vec, builder, acc, u, s):
    """acc (i32 [nbytes/4]) + each group of 4 adjacent u8·s8 products of u and s (VNNI)."""
    return _call(builder, v.dpbusd, acc.type,
                 [acc, builder.bitcast(u, acc.type), builder.bitcast(s, acc.type)])


def widen_i16(v: Vec, builder, s16):
    """Adjacent i16 pairs summed into i32 (pmaddwd by ones)."""
    n = s16.type.count
    return _call(builder, v.pmaddwd, vec(I32, n // 2), [s16, ir.Constant(s16.type, [1] * n)])


PHADDW = {16: "llvm.x86.ssse3.phadd.w.128", 32: "llvm.x86.avx2.phadd.w"}


def hadd_lanes(v: Vec, builder, a, b):
    """phaddd/phaddw per 128-bit lane: lane L of the result is a's adjacent pairs summed, then
    b's, of lane L (for i32: [a0+a1, a2+a3, b0+b1, b2+b3])."""
    is_i16 = a.type.element.width == 16
    if is_i16:
        return _call(builder, PHADDW[v.nbytes], a.type, [a, b])
    if v.phaddd:
        return _call(builder, v.phaddd, a.type, [a, b])
    n = a.type.count
    per_lane = n // v.lanes
    even, odd = [], []
    for lane in range(v.lanes):
        base = lane * per_lane
        pairs = range(0, per_lane, 2)
        even += [base + i for i in pairs] + [n + base + i for i in pairs]
        odd += [base + i + 1 for i in pairs] + [n + base + i + 1 for i in pairs]
    e = builder.shuffle_vector(a, b, ir.Constant(vec(I32, n), even))
    o = builder.shuffle_vector(a, b, ir.Constant(vec(I32, n), odd))
    return builder.add(e, o)


def block_sums(v: Vec, builder, parts, runs: int = 1):
    """Four vectors of partial sums, one block per 128-bit lane (i32: 4 partials per block; i16:
    8 partials, from dot_u8s8_i16) -> i32 [4·lanes]: the block sums in block order (vector j
    holds blocks j·lanes .. j·lanes+lanes-1). With `runs`, the lanes are that many runs side by
    side, each its own blocks (two tokens' registers in one: ops/matvec.py PAIRED): each run's
    block sums in order, the runs' one after another."""
    a, b, c, d = parts
    r = hadd_lanes(v, builder, hadd_lanes(v, builder, a, b), hadd_lanes(v, builder, c, d))
    if r.type.element.width == 16:
        r = widen_i16(v, builder, r)  # the i16 tree ends with 2 partials per block
    if v.lanes == 1:
        return r
    # Lane L now holds blocks L, w+L, 2·w+L, 3·w+L of its run (w lanes a run): block b of run h
    # sits at 4·(h·w + b%w) + b//w.
    w = v.lanes // runs
    order = [4 * (h * w + blk % w) + blk // w for h in range(runs) for blk in range(4 * w)]
    return builder.shuffle_vector(r, r, ir.Constant(vec(I32, 4 * v.lanes), order))


# --- float idioms -------------------------------------------------------------------------------

def fp16_to_f32(v: Vec, builder, h, subnormal_safe: bool = False):
    """Vector of fp16 bit patterns (i16) -> f32. With F16C this is vcvtph2ps; Westmere has no
    F16C and LLVM's libcall for `fpext half` is unresolvable in-process (a segfault, pitfall 4),
    so, in 4 integer/float ops: h << 16 (sign at bit 31), arithmetic shift right 3 (exponent and
    mantissa land where f32 keeps them), clear the 3 copies of the sign below bit 31, times
    2^112 to rebias the exponent. Exact for normal and subnormal scales (never inf or NaN), but
    a subnormal fp16 is an f32 denormal there, and a multiply of a denormal takes a microcode
    assist: `subnormal_safe` for scales that are often below fp16's normal range (a K-quant's
    super-block d: Q6_K's is ~2e-5 for real weights, 2^-14 being the smallest normal; the
    full-size Q6_K head's SSSE3 GEMV took 21.6 ms against 11.5 with normal scales), in ~12 ops:
    the exponent rebiased in the integer bits, and for a zero or subnormal h one more and 2^-14
    subtracted (2^-14 (1 + m/1024) - 2^-14 = m 2^-24, exact), so no float op sees a denormal."""
    n = h.type.count
    if v.has_f16c:
        return builder.fpext(builder.bitcast(h, vec(ir.HalfType(), n)), vec(F32, n))
    i32x = vec(I32, n)
    if subnormal_safe:
        c = lambda x: ir.Constant(i32x, [x] * n)  # noqa: E731
        w = builder.zext(h, i32x)
        magnitude = builder.and_(w, c(0x7FFF))
        tiny = builder.sext(builder.icmp_signed("<", magnitude, c(0x0400)), i32x)  # exponent 0
        o = builder.add(builder.shl(magnitude, c(13)), c(112 << 23))
        o = builder.add(o, builder.and_(tiny, c(1 << 23)))
        f = builder.fsub(builder.bitcast(o, vec(F32, n)),
                         builder.bitcast(builder.and_(tiny, c(113 << 23)), vec(F32, n)))
        sign = builder.shl(builder.and_(w, c(0x8000)), c(16))
        return builder.bitcast(builder.or_(builder.bitcast(f, i32x), sign), vec(F32, n))
    w = builder.shl(builder.zext(h, i32x), ir.Constant(i32x, [16] * n))
    w = builder.ashr(w, ir.Constant(i32x, [3] * n))
    w = builder.and_(w, ir.Constant(i32x, [0x8FFFE000 - (1 << 32)] * n))
    return builder.fmul(builder.bitcast(w, vec(F32, n)), ir.Constant(vec(F32, n), [2.0 ** 112] * n))


def muladd(builder, a, b, c):
    """a · b + c, fused where the target has FMA (llvm.fmuladd: one rounding there, two on
    SSE): the same bits wherever one compiled kernel runs it, not across targets."""
    name = (f"llvm.fmuladd.v{a.type.count}f32" if isinstance(a.type, ir.VectorType)
            else "llvm.fmuladd.f32")
    return _call(builder, name, a.type, [a, b, c])


def hsums(builder, xs):
    """[hsum(x) for x in xs] as one vector, for a power-of-2 count of f32 vectors of n lanes (at
    most n): the same additions as hsum's for every sum, with far fewer shuffles. Each step adds
    the low and high halves of the runs of lanes left of two vectors into one (so 16 vectors take
    15 such steps, not 16 x 4), then adds within the last vector's runs at full width."""

    def halves(x, y, w):  # x, y: runs of w lanes -> each run's low + high half, x's runs first
        lo = [r * w + i for r in range(x.type.count // w) for i in range(w // 2)]
        lo += [i + x.type.count for i in lo]                         # y's lanes follow x's
        hi = [i + w // 2 for i in lo]
        pick = lambda idx: builder.shuffle_vector(  # noqa: E731
            x, y, ir.Constant(vec(I32, len(idx)), idx))
        return builder.fadd(pick(lo), pick(hi))

    n = w = xs[0].type.count
    while len(xs) > 1:
        xs, w = [halves(x, y, w) for x, y in zip(xs[::2], xs[1::2])], w // 2
    v, run = xs[0], w
    while w > 1:  # full width, each lane plus its partner half a run away (one in-lane shuffle)
        w //= 2
        v = builder.fadd(v, builder.shuffle_vector(v, v, ir.Constant(
            vec(I32, n), [i ^ w for i in range(n)])))
    return builder.shuffle_vector(v, v, ir.Constant(vec(I32, n // run), list(range(0, n, run))))


def hmax(builder, x):
    """Horizontal maximum of an f32 vector by halving shuffles (compare and select) -> scalar."""
    n = x.type.count
    while n > 1:
        half = n // 2
        hi = builder.shuffle_vector(x, x, ir.Constant(vec(I32, half), list(range(half, n))))
        lo = builder.shuffle_vector(x, x, ir.Constant(vec(I32, half), list(range(half))))
        x, n = builder.select(builder.fcmp_ordered(">", hi, lo), hi, lo), half
    return builder.extract_element(x, ir.Constant(I32, 0))


def hsum(builder, x):
    """Horizontal sum of an i32 or f32 vector by halving shuffles -> scalar."""
    add = builder.fadd if isinstance(x.type.element, ir.FloatType) else builder.add
    n = x.type.count
    while n > 1:
        half = n // 2
        hi = builder.shuffle_vector(x, x, ir.Constant(vec(I32, half), list(range(half, n))))
        lo = builder.shuffle_vector(x, x, ir.Constant(vec(I32, half), list(range(half))))
        x, n = add(lo, hi), half
    return builder.extract_element(x, ir.Constant(I32, 0))
