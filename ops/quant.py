"""Q4_0 and Q8_0 block quantisation, GGML-compatible values and nibble order (DESIGN.md, On-disk).

Blocks of B = 32 values along the last axis, one fp16 scale d per block.
  Q4_0: d = v/-8 where v is the first value of largest magnitude; q = min(15, trunc(x/d + 8.5));
        x ~ (q - 8)·d. Byte j of a block holds q[j] in the low nibble and q[j+16] in the high.
  Q8_0: d = max|x|/127; q = roundf(x/d) (half away from zero); x ~ q·d.
Stored structure-of-arrays: `qs` [..., K/2] uint8 (Q4_0) or [..., K] int8 (Q8_0), `d` [..., K/B]
float16. The arithmetic is fp32, as in ggml's `quantize_row_q4_0_ref`, so the bytes match.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from fermijit import FermijitError
from fermijit.jit.checks import check_array
from fermijit.jit.cpu import kernel

BLOCK = 32  # values per block, Q4_0 and Q8_0
HALF = BLOCK // 2


def _blocks(op: str, x: np.ndarray) -> np.ndarray:
    """`x` [..., K] as fp32 [..., K/B, B]; K must be whole blocks."""
    if x.shape[-1] % BLOCK:
        raise FermijitError(f"{op}: last axis {x.shape[-1]} is not a multiple of {BLOCK}")
    return np.asarray(x, dtype=np.float32).reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def _reciprocal(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)


def quantize_q4_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., K] -> (qs uint8 [..., K/2], d float16 [..., K/B])."""
    xb = _blocks("quantize_q4_0", x)                                   # [..., nb, B]
    at = np.argmax(np.abs(xb), axis=-1)[..., None]                      # first largest |x|
    d = (np.take_along_axis(xb, at, axis=-1)[..., 0] / np.float32(-8)).astype(np.float32)
    q = (xb * _reciprocal(d)[..., None] + np.float32(8.5)).astype(np.int8)  # trunc, as C
    q = np.minimum(q, 15).astype(np.uint8)
    qs = q[..., :HALF] | (q[..., HALF:] << 4)                           # [..., nb, 16]
    return qs.reshape(*x.shape[:-1], x.shape[-1] // 2), d.astype(np.float16)


def dequantize_q4_0(qs: np.ndarray, d: np.ndarray) -> np.ndarray:
    """(qs [..., K/2], d [..., K/B]) -> fp32 [..., K]."""
    nb = d.shape[-1]
    q = qs.reshape(*qs.shape[:-1], nb, HALF)
    vals = np.concatenate([q & 0x0F, q >> 4], axis=-1).astype(np.float32) - 8  # [..., nb, B]
    return (vals * d.astype(np.float32)[..., None]).reshape(*qs.shape[:-1], nb * BLOCK)


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C roundf, exactly: trunc plus one where the fraction is at least one half."""
    t = np.trunc(v)
    return t + np.where(np.abs(v - t) >= 0.5, np.sign(v), 0).astype(np.float32)


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., K] -> (qs int8 [..., K], d float16 [..., K/B])."""
    xb = _blocks("quantize_q8_0", x)
    d = (np.max(np.abs(xb), axis=-1) / np.float32(127)).astype(np.float32)
    q = _round_half_away(xb * _reciprocal(d)[..., None]).astype(np.int8)
    return q.reshape(x.shape), d.astype(np.float16)


def dequantize_q8_0(qs: np.ndarray, d: np.ndarray) -> np.ndarray:
    nb = d.shape[-1]
    q = qs.reshape(*qs.shape[:-1], nb, BLOCK).astype(np.float32)
    return (q * d.astype(np.float32)[..., None]).reshape(qs.shape)


# --- fast conversion (the converter quantises 35 B parameters) ----------------------------------

# No fast-math: contracting x*inv + 8.5 into an FMA would change rounding and so the bytes.
@kernel(parallel=True, fastmath=False)
def _quantize_q4_0_rows(x, qs, d):
    rows, nb = d.shape
    for r in prange(rows):
        for b in range(nb):
            base = b * 32
            amax = np.float32(0.0)
            vmax = np.float32(0.0)
            for j in range(32):
                v = x[r, base + j]
                if abs(v) > amax:
                    amax = abs(v)
                    vmax = v
            db = vmax / np.float32(-8.0)
            inv = np.float32(1.0) / db if db != 0 else np.float32(0.0)
            d[r, b] = db
            for j in range(16):
                lo = min(15, np.int32(x[r, base + j] * inv + np.float32(8.5)))
                hi = min(15, np.int32(x[r, base + 16 + j] * inv + np.float32(8.5)))
                qs[r, b * 16 + j] = np.uint8(lo | (hi << 4))


def quantize_q4_0_cpu(x: np.ndarray, out: tuple[np.ndarray, np.ndarray] | None = None):
    """quantize_q4_0 in Numba, parallel over rows; x [..., K] fp32. Same bytes as the reference."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % BLOCK:
        raise FermijitError(f"quantize_q4_0: last axis of shape {list(x.shape)} is not whole "
                            f"{BLOCK}-blocks")
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if out is None:
        qs, d = np.empty(x.shape[:-1] + (k // 2,), np.uint8), None
    else:
        qs, d = out
        check_array("quantize_q4_0", "qs", qs, np.uint8, x.shape[:-1] + (k // 2,))
        check_array("quantize_q4_0", "d", d, np.float16, x.shape[:-1] + (k // BLOCK,))
    d32 = np.empty((x2.shape[0], k // BLOCK), np.float32)  # fp32 inside Numba (no float16)
    _quantize_q4_0_rows(x2, qs.reshape(-1, k // 2), d32)
    d16 = d32.astype(np.float16).reshape(x.shape[:-1] + (k // BLOCK,))
    if d is None:
        return qs, d16
    d[...] = d16
    return qs, d
