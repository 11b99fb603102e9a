"""GELU, the vision tower's activations (MODEL.md §7): the tanh form in the blocks' MLP
(`gelu_pytorch_tanh`), the exact erf form in the patch merger (torch's nn.GELU()).

    exact  y = x/2 · (1 + erf(x/√2))
    tanh   y = x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³)))

fp32 in and out, computed in fp64 per element (numpy has no erf, so the CPU form is a Numba
kernel). Any shape; it runs on the [patches, 4304] and [tokens, 4608] activations once per image.
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from fermijit import FermijitError
from fermijit.jit.checks import check_array, output
from fermijit.jit.cpu import kernel

FORMS = ("exact", "tanh")
_TANH_C = math.sqrt(2.0 / math.pi)


def reference(x, form: str):
    """x fp32 (any shape) -> y fp32."""
    x64 = x.astype(np.float64)
    if form == "tanh":
        y = 0.5 * x64 * (1.0 + np.tanh(_TANH_C * (x64 + 0.044715 * x64 ** 3)))
    else:
        y = 0.5 * x64 * (1.0 + np.vectorize(math.erf, otypes=[np.float64])(x64 / math.sqrt(2)))
    return y.astype(np.float32)


def _gelu_flat(x, is_tanh, out):  # x, out [N]
    n = x.shape[0]
    for i in prange(n):
        v = np.float64(x[i])
        if is_tanh:
            out[i] = np.float32(0.5 * v * (1.0 + math.tanh(_TANH_C * (v + 0.044715 * v * v * v))))
        else:
            out[i] = np.float32(0.5 * v * (1.0 + math.erf(v * 0.7071067811865476)))


_gelu_parallel = kernel(parallel=True, variant="parallel")(_gelu_flat)


def cpu(x, form: str, out=None):
    """x fp32 (any shape) -> y fp32; `out` may be `x` (in place)."""
    op = "gelu"
    if form not in FORMS:
        raise FermijitError(f"{op}: form must be one of {', '.join(FORMS)}, got {form!r}")
    check_array(op, "x", x, np.float32)
    out = output(op, out, x.shape)
    if x.size:
        _gelu_parallel(x.reshape(-1), form == "tanh", out.reshape(-1))
    return out
