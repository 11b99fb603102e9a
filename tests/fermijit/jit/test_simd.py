"""fermijit/jit/simd.py's helpers against numpy, where their lowering is not checked through a
kernel's own test."""

from __future__ import annotations

import numpy as np
import pytest
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from fermijit.jit import simd
from fermijit.jit.simd import F32, I16, I64, vec


def _converter(safe: bool):
    @intrinsic
    def convert4(typingctx, src, dst, i):
        """dst[i:i + 4] = fp16_to_f32(src[i:i + 4]) in SSE code (no F16C)."""
        def codegen(context, builder, sig, args):
            sa, da = (context.make_array(sig.args[k])(context, builder, args[k]) for k in (0, 1))
            at = lambda width: builder.mul(args[2], ir.Constant(I64, width))  # noqa: E731
            f = simd.fp16_to_f32(simd.SSE, builder, simd.load(builder, sa.data, at(2),
                                                               vec(I16, 4)), safe)
            builder.store(f, builder.bitcast(simd.byte_ptr(builder, da.data, at(4)),
                                             vec(F32, 4).as_pointer()), align=1)
            return context.get_dummy_value()

        return types.none(src, dst, i), codegen

    @njit
    def convert(src, dst):
        for i in range(0, src.size, 4):
            convert4(src, dst, i)

    return convert


@pytest.mark.parametrize("safe", [False, True])
def test_fp16_to_f32_without_f16c_is_exact_for_every_finite_half(safe):
    """Every finite fp16 (normal, subnormal, both zeros, both signs) becomes the f32 numpy's
    conversion gives, bit for bit, in either of the Westmere code's two ways."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    bits = bits[np.isfinite(bits.view(np.float16))]
    bits = np.concatenate([bits, bits[:(-bits.size) % 4]])
    out = np.full(bits.size, np.nan, np.float32)
    _converter(safe)(bits.view(np.int16), out)
    np.testing.assert_array_equal(out.view(np.uint32),
                                  bits.view(np.float16).astype(np.float32).view(np.uint32))
