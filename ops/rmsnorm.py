"""RMSNorm, zero-centred, and the gated RMSNorm of the GDN output (MODEL.md §4).

    rmsnorm:  y = x / sqrt(mean(x²) + eps) · (1 + w)          w stored as an offset from 1
    gated:    y = w · [o / sqrt(mean(o²) + eps)] · silu(z)    w a plain weight; norm before gate

Both normalise each row of the last axis; leading axes are flattened, so one call covers a token
[D], a batch [T, D] or per-head norms [T, H, D] (q_norm/k_norm, the GDN heads [T, Hv, dv]).
Dimensions: T tokens, D row width (2048 model, 256 attention head), Hv value heads (32),
dv value head dim (128). fp32 in and out; the sum of squares is accumulated in fp64.
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from fermijit import FermijitError
from fermijit.jit.checks import check_array, output
from fermijit.jit import mathf
from fermijit.jit.cpu import kernel

# From this many elements the row loop runs on all threads; below it one thread wins, since
# starting the omp team costs ~30 us (notes/cpu-kernels.md §5) and a 2048-wide row takes ~1 us.
PARALLEL_MIN_ELEMENTS = 1 << 15


def reference(x, w, eps):
    """x [..., D] fp32, w [D] -> y [..., D] fp32."""
    x64 = x.astype(np.float64)
    rms = np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return (x64 / rms * (1.0 + w.astype(np.float64))).astype(np.float32)


def gated_reference(o, z, w, eps):
    """o, z [..., Hv, dv] fp32, w [dv] -> y [..., Hv, dv] fp32."""
    o64, z64 = o.astype(np.float64), z.astype(np.float64)
    rms = np.sqrt(np.mean(o64 * o64, axis=-1, keepdims=True) + eps)
    silu = z64 / (1.0 + np.exp(-z64))
    return (w.astype(np.float64) * (o64 / rms) * silu).astype(np.float32)


# --- kernels ------------------------------------------------------------------------------------

@kernel
def _inv_rms(row, eps):  # row [D] -> 1/sqrt(mean(row²) + eps), summed in float64
    ss = 0.0
    for i in range(row.size):
        v = np.float64(row[i])
        ss += v * v
    return np.float32(1.0 / math.sqrt(ss / row.size + eps))


def _rmsnorm_rows(x, w, eps, out):  # x, out [N, D]; w [D]; out may be x itself
    n_rows, d = x.shape
    # In place (decode's q and k norms, ops/attention_step.py) a loop of its own: the shared one
    # failed the vectoriser's overlap check there and ran scalar (16 full-size heads 2.8 us
    # against 0.6). The same operations.
    in_place = x.ctypes.data == out.ctypes.data
    for r in prange(n_rows):
        inv = _inv_rms(x[r], eps)
        if in_place:
            row = out[r]
            for i in range(d):
                row[i] = row[i] * inv * (np.float32(1.0) + w[i])
        else:
            for i in range(d):
                out[r, i] = x[r, i] * inv * (np.float32(1.0) + w[i])


def _residual_rows(x, y, w, eps, out):  # x += y, then out = rmsnorm(x): rows [N, D]; w [D]
    n_rows, d = x.shape
    for r in prange(n_rows):
        x_r, y_r = x[r], y[r]
        for i in range(d):
            x_r[i] += y_r[i]
        inv = _inv_rms(x_r, eps)
        for i in range(d):
            out[r, i] = x_r[i] * inv * (np.float32(1.0) + w[i])


# Rows per scratch row of the gated norm, whose rows are computed into scratch, then copied: one
# loop reading o and z and writing `out` is not vectorised when out is o or z (forward.py and
# gdn_step norm in place; LLVM's overlap check then takes the scalar copy, exp and all).
# Measured, 1 thread, [512, 32, 128] in place: 5.3 -> 0.68 ns an element (0.67 out of place).
GATED_CHUNK = 16


def _gated_rows(o, z, w, eps, out):  # o, z, out [N, dv]; w [dv]
    n_rows, d = o.shape
    for c in prange((n_rows + GATED_CHUNK - 1) // GATED_CHUNK):
        row = np.empty(d, np.float32)
        for r in range(c * GATED_CHUNK, min(n_rows, (c + 1) * GATED_CHUNK)):
            inv = _inv_rms(o[r], eps)
            for i in range(d):
                row[i] = w[i] * (o[r, i] * inv) * mathf.silu(z[r, i])
            for i in range(d):
                out[r, i] = row[i]


# One body each, compiled twice: the serial copy for decode-sized calls, the other on all threads.
_rmsnorm_serial = kernel(_rmsnorm_rows)
_rmsnorm_parallel = kernel(parallel=True, variant="parallel")(_rmsnorm_rows)
_residual = kernel(parallel=True)(_residual_rows)
_gated_serial = kernel(_gated_rows)
_gated_parallel = kernel(parallel=True, variant="parallel")(_gated_rows)


# --- public -------------------------------------------------------------------------------------

def _row_width(op: str, name: str, a) -> int:
    check_array(op, name, a, np.float32)
    if a.ndim == 0 or a.shape[-1] == 0:
        raise FermijitError(f"{op}: {name} needs a non-empty last axis, got shape {list(a.shape)}")
    return a.shape[-1]


def cpu(x, w, eps, out=None):
    """x [..., D] fp32, w [D] fp32 -> y [..., D] fp32. `out` may be `x` (in place)."""
    op = "rmsnorm"
    d = _row_width(op, "x", x)
    check_array(op, "w", w, np.float32, (d,))
    out = output(op, out, x.shape)
    rows = _rmsnorm_parallel if x.size >= PARALLEL_MIN_ELEMENTS else _rmsnorm_serial
    rows(x.reshape(-1, d), w, float(eps), out.reshape(-1, d))
    return out


def residual_cpu(x, y, w, eps, out):
    """x += y, then out = `cpu`(x, w, eps), bit for bit, in one pass over the rows: a prefill
    pass's residual stream [T, D] into the next sublayer's input, without a numpy add streaming
    x and y once more (16 a default-model pass). y None: `cpu` alone."""
    if y is None:
        return cpu(x, w, eps, out)
    op = "rmsnorm.residual"
    d = _row_width(op, "x", x)
    check_array(op, "y", y, np.float32, x.shape)
    check_array(op, "w", w, np.float32, (d,))
    out = output(op, out, x.shape)
    if not x.flags.writeable or any(np.may_share_memory(a, b) for a, b in ((x, y), (x, out))):
        raise FermijitError(f"{op}: x must be writeable and apart from y and out")
    _residual(x.reshape(-1, d), y.reshape(-1, d), w, float(eps), out.reshape(-1, d))
    return out


def gated_cpu(o, z, w, eps, out=None):
    """o, z [..., Hv, dv] fp32, w [dv] fp32 -> y [..., Hv, dv] fp32. `out` may be `o` or `z`."""
    op = "gated rmsnorm"
    d = _row_width(op, "o", o)
    if o.ndim < 2:
        raise FermijitError(f"{op}: o must be [..., Hv, dv], got shape {list(o.shape)}")
    check_array(op, "z", z, np.float32, o.shape)
    check_array(op, "w", w, np.float32, (d,))
    out = output(op, out, o.shape)
    rows = _gated_parallel if o.size >= PARALLEL_MIN_ELEMENTS else _gated_serial
    rows(o.reshape(-1, d), z.reshape(-1, d), w, float(eps), out.reshape(-1, d))
    return out


# --- GPU (kernels_ptx/norm.ptx: one 256-thread block per row, rows grid-strided) ----------------

def _norm_gpu(op, mode, x, z, w, eps, out):
    from fermijit.jit import gpu as g

    on_device = g.is_device(x) or g.is_device(out)
    g.check_array(op, "x", x, np.float32)
    if len(x.shape) == 0 or x.shape[-1] == 0 or (mode == "gated" and len(x.shape) < 2):
        raise FermijitError(f"{op}: needs rows [..., D] (gated: [..., Hv, dv]), got shape "
                            f"{list(x.shape)}")
    d = x.shape[-1]
    if z is not None:
        g.check_array(op, "z", z, np.float32, x.shape)
    g.check_array(op, "w", w, np.float32, (d,))
    y = g.output(op, out, x.shape)
    n_rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    if n_rows:
        g.kernel("norm", MODE=mode)(
            (min(n_rows, g.FERMI_MAX_GRID[0]),), (256,),
            g.to_device(op, "x", x, np.float32),
            None if z is None else g.to_device(op, "z", z, np.float32),
            g.to_device(op, "w", w, np.float32), y, n_rows, d, float(eps), 1.0)
    return g.result(op, y, out, on_device)


def gpu(x, w, eps, out=None):
    """As `cpu`; arrays numpy or on the device (fermijit.jit.gpu)."""
    return _norm_gpu("rmsnorm", "rms", x, None, w, eps, out)


def gated_gpu(o, z, w, eps, out=None):
    """As `gated_cpu`; arrays numpy or on the device (fermijit.jit.gpu)."""
    return _norm_gpu("gated rmsnorm", "gated", o, z, w, eps, out)
