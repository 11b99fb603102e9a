"""The step before each sublayer of a decode token (MODEL.md §4), as one call:

    x += y                            the previous sublayer's output into the residual (optional)
    xn = rmsnorm(x, norm_w)           the sublayer's input
    act = quantise(xn)                for the W4A8 projections that read it
    p = W · xn                        an fp32 product of the input (R rows; R = 0: none)
    ids, weights = router(p, k)       with k > 0: p are router logits, routed here

One product per sublayer kind reads its input in fp32: the GDN mixer's gates [b; a] [2Hv, H] and
the MoE router [E, H] (1 MB a layer at full size). Both were numpy matmuls between the kernels,
with the add, the norm and the quantisation as separate calls: ~50 us of Python and dispatch a
layer (`bench decode --profile`), 2 ms a token of the real model's 40 layers.

The norm, the quantisation and the routing are the ops' own kernels, so those outputs are bit for
bit ops.rmsnorm / matvec.quantize_act / ops.router on the same input (tests/ops/
test_residual_step.py). The quantisation is ops/quantize_rows.py's row (explicit vectors, matvec's
bits): matvec's scalar kernel took ~4.5 us a full-size row (2048) on the calling thread, the
other threads waiting, twice a layer (a verify step: twice a layer and row). The product is ops.fp32_rows's, its rows forked over the threads
(fp32_rows.rows_share) from PRODUCT_FORK_THREADS threads on: each output the same bits as
prefill's product of the same input row, whatever the thread count. On one thread the router's
and gates' 55 MB of a full-size token (1 MB a layer for REAP-128's router) were ~4 ms that the
other threads waited through at 16 threads. At 2 threads too: the router alone ran ~60-100 us a
layer on the calling thread, long enough that the other thread went to sleep (libgomp's short
spin, jit/cpu.py) and the MoE's fork after it paid a wake-up; forked, the team stays awake.
Full-size reap128, 2 threads, one process, decode plans (the plan's steps with either kernel)
interleaved token by token, issue 29's session: 1.02x the calling thread's product at load ~1.5
(probe 24 GB/s, 40 rounds' median ratio), 1.05x at load ~4 (probe 8.4 GB/s), but 0.91-0.93x at
load ~5 with the probe at 5 GB/s, where each fork waits for a thread the scheduler gave to a
neighbour (decode was then above 100 % of that probe either way).

Letters: H hidden, R product rows, k experts per token.
"""

from __future__ import annotations

import numpy as np

from fermijit.jit import omp
from fermijit.ops import fp32_rows, gemm, quantize_rows, rmsnorm, router
from fermijit.ops.matvec import Q8Act

PRODUCT_FORK_THREADS = 2  # the product's rows go over the team from this many threads on


def reference(x, y, norm_w, eps, w, top_k=0):
    """x, y [1, H] fp32 (y None: no add), w [R, H] fp32 -> (new x, xn, p [1, R]) with p the
    float64 product, or (new x, xn, (ids, weights)) with top_k > 0."""
    x = x if y is None else (x + y).astype(np.float32)
    xn = rmsnorm.reference(x, norm_w, eps)
    p = xn.astype(np.float64) @ w.astype(np.float64).T
    return x, xn, (router.reference(p.astype(np.float32), top_k) if top_k else p)


def _step(x, y, add, norm_w, eps, xn, xq, dx, xsum8, offsets, w, p, ids, weights):
    # Row by row (a decode token: one; a verify step's few: ops/residual_rows.py), the product's
    # rows of w forked once for all of them (each thread's rows of w read from memory once).
    for r in range(x.shape[0]):
        x_r = x[r:r + 1]
        if add:
            y_r = y[r:r + 1]
            for j in range(x.shape[1]):
                x_r[0, j] = x_r[0, j] + y_r[0, j]
        rmsnorm._rmsnorm_serial(x_r, norm_w, eps, xn[r:r + 1])
        quantize_rows.quantize_row(xn, r, offsets, xq, dx, xsum8)
    if w.shape[0]:
        if omp.team_size() >= PRODUCT_FORK_THREADS:
            fork((xn, w, p))
        else:
            fp32_rows.rows_range(xn, w, p, 0, w.shape[0])
        if ids.shape[1]:
            router._route_tokens(p, ids, weights)  # every row's


# No fast-math: the product's sums keep fp32_rows' order (its share is compiled into this kernel).
_step_kernel = omp.forking_kernel(_step, fastmath=False, chunked=("fork",),
                                  fork=fp32_rows.rows_share)


NO_IDS = np.empty((1, 0), np.int32)
NO_WEIGHTS = np.empty((1, 0), np.float32)


def cpu(x, y, norm_w, eps, xn, act: Q8Act, w, p, ids=NO_IDS, weights=NO_WEIGHTS):
    """`reference` into preallocated buffers, for decode: x [1, H] updated in place (with y
    None, left as it is), xn [1, H], act a Q8Act of [1, H], p [1, R] the product (R = 0 with
    w [0, H]: none); with ids, weights [1, k], k > 0, p are routed into them. The caller (model/
    forward.py's decode) made every buffer once, of the right shapes and dtypes: only the
    kernel's signature checks them here."""
    kernel_, args = launch(x, y, norm_w, eps, xn, act, w, p, ids, weights)
    kernel_(*args)
    return act


def launch(x, y, norm_w, eps, xn, act: Q8Act, w, p, ids=NO_IDS, weights=NO_WEIGHTS):
    """`cpu`'s kernel and arguments, for a caller that repeats the call every token (model/
    forward.py's decode plan): (kernel, args)."""
    offsets = gemm.x_offsets(act.vec.isa, xn.shape[1] // 32)
    return _step_kernel(), (x, x if y is None else y, y is not None, norm_w, float(eps), xn,
                            act.xq, act.dx, act.xsum8, offsets, w, p, ids, weights)
