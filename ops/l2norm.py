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
from fermijit.jit import omp
from fermijit.jit.cpu import kernel

# Threads start at this many elements; below, the omp start-up (~30 us, notes/cpu-kernels.md §5)
# costs more than the rows (a decode call, [16, 128], takes about a microsecond).
PARALLEL_MIN_ELEMENTS = 1 << 15


def reference(x, eps, scale=1.0):
    """x [..., H, d] fp32 -> y [..., H, d] fp32."""
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt(np.sum(x64 * x64, axis=-1, keepdims=True) + eps) * scale).astype(
        np.float32)


def _l2norm_rows(x, eps, scale, out):  # x, out [N, d]; out may be x itself
    n_rows, d = x.shape
    in_place = x.ctypes.data == out.ctypes.data  # its own loop: as ops/rmsnorm.py _rmsnorm_rows
    for r in prange(n_rows):
        ss = 0.0
        for i in range(d):
            v = np.float64(x[r, i])
            ss += v * v
        inv = np.float32(scale / math.sqrt(ss + eps))
        if in_place:
            row = out[r]
            for i in range(d):
                row[i] = row[i] * inv
        else:
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


# --- prefill: the conv output split into the GDN's inputs, q and k normalised ------------------

@kernel
def _norm_into(x, eps, scale, out):  # x, out [d]: `_l2norm_rows`' arithmetic on one row
    ss = 0.0
    for i in range(x.size):
        v = np.float64(x[i])
        ss += v * v
    inv = np.float32(scale / math.sqrt(ss + eps))
    for i in range(x.size):
        out[i] = x[i] * inv


def _split_share(thread, n_threads, args):
    """A thread's run of token rows: q and k heads normalised out of the row, v copied."""
    mixed, eps, q_scale, q, k, v = args
    n_tok, n_key_heads, dk = q.shape
    n_value_heads, dv = v.shape[1], v.shape[2]
    width = n_key_heads * dk
    for t in range(thread * n_tok // n_threads, (thread + 1) * n_tok // n_threads):
        row = mixed[t]
        for h in range(n_key_heads):
            _norm_into(row[h * dk:(h + 1) * dk], eps, q_scale, q[t, h])
            _norm_into(row[width + h * dk:width + (h + 1) * dk], eps, 1.0, k[t, h])
        for h in range(n_value_heads):
            start = 2 * width + h * dv
            v_th, part = v[t, h], row[start:start + dv]
            for i in range(dv):
                v_th[i] = part[i]


def _split_body(mixed, eps, q_scale, q, k, v):
    fork((mixed, eps, q_scale, q, k, v))


_split_kernel = omp.forking_kernel(_split_body, fork=_split_share)


def split_cpu(mixed, eps, q_scale, q, k, v):
    """Prefill's GDN inputs from the conv output in one pass (three copies and two calls of `cpu`
    before): mixed [T, 2·Hk·dk + Hv·dv] (q | k | v per token) -> q [T, Hk, dk]
    = `cpu`(q part, eps, q_scale), k = `cpu`(k part, eps), v [T, Hv, dv] its part as it is."""
    op = "l2norm.split"
    n_tok, width = check_array(op, "mixed", mixed, np.float32, ndim=2).shape
    check_array(op, "q", q, np.float32, (n_tok, None, None))
    check_array(op, "k", k, np.float32, q.shape)
    check_array(op, "v", v, np.float32, (n_tok, None, None))
    if width != 2 * q.shape[1] * q.shape[2] + v.shape[1] * v.shape[2]:
        raise FermijitError(f"{op}: mixed rows of {width} are not q {list(q.shape[1:])}, k and "
                            f"v {list(v.shape[1:])}")
    for name, a in (("q", q), ("k", k), ("v", v)):
        if not a.flags.writeable or np.may_share_memory(a, mixed):
            raise FermijitError(f"{op}: {name} must be writeable and apart from mixed")
    if n_tok:
        _split_kernel()(mixed, float(eps), float(q_scale), q, k, v)
    return q, k, v


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
