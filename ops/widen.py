"""float16 -> float32, on all threads: the vision tower's f16 weights made fp32 as each block
runs (model/vision.py). numpy's astype widens at ~12 ns an element here (0.75 s of a 448x448
image's 3.5 s through two blocks, measured); this reads the bits through the exact 65536-entry
table of ops/embedding.py (Numba cannot read float16, notes/cpu-kernels.md pitfall 4).
"""

from __future__ import annotations

import numpy as np
from numba import prange

from fermijit.jit.checks import check_array, output
from fermijit.jit.cpu import kernel
from fermijit.ops.embedding import _F16_TO_F32

PARALLEL_MIN_ELEMENTS = 1 << 16


def reference(x):
    """x float16 (any shape) -> float32."""
    return x.astype(np.float32)


def _widen(bits, lut, out):  # bits uint16 [N], out fp32 [N]
    for i in prange(bits.shape[0]):
        out[i] = lut[bits[i]]


_widen_serial = kernel(_widen)
_widen_parallel = kernel(parallel=True, variant="parallel")(_widen)


def cpu(x, out=None):
    """x float16 (any shape, C-contiguous) -> float32; float32 input is returned as it is."""
    if isinstance(x, np.ndarray) and x.dtype == np.float32:
        return x
    op = "widen"
    check_array(op, "x", x, np.float16)
    out = output(op, out, x.shape)
    run = _widen_parallel if x.size >= PARALLEL_MIN_ELEMENTS else _widen_serial
    run(x.reshape(-1).view(np.uint16), _F16_TO_F32, out.reshape(-1))
    return out
