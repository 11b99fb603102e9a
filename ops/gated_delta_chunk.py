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

`cpu` runs every stage in Numba, one value head per thread and its chunks in order, on the
token-major arrays of `gated_delta.cpu` (same signature and result; issue 9).
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

# The loops below index rows through views (`u_r = u[r]`): with 2-D indices LLVM left the inner
# loops scalar (the conv1d prefill loop measured 5.6 against 1.3 ns per element).

@kernel
def _dot(a, b):
    acc = np.float32(0)
    for i in range(a.size):
        acc += a[i] * b[i]
    return acc


@kernel
def _axpy(alpha, x, y):  # y += alpha x
    for i in range(y.size):
        y[i] += alpha * x[i]


@kernel
def _wy_representation(k, v, beta, gamma, a, w, u):
    """The chunk's W [n, dk] and U [n, dv] by forward substitution through the unit lower
    triangular A (a: its strictly lower part, [n, n] scratch); k [n, dk], v [n, dv] views."""
    n = k.shape[0]
    for r in range(n):
        a_r = a[r]
        for s in range(r):
            a_r[s] = beta[r] * _dot(k[r], k[s]) * np.exp(gamma[r] - gamma[s])
    for r in range(n):
        u_r, w_r, v_r, k_r = u[r], w[r], v[r], k[r]
        b = beta[r]
        bg = b * np.exp(gamma[r])
        for j in range(u_r.size):
            u_r[j] = b * v_r[j]
        for i in range(w_r.size):
            w_r[i] = bg * k_r[i]
        for s in range(r):
            _axpy(-a[r, s], u[s], u_r)
            _axpy(-a[r, s], w[s], w_r)


@kernel
def _chunk_step(q, k, u, w, gamma, S, o):
    """One chunk against the state S [dk, dv] at its start: u <- V' = U - W S; o [n, dv] =
    (Q e^gamma) S + (Q K^T Gamma) V'; then S <- e^{gamma_n} S + (K e^{gamma_n - gamma})^T V'."""
    n, dk = k.shape
    for r in range(n):
        u_r, o_r, w_r, q_r = u[r], o[r], w[r], q[r]
        eg = np.exp(gamma[r])
        o_r[:] = 0
        for i in range(dk):
            S_i = S[i]
            _axpy(-w_r[i], S_i, u_r)
            _axpy(q_r[i] * eg, S_i, o_r)
    for r in range(n):
        o_r, q_r = o[r], q[r]
        for s in range(r + 1):
            _axpy(_dot(q_r, k[s]) * np.exp(gamma[r] - gamma[s]), u[s], o_r)
    last = gamma[n - 1]
    decay = np.exp(last)
    for i in range(dk):
        S_i = S[i]
        for j in range(S_i.size):
            S_i[j] *= decay
    for s in range(n):
        k_s, u_s = k[s], u[s]
        f = np.exp(last - gamma[s])
        for i in range(dk):
            _axpy(k_s[i] * f, u_s, S[i])


@kernel(parallel=True)
def _chunked(q, k, v, g, beta, state, o, chunk):
    """Per value head (one per thread), its chunks in order: each chunk's rows gathered from the
    token-major inputs, the stages, the outputs scattered back."""
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    group = Hv // Hk
    for h in prange(Hv):
        hk = h // group
        qc = np.empty((chunk, dk), np.float32)
        kc = np.empty((chunk, dk), np.float32)
        vc = np.empty((chunk, dv), np.float32)
        oc = np.empty((chunk, dv), np.float32)
        w = np.empty((chunk, dk), np.float32)
        u = np.empty((chunk, dv), np.float32)
        a = np.empty((chunk, chunk), np.float32)
        bc = np.empty(chunk, np.float32)
        gamma = np.empty(chunk, np.float32)
        for t0 in range(0, T, chunk):
            n = min(chunk, T - t0)
            total = np.float32(0)
            for r in range(n):
                qc[r] = q[t0 + r, hk]
                kc[r] = k[t0 + r, hk]
                vc[r] = v[t0 + r, h]
                bc[r] = beta[t0 + r, h]
                total += g[t0 + r, h]
                gamma[r] = total
            _wy_representation(kc[:n], vc[:n], bc[:n], gamma[:n], a, w[:n], u[:n])
            _chunk_step(qc[:n], kc[:n], u[:n], w[:n], gamma[:n], state[h], oc[:n])
            for r in range(n):
                o[t0 + r, h] = oc[r]


def cpu(q, k, v, g, beta, state, out=None):
    """`gated_delta.reference`'s result by the chunked form (C = CHUNK), fp32, updating `state`
    in place: q, k [T, Hk, dk]; v [T, Hv, dv]; g, beta [T, Hv]; state [Hv, dk, dv] ->
    (o [T, Hv, dv], state)."""
    from fermijit.ops.gated_delta import check_cpu_inputs

    o = check_cpu_inputs("gated_delta_chunk", q, k, v, g, beta, state, out)
    _chunked(q, k, v, g, beta, state, o, CHUNK)
    return o, state
