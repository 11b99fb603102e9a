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
"""

from __future__ import annotations

import numpy as np


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
