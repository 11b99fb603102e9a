"""Per-head L2 normalisation of the GDN queries and keys (MODEL.md §6.4).

    y = x / sqrt(Σ x² + eps) · scale        over the last axis; eps is added to the sum of squares

The model calls it with eps 1e-6 on q and k, and scale 1/sqrt(dk) on q. Leading axes are
flattened: a token [H, d] or a batch [T, H, d]. Dimensions: T tokens, H heads (16), d head
dim (dk = 128). fp32 in and out; the sum of squares is accumulated in fp64.
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from fermijit import FermijitError
from fermijit.jit.checks import check_array, output
from fermijit.jit.cpu import kernel

# Threads start at this many elements; below, the omp start-up (~30 us, notes/cpu-kernels.md §5)
# costs more than the rows (a decode call, [16, 128], takes about a microsecond).
PARALLEL_MIN_ELEMENTS = 1 << 15


def reference(x, eps, scale=1.0):
    """x [..., H, d] fp32 -> y [..., H, d] fp32."""
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt(np.sum(x64 * x64, axis=-1, keepdims=True) + eps) * scale).astype(
        np.float32)


def _l2norm_rows(x, eps, scale, out):  # x, out [N, d]
    n_rows, d = x.shape
    for r in prange(n_rows):
        ss = 0.0
        for i in range(d):
            v = np.float64(x[r, i])
            ss += v * v
        inv = np.float32(scale / math.sqrt(ss + eps))
        for i in range(d):
            out[r, i] = x[r, i] * inv


_l2norm_serial = kernel(_l2norm_rows)
_l2norm_parallel = kernel(parallel=True, variant="parallel")(_l2norm_rows)


def cpu(x, eps, scale=1.0, out=None):
    """x [..., H, d] fp32 -> y [..., H, d] fp32. `out` may be `x` (in place)."""
    op = "l2norm"
    check_array(op, "x", x, np.float32)
    if x.ndim == 0 or x.shape[-1] == 0:
        raise FermijitError(f"{op}: x needs a non-empty last axis, got shape {list(x.shape)}")
    d = x.shape[-1]
    out = output(op, out, x.shape)
    rows = _l2norm_parallel if x.size >= PARALLEL_MIN_ELEMENTS else _l2norm_serial
    rows(x.reshape(-1, d), float(eps), float(scale), out.reshape(-1, d))
    return out


# --- GPU (kernels_ptx/norm.ptx, MODE l2: one 256-thread block per row, rows grid-strided) -------

def gpu(x, eps, scale=1.0, out=None):
    """As `cpu`; arrays numpy or on the device (fermijit.jit.gpu)."""
    from fermijit.jit import gpu as g

    op = "l2norm"
    on_device = g.is_device(x) or g.is_device(out)
    g.check_array(op, "x", x, np.float32)
    if len(x.shape) == 0 or x.shape[-1] == 0:
        raise FermijitError(f"{op}: x needs a non-empty last axis, got shape {list(x.shape)}")
    d = x.shape[-1]
    y = g.output(op, out, x.shape)
    n_rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    if n_rows:
        g.kernel("norm", MODE="l2")(
            (min(n_rows, g.FERMI_MAX_GRID[0]),), (256,),
            g.to_device(op, "x", x, np.float32), None, None, y, n_rows, d, float(eps),
            float(scale))
    return g.result(op, y, out, on_device)
