"""Activations rounded to Q8_0 on the GPU, as the CPU prefill's W4A8 products round them (the
GPU prefill then follows the all-CPU path's numerics, not another specification).

    d = max|x_b| / 127 per 32-block b of a row;  q = round-half-away(x · (1/d)) int8;  out = q · d

Letters: K inputs per row (whole 32-blocks), nb = K/32. `reference` is ops.matvec's spec of
`quantize_act` (the CPU kernel's codes and scales, bit for bit); `gpu` computes the same codes and
scales in kernels_ptx/act_quant.ptx and returns them scaled back to fp32 (out = q · d), the input
the prefill's fp32 GEMMs take: their products then equal the CPU's integer block sums times the
scales to fp32 rounding. Blocks whose scale is below 2^-128 (max|x| < 3.7e-37, but not 0) have an
infinite 1/d; the CPU's float-to-int conversion of the result is undefined (LLVM poison), so such
blocks have no specified codes.
"""

from __future__ import annotations

import numpy as np

from fermijit import FermijitError
from fermijit.ops import matvec
from fermijit.ops.quant import BLOCK

ALIGN = 16  # bytes: the kernel reads and writes each block as 16-byte vectors


def reference(x):
    """x fp32 [..., K] -> (q int8 [..., K], d fp32 [..., nb], out fp32 [..., K] = q · d)."""
    x = np.asarray(x, np.float32)
    if x.ndim == 0 or x.shape[-1] % BLOCK:
        raise FermijitError(f"act_quant: x has shape {list(x.shape)}; the last axis must be whole "
                            f"{BLOCK}-blocks")
    q, d = matvec.quantize_act_reference(x.reshape(-1, x.shape[-1]))    # [N, nb, 32], [N, nb]
    out = q.astype(np.float32) * d[..., None]
    nb = x.shape[-1] // BLOCK
    return q.reshape(x.shape), d.reshape(*x.shape[:-1], nb), out.reshape(x.shape)


def gpu(x, out=None, codes: bool = False):
    """`reference`'s out on the GPU; arrays numpy or on the device (fermijit.jit.gpu), out may be
    x. With `codes`, returns (out, q, d), q and d as `reference` gives them (for the tests)."""
    from fermijit.jit import gpu as g

    op = "act_quant"
    on_device = g.is_device(x) or g.is_device(out)
    g.check_array(op, "x", x, np.float32)
    if len(x.shape) == 0 or x.shape[-1] % BLOCK:
        raise FermijitError(f"{op}: x has shape {list(x.shape)}; the last axis must be whole "
                            f"{BLOCK}-blocks")
    x = g.to_device(op, "x", x, np.float32)
    y = g.output(op, out, x.shape)
    for name, a in (("x", x), ("out", y)):
        if int(a.gpudata) % ALIGN:
            raise FermijitError(f"{op}: {name} must start on a {ALIGN}-byte boundary")
    n_blocks = x.size // BLOCK
    q = g.empty(x.shape, np.int8) if codes else None
    d = g.empty((*x.shape[:-1], x.shape[-1] // BLOCK)) if codes else None
    if n_blocks:
        g.kernel("act_quant")((min(-(-n_blocks // 256), g.FERMI_MAX_GRID[0]),), (256,),
                              x, y, q, d, n_blocks)
    result = g.result(op, y, out, on_device)
    if not codes:
        return result
    return (result, *(a if on_device else a.get() for a in (q, d)))


# --- Q8_K: the K-quants' activations (issue 34) -------------------------------------------------

def q8_k_reference(x):
    """x fp32 [..., K] (whole 256-blocks) -> (q int8 [..., K], d fp32 [..., K/256], out = q · d):
    ops/kquant.py quantize_q8_k's codes and scales (llama.cpp's quantize_row_q8_K_ref, the CPU's
    K-quant products' rounding, bit for bit)."""
    from fermijit.ops import kquant

    x = np.asarray(x, np.float32)
    if x.ndim == 0 or x.shape[-1] % kquant.QK_K:
        raise FermijitError(f"act_quant q8_k: x has shape {list(x.shape)}; the last axis must be "
                            f"whole {kquant.QK_K}-blocks")
    q, d, _ = kquant.quantize_q8_k(x.reshape(-1, x.shape[-1]))
    nb = x.shape[-1] // kquant.QK_K
    out = (q.reshape(-1, nb, kquant.QK_K).astype(np.float32) * d[..., None]).astype(np.float32)
    return q.reshape(x.shape), d.reshape(*x.shape[:-1], nb), out.reshape(x.shape)


def q8_k_gpu(x, out=None, codes: bool = False):
    """`q8_k_reference`'s out on the GPU (kernels_ptx/act_quant_k.ptx), as `gpu` is the Q8_0
    one's; out may be x. With `codes`, returns (out, q, d)."""
    from fermijit.jit import gpu as g
    from fermijit.ops import kquant

    op = "act_quant q8_k"
    on_device = g.is_device(x) or g.is_device(out)
    g.check_array(op, "x", x, np.float32)
    if len(x.shape) == 0 or x.shape[-1] % kquant.QK_K:
        raise FermijitError(f"{op}: x has shape {list(x.shape)}; the last axis must be whole "
                            f"{kquant.QK_K}-blocks")
    x = g.to_device(op, "x", x, np.float32)
    y = g.output(op, out, x.shape)
    for name, a in (("x", x), ("out", y)):
        if int(a.gpudata) % ALIGN:
            raise FermijitError(f"{op}: {name} must start on a {ALIGN}-byte boundary")
    n_blocks = x.size // kquant.QK_K
    q = g.empty(x.shape, np.int8) if codes else None
    d = g.empty((*x.shape[:-1], x.shape[-1] // kquant.QK_K)) if codes else None
    if n_blocks:
        g.kernel("act_quant_k")((min(-(-n_blocks // 256), g.FERMI_MAX_GRID[0]),), (256,),
                                x, y, q, d, n_blocks)
    result = g.result(op, y, out, on_device)
    if not codes:
        return result
    return (result, *(a if on_device else a.get() for a in (q, d)))
