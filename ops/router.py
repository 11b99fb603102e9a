"""MoE router: softmax over the experts, top-k, renormalised weights (MODEL.md §4).

    p = softmax(logits);  idx = the k largest p, descending, ties to the lower expert index;
    weight = p[idx] / Σ p[idx]                                   (qwen3_5_moe always renormalises)

The softmax's denominator cancels in the renormalisation, so the kernel ranks by logit (softmax is
monotone) and takes the softmax of the k chosen logits only. Dimensions: T tokens, E experts
(256; 128 after REAP pruning), k experts per token (8).
"""

from __future__ import annotations

import math

import numpy as np

from fermijit import FermijitError
from fermijit.jit import omp
from fermijit.jit.checks import check_array, output
from fermijit.jit.cpu import kernel


def reference(logits, top_k):
    """logits [T, E] or [E] fp32 -> (idx int32 [T, k] or [k], weight fp32 [T, k] or [k])."""
    l64 = logits.astype(np.float64)
    p = np.exp(l64 - l64.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    # Rank by logit, ties to the lower index (a stable sort): the order of p without the ties
    # that underflow to p = 0 would create.
    idx = np.argsort(-logits, axis=-1, kind="stable")[..., :top_k]
    top = np.take_along_axis(p, idx, axis=-1)
    return idx.astype(np.int32), (top / top.sum(axis=-1, keepdims=True)).astype(np.float32)


@kernel
def _route_rows(logits, idx, weight, first, last):  # logits [T, E]; idx, weight [T, k]
    # Insertion into a sorted list of k (E = 256, k = 8). A later expert moves up only past
    # strictly smaller logits, which keeps ties in index order.
    n_experts = logits.shape[1]
    k = idx.shape[1]
    for t in range(first, last):
        n = 0
        for e in range(n_experts):
            v = logits[t, e]
            if n == k and not v > weight[t, k - 1]:
                continue
            pos = n if n < k else k - 1                      # when full, the last one drops out
            while pos > 0 and weight[t, pos - 1] < v:
                weight[t, pos] = weight[t, pos - 1]
                idx[t, pos] = idx[t, pos - 1]
                pos -= 1
            weight[t, pos] = v
            idx[t, pos] = e
            n = min(n + 1, k)
        top = np.float64(weight[t, 0])
        total = 0.0
        for i in range(k):
            total += math.exp(np.float64(weight[t, i]) - top)
        for i in range(k):
            weight[t, i] = math.exp(np.float64(weight[t, i]) - top) / total


@kernel
def _route_tokens(logits, idx, weight):  # every row on this thread (decode's kernels call it)
    _route_rows(logits, idx, weight, 0, logits.shape[0])


def _route_body(logits, idx, weight):
    fork((logits, idx, weight))


# A prefill pass's rows over the threads (a 512-token pass: ~0.7 ms a layer on one thread).
_route_threads = omp.forking_kernel(_route_body, fork=omp.rows_share(_route_rows, "router"))


def cpu(logits, top_k, out=None):
    """logits [T, E] or [E] fp32 -> (idx int32, weight fp32), each [T, k] or [k].

    `out` is an (idx, weight) pair to fill.
    """
    op = "router"
    check_array(op, "logits", logits, np.float32)
    if logits.ndim not in (1, 2):
        raise FermijitError(f"{op}: logits must be [E] or [T, E], got shape {list(logits.shape)}")
    n_experts = logits.shape[-1]
    if not (isinstance(top_k, (int, np.integer)) and 1 <= top_k <= n_experts):
        raise FermijitError(f"{op}: top_k must be an int in [1, {n_experts}], got {top_k!r}")
    shape = logits.shape[:-1] + (int(top_k),)
    idx_out, weight_out = (None, None) if out is None else out
    idx_out = output(op, idx_out, shape, np.int32)
    weight_out = output(op, weight_out, shape, np.float32)
    args = (logits.reshape(-1, n_experts), idx_out.reshape(-1, top_k),
            weight_out.reshape(-1, top_k))
    if args[0].shape[0] >= omp.ROWS_MIN:
        _route_threads()(*args)
    else:
        _route_tokens(*args)
    return idx_out, weight_out


# --- GPU (kernels_ptx/router.ptx: one thread per token, the top-k kept sorted in registers) -----

GPU_MAX_TOP_K = 8  # router.ptx is rendered for k = 1..8


def gpu(logits, top_k, out=None):
    """As `cpu`; arrays numpy or on the device (fermijit.jit.gpu). `out` is an (idx, weight)
    pair, both numpy or both on the device."""
    from fermijit.jit import gpu as g

    op = "router"
    g.check_array(op, "logits", logits, np.float32)
    if len(logits.shape) not in (1, 2):
        raise FermijitError(f"{op}: logits must be [E] or [T, E], got shape {list(logits.shape)}")
    n_experts = logits.shape[-1]
    if not (isinstance(top_k, (int, np.integer)) and 1 <= top_k <= min(n_experts,
                                                                       GPU_MAX_TOP_K)):
        raise FermijitError(f"{op}: top_k must be an int in [1, {min(n_experts, GPU_MAX_TOP_K)}]"
                            f" on the GPU, got {top_k!r}")
    shape = tuple(logits.shape[:-1]) + (int(top_k),)
    idx_out, weight_out = (None, None) if out is None else out
    on_device = g.is_device(logits) or g.is_device(idx_out)
    idx = g.output(op, idx_out, shape, np.int32)
    weight = g.output(op, weight_out, shape, np.float32)
    n_tokens = int(np.prod(logits.shape[:-1], dtype=np.int64))
    if n_tokens:
        g.kernel("router", TOP_K=int(top_k))(
            (-(-n_tokens // 64),), (64,), g.to_device(op, "logits", logits, np.float32), idx,
            weight, n_tokens, n_experts)
    return g.result(op, idx, idx_out, on_device), g.result(op, weight, weight_out, on_device)
