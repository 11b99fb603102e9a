"""llama.cpp's reference quantisers of the block kinds (ops/kquant.py FORMATS), for `convert
--quant q4_k_m` (model/quant_mix.py): the bytes of `quantize_row_q4_K_ref`, `_q5_K_ref`,
`_q6_K_ref`, `_q5_0_ref` and `_q5_1_ref` (ggml-quants.c; what `llama-quantize` writes without an
importance matrix), so a mix written here is the file llama.cpp would write from the same floats.

  Q4_K / Q5_K: per 32-value sub-block, weights w = sqrt(mean x²) + |x|, and the scale and min
       that minimise Σ w·(s·q + m − x)² found by `make_qkx2_quants` (a first guess from max − min,
       then nstep + 1 trial scales (rmin + rdelta·is + nmax)/(max − min), each with its
       least-squares s, m; the best kept); the 8 scales and mins per 256 in 6 bits against
       d = max scale/63, dmin = max min/63 (fp16); then q = round((x + dmin·m)/(d·sc)).
  Q6_K: per 16-value group, `make_qx_quants` (rmse_type 1: weights x², trial scales
       −(32 + 0.1·is)/max for is = −9..9), the 16 scales in int8 against d = max|scale|/128
       (the signed largest maps to −128); then q = round(x/(d·sc)) + 32.
  Q5_0: d = v/−16 (v the first value of largest magnitude), q = min(31, trunc(x/d + 16.5)).
  Q5_1: d = (max − min)/31, m = min, q = trunc((x − m)/d + 0.5).

All of it in fp32 in llama.cpp's order of operations (its sums sequential, no fused
multiply-adds: libggml-base is built without them, 0 vfmadd in its objdump), rounding as its
`nearest_int` (to nearest, ties to even). The searches are the costly part (~20 trials of two
passes per 32 values): `quantize` runs them in numpy, vectorised over groups and sequential over
a group's values (the spec); `quantize_cpu` in a parallel Numba kernel per group, the same
arithmetic, for the 35 B weights of a real model. Everything around them is numpy in both.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from fermijit import FermijitError
from fermijit.jit.cpu import kernel
from fermijit.ops.kquant import Q4_K, Q5_0, Q5_K, Q6_K, Format

F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)  # ggml-quants.c: a group this small is all zeros
# make_qkx2_quants' trial scales (rmin, rdelta, nstep) and top quant, per format.
QKX2 = {"q4_k": (15, -1.0, 0.1, 20), "q5_k": (31, -0.5, 0.1, 15)}
Q6_NMAX = 32


def _rint(v: np.ndarray) -> np.ndarray:
    """nearest_int: fp32 to the nearest integer, ties to even (int32)."""
    return np.rint(v).astype(np.int32)


# --- the searches: numpy reference ---------------------------------------------------------------

def make_qkx2_quants(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float,
                     nstep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of x, w (fp32 [G, n]): (q uint8 [G, n], scale fp32 [G], the_min fp32 [G]) with
    x ~ scale·q − the_min, as ggml-quants.c make_qkx2_quants (use_mad false)."""
    n = x.shape[1]
    lo, hi = x.min(axis=1), x.max(axis=1)
    sum_w, sum_x = w[:, 0].copy(), w[:, 0] * x[:, 0]
    for i in range(1, n):
        sum_w = sum_w + w[:, i]
        sum_x = sum_x + w[:, i] * x[:, i]
    lo = np.where(lo > 0, F32(0), lo)
    flat, flat_min = hi == lo, -lo
    lo = np.where(flat, hi - 1, lo)                         # flat groups: set aside below

    def trial(iscale):
        return np.clip(_rint(iscale[:, None] * (x - lo[:, None])), 0, nmax)

    def error(scale, low, q):
        err = np.zeros_like(scale)
        for i in range(n):
            diff = scale * q[:, i].astype(F32) + low - x[:, i]
            err = err + w[:, i] * (diff * diff)
        return err

    iscale = F32(nmax) / (hi - lo)
    scale = F32(1) / iscale
    q = trial(iscale)
    best = error(scale, lo, q)
    for step in range(nstep + 1):
        # the min found so far is the next trials' origin (C updates `min` in the loop)
        iscale = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / (hi - lo)
        aux = trial(iscale)
        sum_l = sum_l2 = sum_xl = np.zeros_like(scale)
        for i in range(n):
            l = aux[:, i].astype(F32)
            sum_l = sum_l + w[:, i] * l
            sum_l2 = sum_l2 + w[:, i] * l * l
            sum_xl = sum_xl + w[:, i] * l * x[:, i]
        D = sum_w * sum_l2 - sum_l * sum_l
        with np.errstate(divide="ignore", invalid="ignore"):
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            above = this_min > 0
            this_min = np.where(above, F32(0), this_min)
            this_scale = np.where(above, sum_xl / sum_l2, this_scale)
        cur = error(this_scale, this_min, aux)
        better = (D > 0) & (cur < best)
        q = np.where(better[:, None], aux, q)
        best = np.where(better, cur, best)
        scale = np.where(better, this_scale, scale)
        lo = np.where(better, this_min, lo)
    q = np.where(flat[:, None], 0, q).astype(np.uint8)
    return (q, np.where(flat, F32(0), scale).astype(F32),
            np.where(flat, flat_min, -lo).astype(F32))


def make_qx_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of x (fp32 [G, n]): (q uint8 [G, n] in 0..2·nmax−1, scale fp32 [G]) with
    x ~ scale·(q − nmax), as ggml-quants.c make_qx_quants with rmse_type 1 (weights x²)."""
    n = x.shape[1]
    at = np.argmax(np.abs(x), axis=1)[:, None]                  # the first largest |x|
    vmax = np.take_along_axis(x, at, axis=1)[:, 0]
    zero = np.abs(vmax) < GROUP_MAX_EPS
    vmax = np.where(zero, F32(1), vmax)
    w = x * x

    def sums(iscale):
        l = np.clip(_rint(iscale[:, None] * x), -nmax, nmax - 1)
        sumlx = suml2 = np.zeros_like(vmax)
        for i in range(n):
            li = l[:, i].astype(F32)
            sumlx = sumlx + w[:, i] * x[:, i] * li
            suml2 = suml2 + w[:, i] * li * li
        return l + nmax, sumlx, suml2

    q, sumlx, suml2 = sums(F32(-nmax) / vmax)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
        best = scale * sumlx
        for step in range(-9, 10):
            if step == 0:
                continue
            aux, sumlx, suml2 = sums(-(F32(nmax) + F32(0.1) * F32(step)) / vmax)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            q = np.where(better[:, None], aux, q)
            scale = np.where(better, sumlx / suml2, scale)
            best = np.where(better, scale * sumlx, best)
    q = np.where(zero[:, None], 0, q).astype(np.uint8)
    return q, np.where(zero, F32(0), scale).astype(F32)


# --- the searches: Numba, one group at a time (the same arithmetic, in C's loop form) -------------

# No fast-math: a contracted multiply-add or a reassociated sum would change the chosen quants.
@kernel(parallel=True, fastmath=False)
def _qkx2_groups(x, w, nmax, rmin, rdelta, nstep, q, scales, mins):
    n_groups, n = x.shape
    for g in prange(n_groups):
        aux = np.empty(n, np.uint8)
        lo = x[g, 0]
        hi = x[g, 0]
        sum_w = w[g, 0]
        sum_x = sum_w * x[g, 0]
        for i in range(1, n):
            lo = min(lo, x[g, i])
            hi = max(hi, x[g, i])
            sum_w += w[g, i]
            sum_x += w[g, i] * x[g, i]
        if lo > 0:
            lo = np.float32(0)
        if hi == lo:
            for i in range(n):
                q[g, i] = 0
            scales[g] = np.float32(0)
            mins[g] = -lo
            continue
        iscale = np.float32(nmax) / (hi - lo)
        scale = np.float32(1) / iscale
        best = np.float32(0)
        for i in range(n):
            l = np.int32(np.rint(iscale * (x[g, i] - lo)))
            q[g, i] = max(0, min(nmax, l))
            diff = scale * np.float32(q[g, i]) + lo - x[g, i]
            best += w[g, i] * (diff * diff)
        for step in range(nstep + 1):
            iscale = (rmin + rdelta * np.float32(step) + np.float32(nmax)) / (hi - lo)
            sum_l = np.float32(0)
            sum_l2 = np.float32(0)
            sum_xl = np.float32(0)
            for i in range(n):
                l = max(0, min(nmax, np.int32(np.rint(iscale * (x[g, i] - lo)))))
                aux[i] = l
                lf = np.float32(l)
                sum_l += w[g, i] * lf
                sum_l2 += w[g, i] * lf * lf
                sum_xl += w[g, i] * lf * x[g, i]
            D = sum_w * sum_l2 - sum_l * sum_l
            if D > 0:
                this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
                this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
                if this_min > 0:
                    this_min = np.float32(0)
                    this_scale = sum_xl / sum_l2
                cur = np.float32(0)
                for i in range(n):
                    diff = this_scale * np.float32(aux[i]) + this_min - x[g, i]
                    cur += w[g, i] * (diff * diff)
                if cur < best:
                    for i in range(n):
                        q[g, i] = aux[i]
                    best = cur
                    scale = this_scale
                    lo = this_min
        scales[g] = scale
        mins[g] = -lo


@kernel(parallel=True, fastmath=False)
def _qx_groups(x, nmax, q, scales):
    n_groups, n = x.shape
    for g in prange(n_groups):
        vmax = np.float32(0)
        amax = np.float32(0)
        for i in range(n):
            if abs(x[g, i]) > amax:
                amax = abs(x[g, i])
                vmax = x[g, i]
        if amax < np.float32(1e-15):
            for i in range(n):
                q[g, i] = 0
            scales[g] = np.float32(0)
            continue
        best = np.float32(0)
        scale = np.float32(0)
        for step in range(-10, 10):  # -10: the first guess, −nmax/max; then is = −9..9 but 0
            if step == 0:
                continue
            if step == -10:
                iscale = np.float32(-nmax) / vmax
            else:
                iscale = -(np.float32(nmax) + np.float32(0.1) * np.float32(step)) / vmax
            sumlx = np.float32(0)
            suml2 = np.float32(0)
            for i in range(n):
                lf = np.float32(max(-nmax, min(nmax - 1, np.int32(np.rint(iscale * x[g, i])))))
                sumlx += x[g, i] * x[g, i] * x[g, i] * lf
                suml2 += x[g, i] * x[g, i] * lf * lf
            if step == -10:
                scale = sumlx / suml2 if suml2 != 0 else np.float32(0)
                best = scale * sumlx
            elif not (suml2 > 0 and sumlx * sumlx > best * suml2):
                continue
            else:
                scale = sumlx / suml2
                best = scale * sumlx
            for i in range(n):
                q[g, i] = nmax + max(-nmax, min(nmax - 1, np.int32(np.rint(iscale * x[g, i]))))
        scales[g] = scale


def _qkx2_cpu(x, w, nmax, rmin, rdelta, nstep):
    q = np.empty(x.shape, np.uint8)
    scales, mins = np.empty(x.shape[0], F32), np.empty(x.shape[0], F32)
    _qkx2_groups(x, w, nmax, F32(rmin), F32(rdelta), nstep, q, scales, mins)
    return q, scales, mins


def _qx_cpu(x, nmax):
    q, scales = np.empty(x.shape, np.uint8), np.empty(x.shape[0], F32)
    _qx_groups(x, nmax, q, scales)
    return q, scales


# --- the formats ---------------------------------------------------------------------------------

def _f16_bytes(v: np.ndarray) -> np.ndarray:
    """fp32 [...] -> fp16 bytes uint8 [..., 2] (GGML_FP32_TO_FP16: to nearest, ties to even)."""
    return v.astype(np.float16).view(np.uint8).reshape(*v.shape, 2)


def _q4_k_like(fmt: Format, xb: np.ndarray, qkx2) -> np.ndarray:
    """Q4_K / Q5_K blocks [B, S] of super-blocks xb [B, 256]."""
    nmax, rmin, rdelta, nstep = QKX2[fmt.name]
    n_blocks = xb.shape[0]
    xs = xb.reshape(n_blocks * 8, 32)
    sum_x2 = np.zeros(xs.shape[0], F32)
    for i in range(32):
        sum_x2 = sum_x2 + xs[:, i] * xs[:, i]
    w = np.sqrt(sum_x2 / F32(32))[:, None] + np.abs(xs)
    q, scale, the_min = qkx2(xs, w, nmax, rmin, rdelta, nstep)
    scale, the_min = scale.reshape(n_blocks, 8), the_min.reshape(n_blocks, 8)
    max_scale = np.maximum(scale.max(axis=1), F32(0))
    max_min = np.maximum(the_min.max(axis=1), F32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0))
        inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0))
    sc = np.minimum(_rint(inv_scale[:, None] * scale) & 0xFF, 63).astype(np.uint8)   # [B, 8]
    m = np.minimum(_rint(inv_min[:, None] * the_min) & 0xFF, 63).astype(np.uint8)
    d16, dmin16 = (max_scale / F32(63)).astype(np.float16), (max_min / F32(63)).astype(np.float16)
    d = d16.astype(F32)[:, None] * sc.astype(F32)                                      # [B, 8]
    dm = dmin16.astype(F32)[:, None] * m.astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        again = np.clip(_rint((xb.reshape(n_blocks, 8, 32) + dm[..., None]) / d[..., None]),
                        0, nmax)
    q = np.where(d[..., None] != 0, again, q.reshape(n_blocks, 8, 32)).astype(np.uint8)
    q = q.reshape(n_blocks, 4, 2, 32)                        # [chunk of 64, low/high half, l]
    out = np.zeros((n_blocks, fmt.block_bytes), np.uint8)
    out[:, 0:2], out[:, 2:4] = _f16_bytes(d16.astype(F32)), _f16_bytes(dmin16.astype(F32))
    packed = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
                             m[:, :4] | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)], axis=1)
    out[:, 4:16] = packed
    nib = q & 0xF
    out[:, -128:] = (nib[:, :, 0] | (nib[:, :, 1] << 4)).reshape(n_blocks, 128)
    if fmt is Q5_K:  # bit 2c of qh[l]: value 64c + l's fifth bit; bit 2c + 1: value 64c + 32 + l
        bits = (q >> 4).astype(np.uint8) << (2 * np.arange(4)[:, None] + np.arange(2))[:, :, None]
        out[:, 16:48] = np.bitwise_or.reduce(bits.reshape(n_blocks, 8, 32), axis=1)
    return out


def _q6_k(xb: np.ndarray, qx) -> np.ndarray:
    """Q6_K blocks [B, 210] of super-blocks xb [B, 256]."""
    n_blocks = xb.shape[0]
    q, scale = qx(xb.reshape(n_blocks * 16, 16), Q6_NMAX)
    scale = scale.reshape(n_blocks, 16)
    at = np.argmax(np.abs(scale), axis=1)[:, None]                  # the first largest |scale|
    max_scale = np.take_along_axis(scale, at, axis=1)[:, 0]
    zero = np.abs(max_scale) < GROUP_MAX_EPS
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(zero, F32(0), F32(-128) / max_scale)
        d16 = np.where(zero, F32(0), F32(1) / iscale).astype(np.float16)
    sc = np.minimum(_rint(iscale[:, None] * scale), 127).astype(np.int8)            # [B, 16]
    d = d16.astype(F32)[:, None] * sc.astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        again = np.clip(_rint(xb.reshape(n_blocks, 16, 16) / d[..., None]), -32, 31) + 32
    q = np.where(d[..., None] != 0, again, q.reshape(n_blocks, 16, 16)).astype(np.uint8)
    q = q.reshape(n_blocks, 2, 4, 32)                        # [half of 128, quarter, l]
    out = np.zeros((n_blocks, Q6_K.block_bytes), np.uint8)
    lo = q & 0xF
    out[:, :128] = np.stack([lo[:, :, 0] | (lo[:, :, 2] << 4),
                             lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2).reshape(n_blocks, 128)
    hi = (q >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]
    out[:, 128:192] = np.bitwise_or.reduce(hi, axis=2).reshape(n_blocks, 64)
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = _f16_bytes(d16.astype(F32))
    out[zero] = 0
    return out


def _q5_32(fmt: Format, xb: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 blocks [B, S] of 32-blocks xb [B, 32]."""
    n_blocks = xb.shape[0]
    out = np.zeros((n_blocks, fmt.block_bytes), np.uint8)
    with np.errstate(divide="ignore"):
        if fmt is Q5_0:
            at = np.argmax(np.abs(xb), axis=1)[:, None]            # the first largest |x|
            d = np.take_along_axis(xb, at, axis=1)[:, 0] / F32(-16)
            inv = np.where(d != 0, F32(1) / d, F32(0))
            q = np.minimum(31, (xb * inv[:, None] + F32(16.5)).astype(np.int8)).astype(np.uint8)
            out[:, 0:2] = _f16_bytes(d)
        else:
            lo, hi = xb.min(axis=1), xb.max(axis=1)
            d = (hi - lo) / F32(31)
            inv = np.where(d != 0, F32(1) / d, F32(0))
            q = ((xb - lo[:, None]) * inv[:, None] + F32(0.5)).astype(np.uint8)
            out[:, 0:2], out[:, 2:4] = _f16_bytes(d), _f16_bytes(lo)
    qh = (((q >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(
        axis=1, dtype=np.uint32)
    out[:, -20:-16] = qh.astype("<u4").view(np.uint8).reshape(n_blocks, 4)
    out[:, -16:] = (q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)
    return out


def _quantize(fmt: Format, x: np.ndarray, qkx2, qx) -> np.ndarray:
    x = np.asarray(x, dtype=F32)
    if x.ndim == 0 or x.shape[-1] % fmt.block_values:
        raise FermijitError(f"quantize {fmt.name}: last axis of shape {list(x.shape)} is not "
                            f"whole {fmt.block_values}-blocks")
    xb = np.ascontiguousarray(x.reshape(-1, fmt.block_values))
    if fmt in (Q4_K, Q5_K):
        blocks = _q4_k_like(fmt, xb, qkx2)
    elif fmt is Q6_K:
        blocks = _q6_k(xb, qx)
    else:
        blocks = _q5_32(fmt, xb)
    return blocks.reshape(*x.shape[:-1], -1)


def quantize(fmt: Format, x: np.ndarray) -> np.ndarray:
    """x fp32 [..., K] -> blocks uint8 [..., K/Q·S], as llama.cpp's quantize_row_<fmt>_ref."""
    return _quantize(fmt, x, make_qkx2_quants, make_qx_quants)


def quantize_cpu(fmt: Format, x: np.ndarray) -> np.ndarray:
    """`quantize` with the searches in Numba (parallel over groups): the same bytes."""
    return _quantize(fmt, x, _qkx2_cpu, _qx_cpu)
