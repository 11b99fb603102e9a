"""fp32 math that LLVM can vectorise, for the activation functions of every token.

Numba's `np.exp` on float32 is a call to libm's expf, which the loop vectoriser cannot widen
(no vector math library here): ~5 ns an element. Decode evaluates ~550 k of them a token on the
full-size model (conv SiLU 8192 and gated norm 4096 per GDN layer, SwiGLU 4608 per MoE layer,
attention's softmax and gate), ~2.8 ms of a ~90 ms token. `exp` below is Cephes' expf (range
reduction by ln 2 in two parts, a degree-6 polynomial, the exponent set by integer arithmetic):
straight-line code, inlined into the caller's loop, so the loop vectorises. Measured against a
float64 exp over [-88, 88]: max relative error 1.8e-7 (tests/fermijit/jit/test_mathf.py).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)      # ln 2 in two parts, the first exact in few bits:
_LN2_LO = np.float32(-2.12194440e-4)   # x - n ln2 is then exact for |n| <= 128
# Where e^x is a normal float and 2^n of the reduction fits the exponent field (n in -126..127):
# below, e^x < 1.2e-38 is returned as 0; above, inf.
_X_MIN = np.float32(-87.3)
_X_MAX = np.float32(88.3)
_P0, _P1, _P2, _P3, _P4, _P5 = (np.float32(c) for c in (
    1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
    5.0000001201e-1))


@numba.njit(fastmath=False)
def exp(x):
    """e^x for float32 x; NaN stays NaN; 0 below e^-87.3 (no subnormals), inf above e^88.3."""
    if x != x:
        return x
    if x < _X_MIN:
        return np.float32(0.0)
    if x > _X_MAX:
        return np.float32(np.inf)
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - n * _LN2_HI - n * _LN2_LO
    p = _P0
    p = p * r + _P1
    p = p * r + _P2
    p = p * r + _P3
    p = p * r + _P4
    p = p * r + _P5
    p = p * (r * r) + r + np.float32(1.0)
    return p * _f32_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))  # 2^n


def emit_exp(builder, x):
    """`exp` in LLVM IR for an f32 value or vector x (the same operations, unfused, in the same
    order: the same bits), for kernels written as intrinsics, where a call to `exp` would be
    one lane at a time."""
    n = x.type.count if isinstance(x.type, ir.VectorType) else 0
    i32 = ir.VectorType(ir.IntType(32), n) if n else ir.IntType(32)

    def k(value, ty=x.type):
        return ir.Constant(ty, [value] * n if n else value)

    floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(x.type, [x.type]),
                                           f"llvm.floor.{'v%df32' % n if n else 'f32'}")
    nf = builder.call(floor, [builder.fadd(builder.fmul(x, k(float(_LOG2E))), k(0.5))])
    r = builder.fsub(builder.fsub(x, builder.fmul(nf, k(float(_LN2_HI)))),
                     builder.fmul(nf, k(float(_LN2_LO))))
    p = k(float(_P0))
    for coef in (_P1, _P2, _P3, _P4, _P5):
        p = builder.fadd(builder.fmul(p, r), k(float(coef)))
    p = builder.fadd(builder.fadd(builder.fmul(p, builder.fmul(r, r)), r), k(1.0))
    two_n = builder.bitcast(builder.shl(builder.add(builder.fptosi(nf, i32), k(127, i32)),
                                        k(23, i32)), x.type)
    y = builder.fmul(p, two_n)
    y = builder.select(builder.fcmp_ordered(">", x, k(float(_X_MAX))), k(float("inf")), y)
    y = builder.select(builder.fcmp_ordered("<", x, k(float(_X_MIN))), k(0.0), y)
    return builder.select(builder.fcmp_unordered("uno", x, x), x, y)


@intrinsic
def _f32_from_bits(typingctx, bits):
    """The float32 whose bit pattern is the int32 `bits` (a register move, no memory)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@numba.njit(fastmath=False)
def sigmoid(x):
    """1 / (1 + e^-x): 0 and 1 at the extremes, never NaN for finite x."""
    return np.float32(1.0) / (np.float32(1.0) + exp(-x))


@numba.njit(fastmath=False)
def silu(x):
    """x · sigmoid(x); -0 rather than NaN for very negative x."""
    return x / (np.float32(1.0) + exp(-x))
