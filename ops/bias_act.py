"""The epilogue of the vision tower's linear layers on the GPU (kernels_ptx/bias_act.ptx):

    none       out = y + b
    residual   out = res + y + b
    gelu_tanh  out = gelu_tanh(y + b)     (the blocks' MLP)
    gelu_erf   out = gelu(y + b)          (the merger)

b [C] is added to every row of y [N, C]. The CPU form is numpy's adds and ops/gelu.py in
model/vision.py; this module holds the spec and the GPU launcher.
"""

from __future__ import annotations

import numpy as np

from fermijit import FermijitError
from fermijit.ops import gelu

ACTS = ("none", "residual", "gelu_tanh", "gelu_erf")


def reference(y, b, act: str, res=None):
    """y [N, C], b [C] (res [N, C] for "residual") -> fp32 [N, C]."""
    v = y.astype(np.float64) + b.astype(np.float64)
    if act == "residual":
        v = v + res.astype(np.float64)
    elif act in ("gelu_tanh", "gelu_erf"):
        v = gelu.reference(v, act[5:].replace("erf", "exact")).astype(np.float64)
    return v.astype(np.float32)


def gpu(y, b, act: str, res=None, out=None):
    """As `reference` on the GPU; arrays numpy or on the device; `out` may be `y` or `res`."""
    from fermijit.jit import gpu as g

    op = "bias_act"
    if act not in ACTS:
        raise FermijitError(f"{op}: act must be one of {', '.join(ACTS)}, got {act!r}")
    if (res is None) != (act != "residual"):
        raise FermijitError(f"{op}: res is needed by act residual, and by it only")
    on_device = g.is_device(y) or g.is_device(out)
    g.check_array(op, "y", y, np.float32, ndim=2)
    n_rows, n_cols = y.shape
    if n_cols == 0:
        raise FermijitError(f"{op}: rows must be non-empty")
    d_out = g.output(op, out, y.shape)
    n = n_rows * n_cols
    if n:
        g.kernel("bias_act", ACT=act)((min(-(-n // 256), g.FERMI_MAX_GRID[0]),), (256,),
                                      g.to_device(op, "y", y, np.float32),
                                      g.to_device(op, "b", b, np.float32, (n_cols,)),
                                      None if res is None else
                                      g.to_device(op, "res", res, np.float32, y.shape),
                                      d_out, n, n_cols)
    return g.result(op, d_out, out, on_device)
