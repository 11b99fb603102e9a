"""Gated DeltaNet: the gates and the delta-rule recurrence, MODEL.md §6 steps 5-7.

Gates:  beta = sigmoid(b),  g = -exp(A_log) * softplus(a + dt_bias),  alpha = exp(g) in (0, 1).
Per value head h (key head h // (Hv/Hk)), with state S [dk, dv] and q, k already L2-normalised
(q also scaled by 1/sqrt(dk)) by the caller:
    S <- alpha_t S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
`reference` is that recurrence; `chunked_reference` the chunked UT/WY form the GPU implements
(stages in `gated_delta_chunk`); `cpu` the recurrence in Numba (T = 1 is the decode step).

Letters: T tokens, Hk key heads, Hv value heads, dk key dim, dv value dim.
"""

from __future__ import annotations

import numpy as np

from fermijit import FermijitError
from fermijit.jit.checks import check_array, output
from fermijit.jit import omp
from fermijit.jit.cpu import kernel, selected_isa
from fermijit.ops import gated_delta_chunk as stages
from fermijit.ops import gated_delta_prefill


def gates_reference(a, b, A_log, dt_bias):
    """a, b [T, Hv]; A_log, dt_bias [Hv] -> (g, beta) [T, Hv], fp32 or wider."""
    dt = np.result_type(a, b, A_log, dt_bias, np.float32)
    a, b, A_log, dt_bias = (np.asarray(x, dtype=dt) for x in (a, b, A_log, dt_bias))
    beta = np.exp(-np.logaddexp(0, -b))                       # sigmoid, no overflow
    g = -np.exp(A_log) * np.logaddexp(0, a + dt_bias)         # softplus = log(1 + e^x)
    return g, beta


def reference(q, k, v, g, beta, state):
    """q, k [T, Hk, dk]; v [T, Hv, dv]; g, beta [T, Hv]; state [Hv, dk, dv]
    -> (o [T, Hv, dv], new state [Hv, dk, dv]), in fp32 or wider (the inputs' precision).
    `state` is not modified."""
    dt = np.result_type(q, k, v, g, beta, state, np.float32)
    group = v.shape[1] // q.shape[1]
    S = np.array(state, dtype=dt)                                           # [Hv, dk, dv]
    o = np.empty(v.shape, dtype=dt)
    for t in range(v.shape[0]):
        q_t, k_t = (np.repeat(np.asarray(x[t], dtype=dt), group, axis=0) for x in (q, k))
        S = np.exp(np.asarray(g[t], dtype=dt))[:, None, None] * S           # S <- alpha S
        r = np.einsum("hk,hkv->hv", k_t, S)                                 # S^T k
        delta = np.asarray(beta[t], dtype=dt)[:, None] * (v[t] - r)         # [Hv, dv]
        S = S + k_t[:, :, None] * delta[:, None, :]
        o[t] = np.einsum("hk,hkv->hv", q_t, S)                              # S^T q
    return o, S


def chunked_reference(q, k, v, g, beta, state, chunk=64):
    """The same result as `reference` by the chunked UT/WY form (MODEL.md §6, chunked prefill)."""
    dt = np.result_type(q, k, v, g, beta, state, np.float32)
    T, Hv = v.shape[:2]
    group = Hv // q.shape[1]
    q, k = (np.repeat(np.asarray(x, dtype=dt), group, axis=1) for x in (q, k))  # [T, Hv, dk]
    q, k, v, g, beta = (stages.to_chunks(np.asarray(x, dtype=dt), chunk)
                        for x in (q, k, v, g, beta))
    gamma = stages.chunk_cumsum(g)                                          # [Hv, N, C]
    w, u = stages.wy_representation(k, v, beta, gamma)
    h, v_new, new_state = stages.chunk_states(k, w, u, gamma, np.asarray(state, dtype=dt))
    o = stages.chunk_output(q, k, v_new, h, gamma)                          # [Hv, N, C, dv]
    return stages.from_chunks(o, T), new_state


# --- CPU ----------------------------------------------------------------------------------------

@kernel
def _gates_rows(a, b, A_log, dt_bias, g, beta, first, last):
    Hv = a.shape[1]
    for t in range(first, last):
        for h in range(Hv):
            x = a[t, h] + dt_bias[h]
            softplus = max(x, np.float32(0)) + np.log1p(np.exp(-abs(x)))  # exact for large |x|
            g[t, h] = -np.exp(A_log[h]) * softplus
            beta[t, h] = 1 / (1 + np.exp(-b[t, h]))


@kernel
def _gates(a, b, A_log, dt_bias, g, beta):  # every row on this thread (decode's kernels call it)
    _gates_rows(a, b, A_log, dt_bias, g, beta, 0, a.shape[0])


def _gates_body(a, b, A_log, dt_bias, g, beta):
    fork((a, b, A_log, dt_bias, g, beta))


# A prefill pass's rows over the threads (a 512-token pass: ~0.5 ms a layer on one thread).
_gates_threads = omp.forking_kernel(_gates_body, fork=omp.rows_share(_gates_rows, "gdn-gates"))


def gates_cpu(a, b, A_log, dt_bias, out=None):
    """fp32 `gates_reference`; `out` is a (g, beta) pair of [T, Hv] buffers. a and b may be
    row views (contiguous rows, any row stride)."""
    op = "gated_delta.gates"
    T, Hv = check_array(op, "a", a, np.float32, rows=True).shape
    check_array(op, "b", b, np.float32, (T, Hv), rows=True)
    check_array(op, "A_log", A_log, np.float32, (Hv,))
    check_array(op, "dt_bias", dt_bias, np.float32, (Hv,))
    g_out, beta_out = (None, None) if out is None else out
    g, beta = output(op, g_out, (T, Hv)), output(op, beta_out, (T, Hv))
    (_gates_threads() if T >= omp.ROWS_MIN else _gates)(a, b, A_log, dt_bias, g, beta)
    return g, beta


# A head's sweeps over its state S [dk, dv] in place. Those that write go four rows i at a time
# (unroll and jam): each element's operations, and each sum over i in the order of one row at a
# time, as row by row (the same bits: fastmath off, so nothing is reassociated), while the
# accumulators (d1, o1) are loaded and stored once for four rows instead of once a row. One
# 64 KiB head in cache, 2-core Zen 5: a write-and-read sweep 2.7-3.0 -> 1.7 us; 30 full-size
# GDN layers cold, 2 threads, a verify step's 2 rows 150 -> 120 us a layer (with a pending row
# 162 -> 142). The read sweep stays row by row: in fours, a token's GDN layers (whose first
# sweep streams the head from memory) took ~20 % longer cold (84-94 -> 107-111 us a layer).
# (In place only: a destination apart from the source, not known not to alias it, took the
# loops' unvectorised versions.)

@kernel(fastmath=False)
def read_sweep(S, k, q, d, o):
    """d = S^T k, o = S^T q; returns k . q (each sum over i in order)."""
    d[:] = 0
    o[:] = 0
    kq = np.float32(0)
    for i in range(S.shape[0]):
        k_i, q_i = k[i], q[i]
        kq += k_i * q_i
        for j in range(S.shape[1]):
            d[j] += S[i, j] * k_i
            o[j] += S[i, j] * q_i
    return kq


@kernel(fastmath=False)
def write_sweep(S, alpha, k, d):
    """S <- alpha S + k d^T."""
    n, dv = S.shape
    i = 0
    while i + 4 <= n:
        ka, kb, kc, kd = k[i], k[i + 1], k[i + 2], k[i + 3]
        Sa, Sb, Sc, Sd = S[i], S[i + 1], S[i + 2], S[i + 3]
        for j in range(dv):
            w = d[j]
            Sa[j] = alpha * Sa[j] + ka * w
            Sb[j] = alpha * Sb[j] + kb * w
            Sc[j] = alpha * Sc[j] + kc * w
            Sd[j] = alpha * Sd[j] + kd * w
        i += 4
    for i in range(i, n):
        k_i = k[i]
        for j in range(dv):
            S[i, j] = alpha * S[i, j] + k_i * d[j]


@kernel(fastmath=False)
def write_read_sweep(S, alpha, k, d, k1, q1, d1, o1):
    """`write_sweep` (S <- alpha S + k d^T) and, from each value as it is written, the next
    row's `read_sweep` (d1 = S^T k1, o1 = S^T q1); returns k1 . q1."""
    d1[:] = 0
    o1[:] = 0
    kq = np.float32(0)
    n, dv = S.shape
    i = 0
    while i + 4 <= n:
        ka, kb, kc, kd = k[i], k[i + 1], k[i + 2], k[i + 3]
        pa, pb, pc, pd = k1[i], k1[i + 1], k1[i + 2], k1[i + 3]
        qa, qb, qc, qd = q1[i], q1[i + 1], q1[i + 2], q1[i + 3]
        kq += pa * qa
        kq += pb * qb
        kq += pc * qc
        kq += pd * qd
        Sa, Sb, Sc, Sd = S[i], S[i + 1], S[i + 2], S[i + 3]
        for j in range(dv):
            w = d[j]
            xa = alpha * Sa[j] + ka * w
            xb = alpha * Sb[j] + kb * w
            xc = alpha * Sc[j] + kc * w
            xd = alpha * Sd[j] + kd * w
            Sa[j] = xa
            Sb[j] = xb
            Sc[j] = xc
            Sd[j] = xd
            t = d1[j]
            t += xa * pa
            t += xb * pb
            t += xc * pc
            t += xd * pd
            d1[j] = t
            u = o1[j]
            u += xa * qa
            u += xb * qb
            u += xc * qc
            u += xd * qd
            o1[j] = u
        i += 4
    for i in range(i, n):
        k_i, p_i, q_i = k[i], k1[i], q1[i]
        kq += p_i * q_i
        for j in range(dv):
            x = alpha * S[i, j] + k_i * d[j]
            S[i, j] = x
            d1[j] += x * p_i
            o1[j] += x * q_i
    return kq


@kernel
def _recurrent_head(q, k, v, g, beta, state, o, delta, h):
    """Value head h over the tokens in order. Per token, two sweeps of the head's 64 KiB state:
    one reads S^T k and S^T q together, one writes S <- alpha S + k delta^T. The output needs no
    third sweep: o = S_new^T q = alpha S^T q + (k.q) delta. delta [dv] is scratch."""
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    hk = h // (Hv // Hk)
    S = state[h]                                                            # [dk, dv]
    for t in range(T):
        alpha = np.exp(g[t, h])
        o_t = o[t, h]
        kq = read_sweep(S, k[t, hk], q[t, hk], delta, o_t)                  # S^T k, S^T q
        for j in range(dv):
            delta[j] = beta[t, h] * (v[t, h, j] - alpha * delta[j])
            o_t[j] = alpha * o_t[j] + kq * delta[j]
        write_sweep(S, alpha, k[t, hk], delta)


def recurrent_share(thread, n_threads, args):
    """A thread's run of value heads (jit.omp.fork): each head by one thread, whatever the
    thread count (decode's ops/gdn_step.py splits by key heads its own way). A fork, not a
    prange: inside a compiled caller a prange launch cost ~3x the heads' work on 2 threads (419
    vs 131 us a full-size layer), and its parfor took 2.9 s of a first run's compiling."""
    q, k, v, g, beta, state, o, deltas = args
    Hv = v.shape[1]
    for h in range(thread * Hv // n_threads, (thread + 1) * Hv // n_threads):
        _recurrent_head(q, k, v, g, beta, state, o, deltas[h], h)


def _recurrent_body(q, k, v, g, beta, state, o):
    fork((q, k, v, g, beta, state, o, np.empty((v.shape[1], v.shape[2]), np.float32)))


_recurrent_kernel = omp.forking_kernel(_recurrent_body, fork=recurrent_share)


def _recurrent(*args):
    _recurrent_kernel()(*args)


def check_cpu_inputs(op, q, k, v, g, beta, state, out):
    """The checks of a CPU delta-rule kernel's arguments (this recurrence and the chunked form);
    returns the output buffer [T, Hv, dv]."""
    T, Hv, dv = check_array(op, "v", v, np.float32, ndim=3).shape
    Hk, dk = check_array(op, "q", q, np.float32, (T, None, None)).shape[1:]
    check_array(op, "k", k, np.float32, (T, Hk, dk))
    check_array(op, "g", g, np.float32, (T, Hv))
    check_array(op, "beta", beta, np.float32, (T, Hv))
    check_array(op, "state", state, np.float32, (Hv, dk, dv))
    if Hk == 0 or Hv % Hk:
        raise FermijitError(f"{op}: {Hv} value heads is not a multiple of {Hk} key heads")
    if not state.flags.writeable:
        raise FermijitError(f"{op}: state is read-only")
    return output(op, out, (T, Hv, dv))


def cpu(q, k, v, g, beta, state, out=None):
    """fp32 `reference`, updating `state` in place; returns (o, state). Prompts (T > 1) run the
    same recurrence in one sweep of the state per token (ops/gated_delta_prefill.py: its bits)."""
    o = check_cpu_inputs("gated_delta", q, k, v, g, beta, state, out)
    if q.shape[0] > 1:
        gated_delta_prefill.run(q, k, v, g, beta, state, o, selected_isa())
    else:
        _recurrent(q, k, v, g, beta, state, o)
    return o, state


# --- GPU (kernels_ptx/gdn_chunk.ptx: the chunked form, C = 64) ----------------------------------

GPU_CHUNK = 64
GPU_KEY_DIMS = (64, 128)  # the scan stages K in 64-column halves and holds S[:dk, 16] in 10 KB
GPU_VALUE_BLOCK = 16      # value columns per scan block (the model's 32 heads x 8: 256 blocks)


def gpu(q, k, v, g, beta, state, out=None):
    """As `cpu` (the recurrence's result, computed in the chunked UT/WY form of
    `chunked_reference`), updating `state` in place; arrays numpy or on the device
    (fermijit.jit.gpu). Returns (o, state)."""
    from fermijit.jit import gpu as gpu_jit

    op = "gated_delta"
    on_device = gpu_jit.is_device(v) or gpu_jit.is_device(out)
    T, Hv, dv = gpu_jit.check_array(op, "v", v, np.float32, ndim=3).shape
    Hk, dk = gpu_jit.check_array(op, "q", q, np.float32, (T, None, None)).shape[1:]
    gpu_jit.check_array(op, "k", k, np.float32, (T, Hk, dk))
    gpu_jit.check_array(op, "g", g, np.float32, (T, Hv))
    gpu_jit.check_array(op, "beta", beta, np.float32, (T, Hv))
    gpu_jit.check_array(op, "state", state, np.float32, (Hv, dk, dv))
    if Hk == 0 or Hv % Hk:
        raise FermijitError(f"{op}: {Hv} value heads is not a multiple of {Hk} key heads")
    if dk not in GPU_KEY_DIMS or dv == 0 or dv % GPU_VALUE_BLOCK:
        raise FermijitError(f"{op}: the GPU kernels take dk in {GPU_KEY_DIMS} and dv a multiple "
                            f"of {GPU_VALUE_BLOCK}, got dk={dk}, dv={dv}")
    if not gpu_jit.is_device(state) and not state.flags.writeable:
        raise FermijitError(f"{op}: state is read-only")
    o = gpu_jit.output(op, out, (T, Hv, dv))
    if T == 0:
        return gpu_jit.result(op, o, out, on_device), state
    q_dev, k_dev = (gpu_jit.to_device(op, n, a, np.float32) for n, a in (("q", q), ("k", k)))
    state_dev = gpu_jit.to_device(op, "state", state, np.float32)
    scratch = gpu_scratch(T, Hv)
    gpu_prep(q_dev, k_dev, gpu_jit.to_device(op, "g", g, np.float32),
             gpu_jit.to_device(op, "beta", beta, np.float32), scratch, T, Hk, Hv, dk)
    gpu_scan(q_dev, k_dev, gpu_jit.to_device(op, "v", v, np.float32), scratch, state_dev, o, T,
             Hk, Hv, dk, dv)
    if not gpu_jit.is_device(state):
        gpu_jit.result(op, state_dev, state, False)
    return gpu_jit.result(op, o, out, on_device), state


def gpu_scratch(T: int, Hv: int) -> tuple:
    """Device scratch of the two kernels for T tokens: per chunk the decays (gamma) and the two
    [C, C] blocks prep writes and the scan reads."""
    from fermijit.jit import gpu as gpu_jit

    n_chunks = -(-T // GPU_CHUNK)
    return (gpu_jit.empty((Hv, n_chunks, GPU_CHUNK), np.float32),
            *(gpu_jit.empty((Hv, n_chunks, GPU_CHUNK, GPU_CHUNK), np.float32) for _ in (0, 1)))


def gpu_prep(q, k, g, beta, scratch, T: int, Hk: int, Hv: int, dk: int) -> None:
    """gdn_chunk_prep on device arrays, unchecked (`gpu` checks): a block per (chunk, head)."""
    from fermijit.jit import gpu as gpu_jit

    gpu_jit.kernel("gdn_chunk", "gdn_chunk_prep")(
        (-(-T // GPU_CHUNK), Hv), (256,), q, k, g, beta, *scratch, T, Hk, Hv, dk)


def gpu_scan(q, k, v, scratch, state, o, T: int, Hk: int, Hv: int, dk: int, dv: int) -> None:
    """gdn_chunk_scan on device arrays after `gpu_prep`, unchecked: a block per GPU_VALUE_BLOCK
    value columns of a head."""
    from fermijit.jit import gpu as gpu_jit

    gpu_jit.kernel("gdn_chunk", "gdn_chunk_scan")(
        (dv // GPU_VALUE_BLOCK, Hv), (256,), q, k, v, *scratch, state, o, T, Hk, Hv, dk, dv)
