"""llama.cpp's K-quants (Q4_K, Q5_K, Q6_K) and the 5-bit 32-blocks (Q5_0, Q5_1) as GGUF stores
them, and the activations their dot products take: the numpy references (the spec).

Weights are kept as the GGUF's blocks, bit for bit: `blocks` uint8 [..., K/Q·S] for Q values per
block of S bytes (FORMATS). Dequantisation is llama.cpp's `dequantize_row_*` (ggml-quants.c), in
fp32 in the same order (d·sc first, then ·q, then − dmin·m; no fused multiply-add), which the
`gguf` package's numpy dequantisers also follow (tests/ops/test_kquant.py checks both agree).

  Q4_K (256 values, 144 B): d, dmin fp16; 12 bytes of eight 6-bit scales sc and mins m
       (get_scale_min_k4); 128 bytes of nibbles: 64-value chunk c holds sub-block 2c in the low
       nibbles of bytes 32c..32c+31 and sub-block 2c+1 in their high nibbles.
       x = d·sc_j·q − dmin·m_j, q in 0..15, sub-blocks j of 32.
  Q5_K (256, 176): as Q4_K, plus qh[32]: bit 2c of qh[l] is the fifth bit of value 64c + l,
       bit 2c+1 that of 64c + 32 + l. q in 0..31.
  Q6_K (256, 210): ql[128], qh[64], int8 scales[16], d fp16. For each 128-value half n, l < 32:
       values l, l+32, l+64, l+96 are the low nibbles of ql[l], ql[l+32], the high nibbles of
       ql[l], ql[l+32], each with two bits of qh[l] (bits 0-1, 2-3, 4-5, 6-7) on top; q − 32,
       times d·scales[16-value group].
  Q5_0 (32, 22): d fp16, qh u32, qs[16]: x = d·(q − 16), q = nibble | bit j of qh << 4 (value
       j < 16 the low nibble of qs[j], value j + 16 its high nibble and bit j + 16).
  Q5_1 (32, 24): d, m fp16, qh, qs[16]: x = d·q + m.

Activations (DESIGN.md, Numerics: what each format's dot product wants, as llama.cpp's
`vec_dot_type`): the K-quants take Q8_K, one fp32 scale per 256 values and the sums of each 16
(the mins' term and Q6_K's offset from them); Q5_0 takes Q8_0 and Q5_1 Q8_1, i.e. fermijit's
32-block activations (ops/matvec.py quantize_act) with their sums. Q8_K is llama.cpp's
`quantize_row_q8_K_ref` exactly (its x86 path calls it): the first value of largest magnitude
max, iscale = −127/max, q = min(127, nearest_int(iscale·x)) (ties to even), d = 1/iscale; so the
integer sums of a K-quant product are llama.cpp's, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fermijit import FermijitError

QK_K = 256   # values per K-quant super-block
Q8K_GROUP = 16  # values per Q8_K sum


@dataclass(frozen=True)
class Format:
    name: str           # fermijit's quant kind, as the manifest says it
    block_values: int
    block_bytes: int
    scale_offsets: tuple[int, ...]  # byte offsets of the block's fp16 scales (d, dmin / m)

    def n_bytes(self, k: int) -> int:
        """Bytes of a row of k values (k whole blocks)."""
        if k % self.block_values:
            raise FermijitError(f"a {self.name} row of {k} values is not whole "
                                f"{self.block_values}-blocks")
        return k // self.block_values * self.block_bytes


Q4_K = Format("q4_k", QK_K, 144, (0, 2))
Q5_K = Format("q5_k", QK_K, 176, (0, 2))
Q6_K = Format("q6_k", QK_K, 210, (208,))
Q5_0 = Format("q5_0", 32, 22, (0,))
Q5_1 = Format("q5_1", 32, 24, (0, 2))
FORMATS = {f.name: f for f in (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1)}
# GGML's type ids (ggml.h enum ggml_type) of each, for the GGUF import.
GGML_TYPE = {"q5_0": 6, "q5_1": 7, "q4_k": 12, "q5_k": 13, "q6_k": 14}


def block_view(fmt: Format, blocks: np.ndarray) -> np.ndarray:
    """uint8 [..., K/Q·S] -> [..., K/Q, S]."""
    blocks = np.asarray(blocks)
    if blocks.dtype != np.uint8 or blocks.shape[-1] % fmt.block_bytes:
        raise FermijitError(f"{fmt.name}: blocks must be uint8 rows of whole "
                            f"{fmt.block_bytes}-byte blocks, got {blocks.dtype} "
                            f"{list(blocks.shape)}")
    return blocks.reshape(*blocks.shape[:-1], blocks.shape[-1] // fmt.block_bytes,
                          fmt.block_bytes)


def scales_f16(fmt: Format, blocks: np.ndarray) -> np.ndarray:
    """float16 [..., K/Q, n]: each block's fp16 scales (what must be finite)."""
    b = block_view(fmt, blocks)
    return np.stack([np.ascontiguousarray(b[..., o:o + 2]).view(np.float16)[..., 0]
                     for o in fmt.scale_offsets], axis=-1)


def _f16(b: np.ndarray, offset: int) -> np.ndarray:
    return np.ascontiguousarray(b[..., offset:offset + 2]).view(np.float16)[..., 0].astype(
        np.float32)


def scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 packed bytes [..., 12] -> (sc, m) uint8 [..., 8] (get_scale_min_k4)."""
    q = scales.astype(np.uint8)
    sc = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)], -1)
    m = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], -1)
    return sc, m


def quants(fmt: Format, blocks: np.ndarray) -> np.ndarray:
    """The integer values q of every weight, int32 [..., K], before the offset/min: Q4_K 0..15,
    Q5_K 0..31, Q6_K 0..63 (x = d·sc·(q − 32)), Q5_0 and Q5_1 0..31."""
    b = block_view(fmt, blocks)
    lead = b.shape[:-1]
    if fmt in (Q4_K, Q5_K):
        qs = b[..., -128:].reshape(*lead, 4, 32)
        q = np.stack([qs & 0xF, qs >> 4], axis=-2).astype(np.int32)        # [..., 4, 2, 32]
        if fmt is Q5_K:
            qh = b[..., 16:48]                                             # [..., 32]
            bit = np.arange(8).reshape(4, 2, 1)
            q |= ((qh[..., None, None, :] >> bit) & 1).astype(np.int32) << 4
        return q.reshape(*lead[:-1], lead[-1] * QK_K)
    if fmt is Q6_K:
        ql = b[..., :128].reshape(*lead, 2, 2, 32)                          # [n, ql half, l]
        qh = b[..., 128:192].reshape(*lead, 2, 1, 32)
        lo = np.stack([ql & 0xF, ql >> 4], axis=-3)                        # [.., nib, half, l]
        shift = (2 * np.arange(4)).reshape(2, 2, 1)                        # [nib, half] order
        hi = (qh[..., None, :, :] >> shift) & 3
        q = (lo | (hi << 4)).astype(np.int32)                               # values l + 32·(2nib+half)
        return q.reshape(*lead[:-1], lead[-1] * QK_K)
    qh = np.ascontiguousarray(b[..., 2 * len(fmt.scale_offsets):][..., :4]).view(np.uint32)
    qs = b[..., -16:]
    bits = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int32)   # [..., 32]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.int32) | (bits << 4)
    return q.reshape(*lead[:-1], lead[-1] * 32)


def group_scales(fmt: Format, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(scale, min) of every group of values, as the dot product applies them, fp32:
    Q4_K/Q5_K per 32 (d·sc, dmin·m), Q6_K per 16 (d·sc, None), Q5_0 per 32 (d, None: q − 16
    is taken in `quants`' offset), Q5_1 per 32 (d, m)."""
    b = block_view(fmt, blocks)
    d = _f16(b, fmt.scale_offsets[0])[..., None]
    if fmt in (Q4_K, Q5_K):
        sc, m = scale_min_k4(b[..., 4:16])
        return ((d * sc.astype(np.float32)).reshape(*b.shape[:-2], -1),
                (_f16(b, 2)[..., None] * m.astype(np.float32)).reshape(*b.shape[:-2], -1))
    if fmt is Q6_K:
        sc = b[..., 192:208].view(np.int8).astype(np.float32)
        return (d * sc).reshape(*b.shape[:-2], -1), None
    if fmt is Q5_0:
        return d.reshape(*b.shape[:-2], -1), None
    return d.reshape(*b.shape[:-2], -1), _f16(b, 2).reshape(*b.shape[:-2], -1)


OFFSET = {"q4_k": 0, "q5_k": 0, "q6_k": 32, "q5_0": 16, "q5_1": 0}
GROUP = {"q4_k": 32, "q5_k": 32, "q6_k": 16, "q5_0": 32, "q5_1": 32}


def dequantize(fmt: Format, blocks: np.ndarray) -> np.ndarray:
    """fp32 [..., K], as llama.cpp's dequantize_row_<fmt>."""
    q = quants(fmt, blocks)
    scale, low = group_scales(fmt, blocks)
    g = GROUP[fmt.name]
    qg = (q - OFFSET[fmt.name]).astype(np.float32).reshape(*q.shape[:-1], -1, g)
    x = scale[..., None] * qg
    if low is not None:
        x = x - low[..., None] if fmt in (Q4_K, Q5_K) else x + low[..., None]
    return x.reshape(q.shape)


# --- activations --------------------------------------------------------------------------------

def nearest_int(v: np.ndarray) -> np.ndarray:
    """llama.cpp's nearest_int: fp32 rounding to the nearest integer, ties to even."""
    return np.rint(v.astype(np.float32)).astype(np.int32)


def quantize_q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [T, K] -> (q int8 [T, K], d float32 [T, K/256], bsums int32 [T, K/16]): llama.cpp's
    quantize_row_q8_K_ref, bit for bit."""
    x = np.asarray(x, dtype=np.float32)
    n_tok, k = x.shape
    if k % QK_K:
        raise FermijitError(f"Q8_K: {k} values are not whole {QK_K}-blocks")
    xb = x.reshape(n_tok, k // QK_K, QK_K)
    at = np.argmax(np.abs(xb), axis=-1)[..., None]                       # first largest |x|
    mx = np.take_along_axis(xb, at, axis=-1)                             # [T, nb, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(mx != 0, np.float32(-127) / mx, np.float32(0)).astype(np.float32)
        d = np.where(mx != 0, np.float32(1) / iscale, np.float32(0)).astype(np.float32)
    q = np.minimum(nearest_int(iscale * xb), 127).astype(np.int8)
    bsums = q.reshape(n_tok, -1, Q8K_GROUP).astype(np.int32).sum(axis=-1)
    return q.reshape(n_tok, k), d[..., 0], bsums


def reference(fmt: Format, blocks: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y [T, R] (or [R] for x [K]) = W · x: the integer sums of each group of quants with the
    activations (Q8_K for the K-quants, Q8_0 for Q5_0/Q5_1, as ops/matvec.py rounds them), each
    scaled in float64 by its group's scale and the activation block's; the mins (Q4_K, Q5_K,
    Q5_1) times the activations' group sums. Exact but for float64 rounding."""
    from fermijit.ops.matvec import quantize_act_reference

    x2 = np.atleast_2d(np.asarray(x, dtype=np.float32))
    n_tok, k = x2.shape
    q = quants(fmt, blocks).astype(np.int64) - OFFSET[fmt.name]                # [R, K]
    scale, low = group_scales(fmt, blocks)                                     # [R, K/g]
    g = GROUP[fmt.name]
    if fmt.block_values == QK_K:
        xq, dx, _ = quantize_q8_k(x2)
        dx_g = np.repeat(dx.astype(np.float64), QK_K // g, axis=1)             # [T, K/g]
        xq = xq.astype(np.int64)
    else:
        xq3, dx = quantize_act_reference(x2)
        xq, dx_g = xq3.reshape(n_tok, k).astype(np.int64), dx.astype(np.float64)
    rows = q.shape[0]
    isum = np.einsum("rgj,tgj->trg", q.reshape(rows, -1, g), xq.reshape(n_tok, -1, g))
    y = np.einsum("trg,rg,tg->tr", isum.astype(np.float64), scale.astype(np.float64), dx_g)
    if low is not None:
        xsum = xq.reshape(n_tok, -1, g).sum(axis=-1).astype(np.float64)          # [T, K/g]
        m = np.einsum("rg,tg->tr", low.astype(np.float64), xsum * dx_g)
        y = y - m if fmt in (Q4_K, Q5_K) else y + m
    return y[0] if np.ndim(x) == 1 else y
