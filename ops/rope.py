"""Partial rotate-half RoPE on the first R dims of each head (MODEL.md §5.4).

For j < R/2, with inv_j = theta^(-2j/R) and angle a = position · inv_j, the pair (j, j + R/2)
turns by a:  [x_j; x_{j+R/2}] -> [x_j cos a - x_{j+R/2} sin a; x_{j+R/2} cos a + x_j sin a].
Dims R..D-1 pass through. The real model: theta 1e7, D 256, R 64. For text, interleaved MRoPE
uses the token index on all three axes, so it is exactly this 1-D form.

Angles are computed in fp64 and the rotation in fp32. (transformers computes the angles in fp32,
which at positions near 2.6e5 is off by up to ~1e-2 rad; near the start the two agree to ~1e-5.)
Dimensions: T tokens, H heads, D head dim, R rotary dims.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from fermijit import FermijitError
from fermijit.jit import omp
from fermijit.jit.checks import check_array, output
from fermijit.jit.cpu import kernel

# From this many elements of x (prefill) the angles come from tables cached per positions
# (_cpu_tables); a smaller call (decode: [1, 18, 256], 32 sin/cos pairs) computes its own.
TABLE_MIN_ELEMENTS = 1 << 16


def reference(x, positions, rotary_dim, theta):
    """x [T, H, D] fp32, positions int64 [T] -> y [T, H, D] fp32."""
    half = rotary_dim // 2
    inv = theta ** (-2.0 * np.arange(half) / rotary_dim)                 # [R/2]
    angle = positions.astype(np.float64)[:, None, None] * inv            # [T, 1, R/2]
    y = x.astype(np.float64)
    a, b = y[..., :half].copy(), y[..., half:rotary_dim].copy()          # [T, H, R/2]
    y[..., :half] = a * np.cos(angle) - b * np.sin(angle)
    y[..., half:rotary_dim] = b * np.cos(angle) + a * np.sin(angle)
    return y.astype(np.float32)


@functools.lru_cache(maxsize=None)
def _inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
    """inv_j [R/2] fp64, made once per (R, theta) so decode allocates nothing per token."""
    inv = theta ** (-2.0 * np.arange(rotary_dim // 2) / rotary_dim)
    inv.flags.writeable = False
    return inv


def _rope_tokens(x, positions, inv_freq, out, is_in_place):  # x, out [T, H, D]; inv_freq [R/2]
    n_tokens, n_heads, d = x.shape
    half = inv_freq.shape[0]
    for t in range(n_tokens):
        pos = np.float64(positions[t])
        for j in range(half):
            angle = pos * inv_freq[j]
            c = np.float32(math.cos(angle))
            s = np.float32(math.sin(angle))
            for h in range(n_heads):
                a = x[t, h, j]
                b = x[t, h, j + half]
                out[t, h, j] = a * c - b * s
                out[t, h, j + half] = b * c + a * s
        if not is_in_place:
            for h in range(n_heads):
                for i in range(2 * half, d):
                    out[t, h, i] = x[t, h, i]


_rope_serial = kernel(_rope_tokens)  # decode's (ops/attention_step.py)


@kernel
def _angles(positions, inv_freq, cos, sin):  # [T, R/2]: _rope_tokens' cos and sin
    for t in range(positions.size):
        pos = np.float64(positions[t])
        for j in range(inv_freq.shape[0]):
            angle = pos * inv_freq[j]
            cos[t, j] = np.float32(math.cos(angle))
            sin[t, j] = np.float32(math.sin(angle))


@functools.lru_cache(maxsize=2)
def _cpu_tables(positions: bytes, rotary_dim: int, theta: float):
    """cos and sin [T, R/2] for int64 `positions`, as _rope_tokens makes them. Cached: a prefill
    rotates q and k of every attention layer at the same positions, and the fp64 sin and cos
    (~40 ns a pair) cost more than the rotation (default model: 0.6 of 0.8 ms a 512-token pass)."""
    pos = np.frombuffer(positions, np.int64)
    cos, sin = (np.empty((pos.size, rotary_dim // 2), np.float32) for _ in range(2))
    _angles(pos, _inv_freq(rotary_dim, theta), cos, sin)
    cos.flags.writeable = sin.flags.writeable = False
    return cos, sin


@kernel
def _rotate_rows(x, cos, sin, out, is_in_place, first, last):  # x, out [T, H, D]; cos [T, R/2]
    n_heads, d = x.shape[1], x.shape[2]
    half = cos.shape[1]
    lo = np.empty(half, np.float32)
    hi = np.empty(half, np.float32)
    for t in range(first, last):
        c, s = cos[t], sin[t]
        for h in range(n_heads):
            src, dst = x[t, h], out[t, h]  # rows, a copy of the pairs first: vectorised loops
            for j in range(half):
                lo[j] = src[j]
                hi[j] = src[j + half]
            for j in range(half):
                dst[j] = lo[j] * c[j] - hi[j] * s[j]
                dst[j + half] = hi[j] * c[j] + lo[j] * s[j]
            for i in range(2 * half, d if not is_in_place else 0):
                dst[i] = src[i]


def _rotate_body(x, cos, sin, out, is_in_place):
    fork((x, cos, sin, out, is_in_place))


# Prefill's tokens over the threads (a 512-token pass: ~0.9 ms a layer on one thread).
_rotate = omp.forking_kernel(_rotate_body, fork=omp.rows_share(_rotate_rows, "rope"))


def _check_rotation(op: str, rotary_dim, theta, d: int) -> None:
    if not (isinstance(rotary_dim, (int, np.integer)) and 0 < rotary_dim <= d
            and rotary_dim % 2 == 0):
        raise FermijitError(f"{op}: rotary_dim must be even and in (0, {d}], got {rotary_dim!r}")
    if not (math.isfinite(theta) and theta > 0.0):
        raise FermijitError(f"{op}: theta must be positive and finite, got {theta!r}")


def cpu(x, positions, rotary_dim, theta, out=None):
    """x [T, H, D] fp32, positions int64 [T] -> y [T, H, D] fp32. `out=x` rotates in place."""
    op = "rope"
    check_array(op, "x", x, np.float32, ndim=3)
    n_tokens, _, d = x.shape
    check_array(op, "positions", positions, np.int64, (n_tokens,))
    _check_rotation(op, rotary_dim, theta, d)
    out = output(op, out, x.shape)
    is_in_place = out.ctypes.data == x.ctypes.data
    if not is_in_place and np.may_share_memory(out, x):
        raise FermijitError(f"{op}: out overlaps x without being x")
    if x.size < TABLE_MIN_ELEMENTS:
        _rope_serial(x, positions, _inv_freq(int(rotary_dim), float(theta)), out, is_in_place)
    else:
        cos, sin = _cpu_tables(positions.tobytes(), int(rotary_dim), float(theta))
        _rotate()(x, cos, sin, out, is_in_place)
    return out


# --- interleaved MRoPE: a prompt with images (MODEL.md §5.4) --------------------------------

def mrope_axes(rotary_dim: int, section) -> np.ndarray:
    """[R/2] the axis (0 T, 1 H, 2 W) whose position frequency j takes: H at j = 1, 4, ... below
    3·section[1], W at j = 2, 5, ... below 3·section[2], T elsewhere (transformers' interleave)."""
    axes = np.zeros(rotary_dim // 2, np.int64)
    for axis in (1, 2):
        axes[axis:3 * section[axis]:3] = axis
    return axes


def mrope_reference(x, positions, rotary_dim, theta, section):
    """x [T, H, D] fp32, positions int64 [3, T] (T, H, W rows) -> y [T, H, D] fp32."""
    half = rotary_dim // 2
    inv = theta ** (-2.0 * np.arange(half) / rotary_dim)
    per_freq = positions[mrope_axes(rotary_dim, section)].T                # [T, R/2]
    angle = per_freq.astype(np.float64)[:, None, :] * inv                  # [T, 1, R/2]
    y = x.astype(np.float64)
    a, b = y[..., :half].copy(), y[..., half:rotary_dim].copy()
    y[..., :half] = a * np.cos(angle) - b * np.sin(angle)
    y[..., half:rotary_dim] = b * np.cos(angle) + a * np.sin(angle)
    return y.astype(np.float32)


def mrope_cpu(x, positions, rotary_dim, theta, section, out=None):
    """As `mrope_reference`, angles in fp64 and the rotation in fp32 as `cpu` (numpy: it runs on
    the prefill of a prompt with images only). `out=x` rotates in place."""
    op = "mrope"
    check_array(op, "x", x, np.float32, ndim=3)
    n_tokens, _, d = x.shape
    check_array(op, "positions", positions, np.int64, (3, n_tokens))
    _check_rotation(op, rotary_dim, theta, d)
    if len(section) != 3 or min(section) < 0:
        raise FermijitError(f"{op}: mrope_section needs 3 counts, got {list(section)}")
    out = output(op, out, x.shape)
    half = rotary_dim // 2
    angle = positions[mrope_axes(rotary_dim, section)].T.astype(np.float64) * _inv_freq(
        int(rotary_dim), float(theta))
    c, s = (f(angle).astype(np.float32)[:, None, :] for f in (np.cos, np.sin))  # [T, 1, R/2]
    a, b = x[..., :half].copy(), x[..., half:rotary_dim].copy()
    out[..., :half] = a * c - b * s
    out[..., half:rotary_dim] = b * c + a * s
    if out is not x:
        out[..., rotary_dim:] = x[..., rotary_dim:]
    return out


# --- GPU (kernels_ptx/rope.ptx: one token per block; cos/sin made here in fp64, as `cpu`) ------

@functools.lru_cache(maxsize=8)
def _gpu_tables(positions: bytes, rotary_dim: int, theta: float):
    """cos and sin [T, R/2] on the device for int64 `positions`. Cached: a prefill rotates q and
    k of every attention layer at the same positions, and making the tables (cos and sin of
    T*R/2 fp64 angles, two copies in) costs more than the kernel."""
    from fermijit.jit import gpu as g

    angle = np.frombuffer(positions, np.int64).astype(np.float64)[:, None] * _inv_freq(
        rotary_dim, theta)
    return (g.to_device("rope", "cos", np.cos(angle).astype(np.float32), np.float32),
            g.to_device("rope", "sin", np.sin(angle).astype(np.float32), np.float32))


def gpu(x, positions, rotary_dim, theta, out=None):
    """As `cpu`; arrays numpy or on the device (fermijit.jit.gpu). The [T, R/2] cos/sin tables
    are made on the host from `_inv_freq` (so a device `positions` is copied back), copied in
    and cached (`_gpu_tables`). `out=x` rotates in place."""
    from fermijit.jit import gpu as g

    op = "rope"
    on_device = g.is_device(x) or g.is_device(out)
    g.check_array(op, "x", x, np.float32, ndim=3)
    n_tokens, n_heads, d = x.shape
    positions = positions.get() if g.is_device(positions) else positions
    check_array(op, "positions", positions, np.int64, (n_tokens,))
    _check_rotation(op, rotary_dim, theta, d)
    y = g.output(op, out, x.shape)
    if n_tokens:
        cos, sin = _gpu_tables(positions.tobytes(), int(rotary_dim), float(theta))
        g.kernel("rope")((min(n_tokens, g.FERMI_MAX_GRID[0]),), (256,),
                         g.to_device(op, "x", x, np.float32), cos, sin, y, n_tokens, n_heads, d,
                         int(rotary_dim) // 2)
    return g.result(op, y, out, on_device)
