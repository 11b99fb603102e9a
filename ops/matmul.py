"""Dense projections of prefill: y = x · Wᵀ with Q4_0 weights (MODEL.md §5-6 projections).

Letters: T tokens, N output rows, K inputs. x [T, K] fp32; W as ops.quant's Q4_0 structure of
arrays (qs uint8 [N, K/2], d float16 [N, K/32]); y [T, N] fp32.

`reference` is the spec: fp32 activations times the dequantised weights (DESIGN.md, Numerics:
prefill keeps activations in fp32). `gpu` is that, in PTX (kernels_ptx/q4_gemm.ptx, dense mode:
64 x 128 tiles, weights dequantised in registers; one token: q4_gemv.ptx, a warp per output).
`cpu` is the CPU prefill's batched W4A8 GEMM (ops.matvec: activations quantised per 32-block to
int8), so it matches `reference` to the precision of 8-bit activations (~1e-2 relative), and
ops.matvec.reference exactly.
"""

from __future__ import annotations

import numpy as np

from fermijit.jit.checks import check_array
from fermijit.ops import matvec
from fermijit.ops.quant import BLOCK, dequantize_q4_0

TILE_ROWS, TILE_COLS = 64, 128  # tokens x outputs per GPU block (kernels_ptx/q4_gemm.ptx)
GEMV_ROWS = 8                   # outputs per GPU block of one token (kernels_ptx/q4_gemv.ptx)


def reference(x, qs, d):
    """x [T, K] fp32 -> x · dequantize_q4_0(qs, d)ᵀ, [T, N] fp32 (float64 inside)."""
    return (x.astype(np.float64) @ dequantize_q4_0(qs, d).astype(np.float64).T).astype(np.float32)


def cpu(x, qs, d, out=None):
    """The W4A8 GEMM of the CPU prefill (ops.matvec.cpu over all T tokens at once)."""
    check_array("matmul", "x", x, np.float32, ndim=2)
    return matvec.cpu(qs, d, x, out=out)


def gpu(x, qs, d, out=None):
    """`reference` on the GPU; arrays numpy or on the device (fermijit.jit.gpu)."""
    from fermijit.jit import gpu as g

    op = "matmul"
    on_device = g.is_device(x) or g.is_device(out)
    g.check_array(op, "x", x, np.float32, ndim=2)
    n_tokens, k = x.shape
    g.check_array(op, "d", d, np.float16, (None, k // BLOCK))
    n = d.shape[0]
    g.check_array(op, "qs", qs, np.uint8, (n, k // 2))
    if k % BLOCK:
        g.check_array(op, "x", x, np.float32, (n_tokens, k // BLOCK * BLOCK))  # names the shape
    y = g.output(op, out, (n_tokens, n))
    if n_tokens == 1 and 0 < n <= GEMV_ROWS * g.FERMI_MAX_GRID[0]:
        g.kernel("q4_gemv")(
            (-(-n // GEMV_ROWS),), (256,), g.to_device(op, "x", x, np.float32),
            g.to_device(op, "qs", qs, np.uint8), g.to_device(op, "d", d, np.float16), y, n, k)
    elif n_tokens and n:
        g.kernel("q4_gemm", MODE="dense")(
            (-(-n // TILE_COLS), -(-n_tokens // TILE_ROWS)), (256,),
            g.to_device(op, "x", x, np.float32), g.to_device(op, "qs", qs, np.uint8),
            g.to_device(op, "d", d, np.float16), y, None, None, None, n_tokens, n, k)
    return g.result(op, y, out, on_device)
