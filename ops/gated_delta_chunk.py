"""Stages of the chunked (UT/WY) gated delta rule, MODEL.md §6 "Chunked prefill".

The sequence is cut into N chunks of C positions (zero-padded: beta = 0 and g = 0 there, so the
padding changes nothing). Within a chunk, gamma_r = sum_{s<=r} g_s and
Gamma_rs = exp(gamma_r - gamma_s) for s <= r, else 0. Each stage is named after the math and is
the numpy spec of one GPU kernel, as fla's `gated_delta_rule/chunk.py` composes `wy_fast`,
`chunk_delta_h` and `chunk_o`; `gated_delta.chunked_reference` composes them.

Layout: head-major chunks, keys already repeated to value heads (value head h reads key head
h // (Hv/Hk)). Letters: Hv value heads, N chunks, C chunk length, dk key dim, dv value dim.
  q, k [Hv, N, C, dk]; v, u, v_new [Hv, N, C, dv]; g, beta, gamma [Hv, N, C];
  state [Hv, dk, dv]; h [Hv, N, dk, dv] (the state at the start of each chunk).

`cpu` runs the stages as batched fp32 matrix products, every value head at once and the chunks in
order, on the token-major arrays of `gated_delta.cpu` (same signature and result).
A last chunk shorter than C is taken as it is: the chunk equations hold for any length, and the
padding they would add changes nothing.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from fermijit.jit.cpu import kernel

CHUNK = 64  # MODEL.md §6, as the GPU (gated_delta.GPU_CHUNK) and transformers


def to_chunks(x: np.ndarray, chunk: int) -> np.ndarray:
    """x [T, Hv, ...] -> [Hv, N, C, ...], zero-padded to N*C positions."""
    T = x.shape[0]
    n_chunks = max(1, -(-T // chunk))
    pad = [(0, n_chunks * chunk - T)] + [(0, 0)] * (x.ndim - 1)
    x = np.pad(x, pad).reshape(n_chunks, chunk, *x.shape[1:])
    return np.moveaxis(x, 2, 0)


def from_chunks(x: np.ndarray, T: int) -> np.ndarray:
    """x [Hv, N, C, d] -> [T, Hv, d], dropping the padding."""
    Hv, N, C, d = x.shape
    return np.moveaxis(x, 0, 2).reshape(N * C, Hv, d)[:T]


def chunk_cumsum(g: np.ndarray) -> np.ndarray:
    """gamma [Hv, N, C]: the log-decay from the start of the chunk to position r, inclusive."""
    return np.cumsum(g, axis=-1)


def decay_mask(gamma: np.ndarray) -> np.ndarray:
    """Gamma [Hv, N, C, C], diagonal included; the masked exponent is -inf, not exp(>0)."""
    C = gamma.shape[-1]
    causal = np.tril(np.ones((C, C), dtype=bool))
    return np.exp(np.where(causal, gamma[..., :, None] - gamma[..., None, :], -np.inf))


def wy_representation(k, v, beta, gamma):
    """(W [Hv, N, C, dk], U [Hv, N, C, dv]) from the unit lower-triangular system
    A = I + strictlyLower(diag(beta) K K^T * Gamma): U = A^-1 diag(beta) V and
    W = A^-1 diag(beta e^gamma) K, so that the chunk's new values are V' = U - W S."""
    C = k.shape[-2]
    kk = beta[..., :, None] * (k @ np.swapaxes(k, -1, -2)) * decay_mask(gamma)
    a = np.eye(C, dtype=k.dtype) + np.tril(kk, -1)
    u = np.linalg.solve(a, beta[..., None] * v)
    w = np.linalg.solve(a, (beta * np.exp(gamma))[..., None] * k)
    return w, u


def chunk_states(k, w, u, gamma, state):
    """The sequential scan over chunks: (h [Hv, N, dk, dv], v_new [Hv, N, C, dv], final state).

    Per chunk, with S the state at its start: V' = U - W S, then
    S <- e^{gamma_C} S + (K * e^{gamma_C - gamma})^T V'."""
    N = k.shape[1]
    h = np.empty((*state.shape[:1], N, *state.shape[1:]), dtype=state.dtype)
    v_new = np.empty_like(u)
    S = state
    for n in range(N):
        h[:, n] = S
        v_new[:, n] = u[:, n] - w[:, n] @ S
        gamma_n = gamma[:, n]                                         # [Hv, C]
        k_decayed = k[:, n] * np.exp(gamma_n[:, -1:] - gamma_n)[..., None]
        S = np.exp(gamma_n[:, -1])[:, None, None] * S + np.swapaxes(k_decayed, -1, -2) @ v_new[:, n]
    return h, v_new, S


def chunk_output(q, k, v_new, h, gamma):
    """O [Hv, N, C, dv] = (Q * e^gamma) S + (Q K^T * Gamma) V', Gamma with its diagonal."""
    inter = (q * np.exp(gamma)[..., None]) @ h
    intra = ((q @ np.swapaxes(k, -1, -2)) * decay_mask(gamma)) @ v_new
    return inter + intra


# --- CPU ----------------------------------------------------------------------------------------
# The stages above as batched fp32 matrix products (numpy's matmul, as the model's other fp32
# products: model/forward.py), every value head at once: the chunks' own terms (K Kᵀ, Q Kᵀ, the
# WY solve) for all chunks in one call each, then per chunk in order the three products with the
# state. At full size (32 value heads, dk = dv = 128) the state products are 64x128x128 per head:
# BLAS-shaped, where the token loop sweeps each head's 64 KiB state twice per token.


@kernel(parallel=True)
def _unit_lower_inverse(a, out):
    """out[m] = (I + L[m])⁻¹ for the strictly lower L[m] = a[m] ([M, C, C], upper part ignored),
    by forward substitution row by row: row r = e_r - Σ_{s<r} L[r, s] · row s."""
    n_mat, C = a.shape[0], a.shape[1]
    for m in prange(n_mat):
        t = out[m]
        for r in range(C):
            t_r, a_r = t[r], a[m, r]
            t_r[:] = 0
            t_r[r] = 1
            for s in range(r):
                f = a_r[s]
                t_s = t[s]
                for j in range(s + 1):  # row s is zero past column s
                    t_r[j] -= f * t_s[j]


def _per_value_head(x, group):
    """[Hk, ...] -> [Hv, ...]: value head h reads key head h // group (a view when group = 1)."""
    return x if group == 1 else np.repeat(x, group, axis=0)


def cpu(q, k, v, g, beta, state, out=None):
    """`gated_delta.reference`'s result by the chunked form (C = CHUNK), fp32, updating `state`
    in place: q, k [T, Hk, dk]; v [T, Hv, dv]; g, beta [T, Hv]; state [Hv, dk, dv] ->
    (o [T, Hv, dv], state)."""
    from fermijit.ops.gated_delta import check_cpu_inputs

    o = check_cpu_inputs("gated_delta_chunk", q, k, v, g, beta, state, out)
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1:]
    if T == 0:
        return o, state
    group = Hv // Hk
    C = min(CHUNK, T)
    f32 = np.float32
    qc = _per_value_head(to_chunks(q, C), group)                             # [Hv, N, C, dk]
    kc = _per_value_head(to_chunks(k, C), group)
    vc, gc, bc = to_chunks(v, C), to_chunks(g, C), to_chunks(beta, C)        # zero-padded
    gamma = chunk_cumsum(gc)                                                 # [Hv, N, C]
    decay = decay_mask(gamma).astype(f32)                                    # Gamma, [Hv, N, C, C]
    kt = np.swapaxes(kc, -1, -2)
    a = np.ascontiguousarray(bc[..., :, None] * (kc @ kt) * decay)          # its lower part: L
    t_inv = np.empty(a.shape, f32)
    _unit_lower_inverse(a.reshape(-1, C, C), t_inv.reshape(-1, C, C))       # (I + L)⁻¹
    u = t_inv @ (bc[..., None] * vc)                                         # U = A⁻¹ diag(β) V
    w = t_inv @ ((bc * np.exp(gamma))[..., None] * kc)  # W = A⁻¹ diag(βe^γ) K
    qk = (qc @ kt) * decay                                                   # [Hv, N, C, C]
    q_in = qc * np.exp(gamma)[..., None]
    last = gamma[..., -1]                                                    # [Hv, N]
    k_out = kc * np.exp(last[..., None] - gamma)[..., None]                  # K e^{γ_C - γ}
    oc = np.empty_like(vc)
    S = state
    for n in range(gc.shape[1]):
        v_new = u[:, n] - w[:, n] @ S                                        # V' = U - W S
        oc[:, n] = q_in[:, n] @ S + qk[:, n] @ v_new
        S *= np.exp(last[:, n])[:, None, None]
        S += np.swapaxes(k_out[:, n], -1, -2) @ v_new
    o[:] = from_chunks(oc, T)
    return o, state
