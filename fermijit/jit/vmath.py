"""Elementwise math that LLVM can vectorise: Numba's np.exp is a scalar libm call per element
(~5-9 ns here, which made the prefill conv1d cost 9 ns per element at T = 512, C = 8192), while
these are plain float arithmetic that a loop over contiguous elements turns into SIMD code."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from fermijit.jit.cpu import kernel

# Cephes expf: x = n·ln2 + r with |r| <= ln2/2, e^r by a degree-7 polynomial, 2^n through the
# exponent bits. Relative error ~1 ulp on the clamped range; below it the result is 2^-126-ish
# (not 0), above it the largest power of 2 (not inf): callers divide by 1 + e^x, where neither
# matters.
EXP_HI = np.float32(88.37626)   # n = 127 at most: 2^n stays a normal float
EXP_LO = np.float32(-87.33654)  # n = -126 at least
LOG2E = np.float32(1.442695)
LN2_HI = np.float32(0.693359375)
LN2_LO = np.float32(-2.12194440e-4)
P0, P1, P2 = np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3)
P3, P4, P5 = np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1)


@intrinsic
def _f32_from_bits(typingctx, bits):
    """The float32 whose bit pattern is the int32 `bits`."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@kernel(fastmath=False)  # reassociation would undo the two-part ln2 of the range reduction
def exp_f32(x):
    """e^x for float32 x, vectorisable (see above)."""
    x = min(max(x, EXP_LO), EXP_HI)
    n = np.floor(x * LOG2E + np.float32(0.5))
    r = x - n * LN2_HI - n * LN2_LO
    p = ((((P0 * r + P1) * r + P2) * r + P3) * r + P4) * r + P5
    p = p * r * r + r + np.float32(1.0)
    return p * _f32_from_bits(np.int32((np.int32(n) + np.int32(127)) << np.int32(23)))
