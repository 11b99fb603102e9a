"""LayerNorm with bias over the last axis (the vision tower's, MODEL.md §7; eps 1e-6).

    y = (x - mean) / sqrt(var + eps) · w + b,    var = mean((x - mean)²)

Dimensions: N rows (patches), D their width (1152). fp32 in and out; `cpu` centres and takes the
statistics in fp64 (numpy: it runs a few times per image block), `gpu` in fp32
(kernels_ptx/layer_norm.ptx).
"""

from __future__ import annotations

import numpy as np

from fermijit import FermijitError
from fermijit.jit.checks import check_array


def reference(x, w, b, eps):
    """x [..., D], w and b [D] -> fp32 [..., D], all in fp64."""
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=-1, keepdims=True)
    var = ((x64 - mean) ** 2).mean(axis=-1, keepdims=True)
    y = (x64 - mean) / np.sqrt(var + eps) * w.astype(np.float64) + b.astype(np.float64)
    return y.astype(np.float32)


def cpu(x, w, b, eps):
    """As `reference` (numpy): centred and normalised in fp64, w and b applied in fp32. Centring
    on the mean rounded to fp32 shifted every value of a row whose spread is a few ulps of its
    mean: 5.9e-4 off at mean 300 and rms 1e-3 (tests/ops/test_norm_range.py)."""
    check_array("layer_norm", "x", x, np.float32)
    centred = x - x.mean(axis=-1, keepdims=True, dtype=np.float64)
    inv = 1.0 / np.sqrt(np.square(centred).mean(axis=-1, keepdims=True) + eps)
    return (centred * inv).astype(np.float32) * w + b


def gpu(x, w, b, eps, out=None):
    """As `reference` on the GPU: x [N, D] numpy or on the device (fermijit.jit.gpu); `out` may
    be `x` (in place)."""
    from fermijit.jit import gpu as g

    op = "layer_norm"
    on_device = g.is_device(x) or g.is_device(out)
    g.check_array(op, "x", x, np.float32, ndim=2)
    n_rows, d = x.shape
    if d == 0:
        raise FermijitError(f"{op}: rows must be non-empty")
    y = g.output(op, out, x.shape)
    if n_rows:
        g.kernel("layer_norm")((min(n_rows, g.FERMI_MAX_GRID[0]),), (256,),
                               g.to_device(op, "x", x, np.float32),
                               g.to_device(op, "w", w, np.float32, (d,)),
                               g.to_device(op, "b", b, np.float32, (d,)), y, n_rows, d, eps)
    return g.result(op, y, out, on_device)
