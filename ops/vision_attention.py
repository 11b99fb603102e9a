"""The vision tower's attention sublayer between its two linears (MODEL.md §7): the heads of
qkv, the 2-D rotary on q and k, bidirectional softmax attention within the image, the heads
merged.

    q, k, v = split(qkv [N, 3·Hd·d]);  q, k = rope(q), rope(k)   (x·cos + rotate_half(x)·sin)
    o_h = softmax(q_h k_hᵀ / √d) v_h                                per head, all N keys
    out [N, Hd·d] = concat_h o_h

Dimensions: N patches of one image, Hd heads (16), d head dim (72); cos, sin [N, d] fp32 (from
model/vision.py rotary_tables). Queries go in blocks of at most MAX_SCORES / N rows, so the
scores stay bounded (a 4096² image has 65536 patches: 17 GB of scores per head at once).
"""

from __future__ import annotations

import numpy as np

from fermijit import FermijitError
from fermijit.jit.checks import check_array

MAX_SCORES = 1 << 24  # fp32 scores per query block: 64 MiB


def rotate(x, cos, sin):
    """x [N, Hd, d] -> x·cos + rotate_half(x)·sin (fp32), cos/sin [N, d]."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def _split(qkv, heads):
    n = qkv.shape[0]
    parts = qkv.reshape(n, 3, heads, -1)
    return parts[:, 0], parts[:, 1], parts[:, 2]


def reference(qkv, cos, sin, heads: int):
    """qkv [N, 3·Hd·d] fp32 -> [N, Hd·d] fp32, in fp64 after the rotation."""
    q, k, v = _split(qkv, heads)
    q, k = rotate(q, cos, sin).astype(np.float64), rotate(k, cos, sin).astype(np.float64)
    s = np.einsum("nhd,mhd->hnm", q, k) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    o = np.einsum("hnm,mhd->nhd", p, v.astype(np.float64))
    return o.reshape(qkv.shape[0], -1).astype(np.float32)


def _check(op, qkv, cos, sin, heads, check):
    check(op, "qkv", qkv, np.float32, ndim=2)
    n, width = qkv.shape
    if heads < 1 or width % (3 * heads) or (width // (3 * heads)) % 2:
        raise FermijitError(f"{op}: qkv width {width} is not 3 x {heads} heads of an even dim")
    d = width // (3 * heads)
    check_array(op, "cos", cos, np.float32, (n, d))
    check_array(op, "sin", sin, np.float32, (n, d))
    return n, d


def cpu(qkv, cos, sin, heads: int):
    """As `reference`: numpy fp32, one head and one block of queries at a time."""
    n, d = _check("vision_attention", qkv, cos, sin, heads, check_array)
    q, k, v = _split(qkv, heads)
    # heads first, contiguous: a strided [N, d] operand took numpy's slow matmul path (5 GFLOP/s)
    q, k = (np.ascontiguousarray(rotate(a, cos, sin).transpose(1, 0, 2)) for a in (q, k))
    v = np.ascontiguousarray(v.transpose(1, 0, 2))
    q *= np.float32(d ** -0.5)
    out = np.empty((heads, n, d), np.float32)
    rows = max(1, MAX_SCORES // n)
    for h in range(heads):
        for r0 in range(0, n, rows):
            s = q[h, r0:r0 + rows] @ k[h].T
            s -= s.max(axis=1, keepdims=True)
            np.exp(s, out=s)
            s /= s.sum(axis=1, keepdims=True)
            np.matmul(s, v[h], out=out[h, r0:r0 + rows])
    return np.ascontiguousarray(out.transpose(1, 0, 2)).reshape(n, heads * d)


def gpu(qkv, cos, sin, heads: int, out=None):
    """As `reference` on the GPU (kernels_ptx/vision_attn.ptx around f32_gemm.ptx); qkv numpy or
    on the device."""
    from fermijit.jit import gpu as g

    op = "vision_attention"
    on_device = g.is_device(qkv) or g.is_device(out)
    n, d = _check(op, qkv, cos, sin, heads, g.check_array)
    qkv = g.to_device(op, "qkv", qkv, np.float32)
    y = g.output(op, out, (n, heads * d))
    if n == 0:
        return g.result(op, y, out, on_device)
    q, k, o = (g.empty((heads, n, d)) for _ in range(3))
    vt = g.empty((heads, d, n))
    total = n * heads * d
    grid = (min(-(-total // 256), g.FERMI_MAX_GRID[0]),)
    g.kernel("vision_attn", "vision_split_rope")(
        grid, (256,), qkv, g.to_device(op, "cos", cos, np.float32),
        g.to_device(op, "sin", sin, np.float32), q, k, vt, n, heads, d, d ** -0.5)
    rows = max(16, min(n, MAX_SCORES // n))
    scores = g.empty((rows, n))
    gemm = g.kernel("f32_gemm", MODE="plain")
    softmax = g.kernel("vision_attn", "vision_softmax")
    f = 4  # bytes per fp32
    for h in range(heads):
        for r0 in range(0, n, rows):
            m = min(rows, n - r0)
            q_rows = int(q.gpudata) + (h * n + r0) * d * f
            gemm((-(-n // 16), -(-m // 16)), (256,), q_rows, int(k.gpudata) + h * n * d * f,
                 scores, None, None, None, m, n, d, 0)                       # q kᵀ [m, n]
            softmax((min(m, g.FERMI_MAX_GRID[0]),), (256,), scores, m, n)
            gemm((-(-d // 16), -(-m // 16)), (256,), scores, int(vt.gpudata) + h * d * n * f,
                 int(o.gpudata) + (h * n + r0) * d * f, None, None, None, m, d, n, 0)  # p v
    g.kernel("vision_attn", "vision_merge_heads")(grid, (256,), o, y, n, heads, d)
    return g.result(op, y, out, on_device)
