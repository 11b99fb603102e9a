"""Causal depthwise conv1d + SiLU over the GDN's mixed qkv channels (MODEL.md §6.2).

    y[t, c] = silu(Σ_{j<K} w[c, j] · x̃[t + j, c])      x̃ = [state (K-1 inputs, oldest first); x]

The last tap (j = K-1) multiplies the current token. `state` holds the previous K-1 inputs of each
channel (zeros at the start of a sequence); afterwards it holds the last K-1 rows of x̃. HF keeps
K columns of conv state; only the last K-1 matter, since the new token supplies the K-th tap.
Dimensions: T tokens, C channels (8192 = q 2048 | k 2048 | v 4096), K taps (4).
"""

from __future__ import annotations

import numpy as np

from fermijit import FermijitError
from fermijit.jit.checks import check_array, output
from fermijit.jit import mathf, omp
from fermijit.jit.cpu import kernel
from fermijit.ops.gemm import prefetch_bytes

# Channels per block: the block's taps (4 KiB) and state rows (3 KiB) stay in L1 while t advances.
CHANNEL_BLOCK = 256
# A block's rows are read backwards, 4 KiB or more apart, and the hardware prefetchers leave them
# to memory: prefill prefetches the row this many steps before its first read (the default
# model's 512-token pass, 6 calls, in-process alternation, 15 pairs, load ~3: 4.78 -> 3.10 ms
# median; 4 and 16 rows alike).
PREFETCH_ROWS = 8


def reference(x, w, state):
    """x [T, C], w [C, K], state [C, K-1] fp32 -> (y [T, C], new_state [C, K-1]) fp32."""
    k = w.shape[1]
    xx = np.concatenate([state.T, x]).astype(np.float64)                # [K-1+T, C]
    n_tokens = x.shape[0]
    pre = sum(w[:, j].astype(np.float64) * xx[j:j + n_tokens] for j in range(k))  # [T, C]
    y = pre / (1.0 + np.exp(-pre))
    return y.astype(np.float32), np.ascontiguousarray(xx[n_tokens:].T, dtype=np.float32)


def _conv_channels(x, w, state, out, c0, c1):  # x, out [1, C]; w [C, K]; state [C, K-1]
    # Decode: one token, channels c0..c1-1 (ops/gdn_step.py gives each thread its heads'). The
    # taps per channel first, then SiLU over the row in its own loop, which vectorises
    # (jit.mathf's exp): 71 -> ~15 us a full-size GDN layer (8192 channels); with SiLU inside
    # the channel loop, the strided state kept it scalar at 9 ns a channel.
    k = w.shape[1]
    xs, ys = x[0, c0:c1], out[0, c0:c1]  # row views: LLVM keeps 2-D indexed loops scalar here
    ws, ss = w[c0:c1], state[c0:c1]
    if k == 4:  # the model's taps, spelled out: the channel loop then vectorises too
        for c in range(c1 - c0):
            xc, s0, s1, s2 = xs[c], ss[c, 0], ss[c, 1], ss[c, 2]
            ys[c] = ws[c, 3] * xc + ws[c, 0] * s0 + ws[c, 1] * s1 + ws[c, 2] * s2
            ss[c, 0], ss[c, 1], ss[c, 2] = s1, s2, xc
    else:
        for c in range(c1 - c0):
            xc = xs[c]
            acc = ws[c, k - 1] * xc
            for j in range(k - 1):
                acc += ws[c, j] * ss[c, j]
            for j in range(k - 2):
                ss[c, j] = ss[c, j + 1]
            ss[c, k - 2] = xc
            ys[c] = acc
    for c in range(c1 - c0):
        ys[c] = mathf.silu(ys[c])


_conv_range = kernel(_conv_channels)


@kernel(fastmath=False)
def _conv_blocks(x, w_taps, state, out, b0, b1):  # x, out [T, C]; w_taps [K, C]; state [C, K-1]
    # Prefill, channel blocks b0..b1-1 of every token, t backwards, so out may be x (output t
    # overwrites input t, which only outputs t..t+K-1 read). Every innermost loop runs over
    # contiguous channels ([K, C] taps, rows of x~, a row of sums) and vectorises, exp included
    # (jit.mathf). With K = 4 a token's 4 taps are one loop (its sums stay in registers):
    # 0.85-0.90 -> 0.72-0.78 ns per element at T = 512, C = 1024 (the default model), 1.20-1.26
    # -> 1.05-1.21 at C = 8192, 1 thread, 3 rounds (9 ns for the decode loop above). A token's
    # sums run in one order whether its taps read the state or x, so a pass split anywhere
    # gives the same bits; without fast-math, in order, as the decode step's loop
    # (ops/gdn_step.py) sums them: reassociated, an 8-bit rounding flipped across a prefill /
    # decode boundary (tests/model/test_long_prompt.py, 1.3e-3 of the logits).
    n_tokens, n_channels = x.shape
    k = w_taps.shape[0]
    for b in range(b0, b1):
        c0 = b * CHANNEL_BLOCK
        n = min(CHANNEL_BLOCK, n_channels - c0)
        old = np.empty((k - 1, n), np.float32)   # the state as rows: x~'s first K-1 rows
        last = np.empty((k - 1, n), np.float32)  # the new state: the last K-1 rows of x~
        acc = np.empty(n, np.float32)
        for j in range(k - 1):
            for c in range(n):
                old[j, c] = state[c0 + c, j]
        for j in range(k - 1):
            i = n_tokens + j
            src = x[i - (k - 1), c0:c0 + n] if i >= k - 1 else old[i]
            for c in range(n):
                last[j, c] = src[c]
        for t in range(n_tokens - 1, -1, -1):
            if t >= k - 1 + PREFETCH_ROWS:  # the row a later step reads first (running back)
                lo = ((t - (k - 1) - PREFETCH_ROWS) * n_channels + c0) * 4
                prefetch_bytes(x, lo, lo + 4 * n)
            row = x[t, c0:c0 + n]
            if k == 4:
                r0 = x[t - 3, c0:c0 + n] if t >= 3 else old[t]
                r1 = x[t - 2, c0:c0 + n] if t >= 2 else old[t + 1]
                r2 = x[t - 1, c0:c0 + n] if t >= 1 else old[t + 2]
                w0, w1, w2, w3 = w_taps[0, c0:c0 + n], w_taps[1, c0:c0 + n], \
                    w_taps[2, c0:c0 + n], w_taps[3, c0:c0 + n]
                for c in range(n):
                    acc[c] = w3[c] * row[c] + w0[c] * r0[c] + w1[c] * r1[c] + w2[c] * r2[c]
            else:
                tap = w_taps[k - 1, c0:c0 + n]
                for c in range(n):
                    acc[c] = tap[c] * row[c]
                for j in range(k - 1):
                    i = t + j
                    tap = w_taps[j, c0:c0 + n]
                    src = x[i - (k - 1), c0:c0 + n] if i >= k - 1 else old[i]
                    for c in range(n):
                        acc[c] += tap[c] * src[c]
            y = out[t, c0:c0 + n]
            for c in range(n):
                y[c] = mathf.silu(acc[c])
        for j in range(k - 1):
            for c in range(n):
                state[c0 + c, j] = last[j, c]


def _sequence_share(thread, n_threads, args):
    x, w_taps, state, out = args
    n_blocks = (x.shape[1] + CHANNEL_BLOCK - 1) // CHANNEL_BLOCK
    _conv_blocks(x, w_taps, state, out, thread * n_blocks // n_threads,
                 (thread + 1) * n_blocks // n_threads)


def _sequence_body(x, w_taps, state, out):
    # Threads through one OpenMP fork (jit.omp), not prange: Numba's parfor lowering kept the
    # block's loops from vectorising (6.4 ns per element on 1 thread, against 1.4).
    fork((x, w_taps, state, out))


_sequence_kernel = omp.forking_kernel(_sequence_body, fork=_sequence_share)  # prefill's


def cpu(x, w, state, out=None):
    """x [T, C], w [C, K], state [C, K-1] fp32 -> (y [T, C], state). Updates `state` in place.

    `out` may be `x` (each input is read, into the state, before its output is written).
    """
    op = "conv1d"
    check_array(op, "x", x, np.float32, ndim=2)
    n_tokens, n_channels = x.shape
    check_array(op, "w", w, np.float32, (n_channels, None))
    k = w.shape[1]
    if k < 2:
        raise FermijitError(f"{op}: needs at least 2 taps, got w of shape {list(w.shape)}")
    check_array(op, "state", state, np.float32, (n_channels, k - 1))
    if not state.flags.writeable:
        raise FermijitError(f"{op}: state is read-only (it is updated in place)")
    out = output(op, out, x.shape)
    is_in_place = out.ctypes.data == x.ctypes.data
    if (not is_in_place and np.may_share_memory(out, x)) or np.may_share_memory(state, x) \
            or np.may_share_memory(state, out):
        raise FermijitError(f"{op}: state, x and out must not overlap (out may be x itself)")
    if n_tokens == 1:
        _conv_range(x, w, state, out, 0, n_channels)
    else:
        _sequence_kernel()(x, np.ascontiguousarray(w.T), state, out)
    return out, state


# --- GPU (kernels_ptx/conv1d.ptx: every (t, c) at once, then the state in place) ----------------

GPU_TAPS = (2, 3, 4)  # the widths conv1d.ptx is rendered for


def gpu(x, w, state, out=None):
    """As `cpu`, updating `state` in place; arrays numpy or on the device (fermijit.jit.gpu).
    `out` may be `x`: on the device the outputs then go through a scratch buffer, since every
    output reads TAPS-1 earlier inputs."""
    from fermijit.jit import gpu as g

    op = "conv1d"
    on_device = g.is_device(x) or g.is_device(out)
    g.check_array(op, "x", x, np.float32, ndim=2)
    n_tokens, n_channels = x.shape
    g.check_array(op, "w", w, np.float32, (n_channels, None))
    k = w.shape[1]
    if k not in GPU_TAPS:
        raise FermijitError(f"{op}: the GPU kernel takes {GPU_TAPS} taps, got w of shape "
                            f"{list(w.shape)}")
    g.check_array(op, "state", state, np.float32, (n_channels, k - 1))
    if not g.is_device(state) and not state.flags.writeable:
        raise FermijitError(f"{op}: state is read-only (it is updated in place)")
    y = g.output(op, out, x.shape)
    x_dev = g.to_device(op, "x", x, np.float32)
    state_dev = g.to_device(op, "state", state, np.float32)
    if int(state_dev.gpudata) in (int(x_dev.gpudata), int(y.gpudata)):
        raise FermijitError(f"{op}: state, x and out must not overlap (out may be x itself)")
    is_in_place = int(y.gpudata) == int(x_dev.gpudata)
    target = g.empty(x.shape, np.float32) if is_in_place else y
    if n_tokens and n_channels:
        blocks = -(-n_channels // 256)
        g.kernel("conv1d", f"conv1d_{k}", TAPS=k)(
            (blocks, min(n_tokens, g.FERMI_MAX_GRID[1])), (256,),
            x_dev, g.to_device(op, "w", w, np.float32), state_dev, target, n_tokens, n_channels)
        g.kernel("conv1d", f"conv1d_state_{k}", TAPS=k)(
            (blocks,), (256,), x_dev, state_dev, n_tokens, n_channels)
        if is_in_place:
            with g.check(f"{op}: copying the outputs over x"):
                g.driver().memcpy_dtod(y.gpudata, target.gpudata, target.nbytes)
    if not g.is_device(state):
        g.result(op, state_dev, state, False)
    return g.result(op, y, out, on_device), state
