"""The delta-rule recurrence for prompts (gated_delta.cpu with T > 1): the token loop's result bit
for bit, in one sweep of each head's state per token instead of two.

The token loop (gated_delta._recurrent_head, decode's too) sweeps the [dk, dv] state twice per
token: once for Sᵀk and Sᵀq, accumulated in two dv-long rows in memory (a load and a store of each
per multiply-add), once for S <- αS + kδᵀ. Here token t's sweep first applies token t-1's update
to a row of S, stores it, and accumulates that new row into Sᵀk_t and Sᵀq_t held in registers,
over columns in blocks of 4 vectors (`_make_sweep`, LLVM IR). Every value is computed by the same
fp32 operations in the same order as the token loop (products, then sums; no fused multiply-add),
so the results are its bits. Why not the chunked (UT/WY) form: on this CPU the token loop ran at
~60 % of the FP peak and the chunked form needs ~1.4x its multiply-adds (gated_delta_chunk.cpu,
numpy's batched products: 70 ms against 23 ms at T = 512, 32 heads of 128x128, 1 thread).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from fermijit.jit import omp, simd
from fermijit.jit.cpu import Isa, bind, kernel
from fermijit.jit.simd import F32, I64, vec
from fermijit.ops.gemm import prefetch_bytes

# A head's q, k, v and o rows of the token this many steps ahead are prefetched: inside the
# forward they were not in cache (the default model's 512-token prefill 1.02-1.05x, 1 thread).
PREFETCH_TOKENS = 2
VECTORS = 4  # vectors of columns per block: 2·4 accumulators + 4 state vectors in registers


def _make_sweep(lanes: int):
    """sweep(S, j0, k_prev, d_prev, a_prev, has_prev, k_t, q_t, acc_d, acc_o) over columns
    j0..j0+4·lanes-1 of S [dk, dv]: with has_prev, S[i] <- a_prev·S[i] + k_prev[i]·d_prev first;
    acc_d = Σ_i S[i]·k_t[i], acc_o = Σ_i S[i]·q_t[i] (i in order)."""
    width = VECTORS * lanes

    @intrinsic
    def sweep(typingctx, S, j0, k_prev, d_prev, a_prev, has_prev, k_t, q_t, acc_d, acc_o):
        sig = types.none(S, j0, k_prev, d_prev, a_prev, has_prev, k_t, q_t, acc_d, acc_o)

        def codegen(context, builder, sig, args):
            s_a, kp_a, dp_a, kt_a, qt_a, ad_a, ao_a = (
                context.make_array(sig.args[i])(context, builder, args[i])
                for i in (0, 2, 3, 6, 7, 8, 9))
            j0v, a_prev, has_prev = args[1], args[4], args[5]
            c = lambda n: ir.Constant(I64, n)  # noqa: E731
            vf = vec(F32, lanes)
            dk = builder.extract_value(s_a.shape, 0)
            row_bytes = builder.extract_value(s_a.strides, 0)
            col = builder.mul(j0v, c(4))
            scalar = lambda arr, i: simd.load_scalar(builder, arr.data,  # noqa: E731
                                                     builder.mul(i, c(4)), F32)
            acc = [[cgutils.alloca_once_value(builder, ir.Constant(vf, None))
                    for _ in range(VECTORS)] for _ in range(2)]
            d_old = [simd.load(builder, dp_a.data, builder.add(col, c(4 * lanes * u)), vf)
                     for u in range(VECTORS)]
            a_v = simd.splat(builder, a_prev, lanes)

            def rows(update: bool):
                with cgutils.for_range(builder, dk) as loop:
                    i = loop.index
                    base = builder.add(builder.mul(i, row_bytes), col)
                    kp = simd.splat(builder, scalar(kp_a, i), lanes) if update else None
                    kt = simd.splat(builder, scalar(kt_a, i), lanes)
                    qt = simd.splat(builder, scalar(qt_a, i), lanes)
                    for u in range(VECTORS):
                        off = builder.add(base, c(4 * lanes * u))
                        s = simd.load(builder, s_a.data, off, vf)
                        if update:  # α S + k δ, as the token loop's second sweep
                            s = builder.fadd(builder.fmul(a_v, s), builder.fmul(kp, d_old[u]))
                            builder.store(s, builder.bitcast(
                                simd.byte_ptr(builder, s_a.data, off), vf.as_pointer()), align=1)
                        for which, x in ((0, kt), (1, qt)):
                            slot = acc[which][u]
                            builder.store(builder.fadd(builder.load(slot), builder.fmul(s, x)),
                                          slot)

            with builder.if_else(builder.icmp_signed("!=", has_prev, c(0))) as (then, otherwise):
                with then:
                    rows(True)
                with otherwise:
                    rows(False)
            for which, arr in ((0, ad_a), (1, ao_a)):
                for u in range(VECTORS):
                    dst = simd.byte_ptr(builder, arr.data, builder.add(col, c(4 * lanes * u)))
                    builder.store(builder.load(acc[which][u]),
                                  builder.bitcast(dst, vf.as_pointer()), align=1)
            return context.get_dummy_value()

        return sig, codegen

    return sweep, width


@kernel(fastmath=False)
def _dot(a, b):
    """Σ a[i]·b[i] in order (the token loop's k·q: no reassociation, so its bits)."""
    total = np.float32(0)
    for i in range(a.size):
        total += a[i] * b[i]
    return total


@kernel(fastmath=False)
def _dots(k, q, hk, out):
    """out[t] = Σ_i k[t, hk, i]·q[t, hk, i], each in order (_dot's bits), 4 tokens at a time: their
    chains of dependent additions interleave (one token's alone is ~4 cycles an element)."""
    T = k.shape[0]
    t = 0
    while t + 4 <= T:
        k0, k1, k2, k3 = k[t, hk], k[t + 1, hk], k[t + 2, hk], k[t + 3, hk]
        q0, q1, q2, q3 = q[t, hk], q[t + 1, hk], q[t + 2, hk], q[t + 3, hk]
        s0 = s1 = s2 = s3 = np.float32(0)
        for i in range(k.shape[2]):
            s0 += k0[i] * q0[i]
            s1 += k1[i] * q1[i]
            s2 += k2[i] * q2[i]
            s3 += k3[i] * q3[i]
        out[t], out[t + 1], out[t + 2], out[t + 3] = s0, s1, s2, s3
        t += 4
    for t in range(t, T):
        out[t] = _dot(k[t, hk], q[t, hk])


def _head(q, k, v, g, beta, state, o, h, d_prev, acc_d, acc_o, kqs):
    """Value head h over the tokens; d_prev, acc_d, acc_o [dv], kqs [T] scratch."""
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    hk = h // (Hv // Hk)
    S = state[h]
    whole = dv // COLS * COLS
    a_prev = np.float32(1)
    _dots(k, q, hk, kqs)
    for t in range(T):
        if t + PREFETCH_TOKENS < T:  # this head's rows of a later token (1 KiB apart or more)
            n = t + PREFETCH_TOKENS
            k0, v0 = (n * Hk + hk) * dk * 4, (n * Hv + h) * dv * 4
            prefetch_bytes(k, k0, k0 + dk * 4)
            prefetch_bytes(q, k0, k0 + dk * 4)
            prefetch_bytes(v, v0, v0 + dv * 4)
            prefetch_bytes(o, v0, v0 + dv * 4)
        k_t, q_t = k[t, hk], q[t, hk]
        k_prev = k[max(t - 1, 0), hk]
        kq = kqs[t]
        alpha = np.exp(g[t, h])
        for j0 in range(0, whole, COLS):
            sweep(S, j0, k_prev, d_prev, a_prev, t, k_t, q_t, acc_d, acc_o)
        for j in range(whole, dv):  # the columns past whole blocks, one at a time, alike
            sd = np.float32(0)
            so = np.float32(0)
            for i in range(dk):
                s = S[i, j]
                if t > 0:
                    s = a_prev * s + k_prev[i] * d_prev[j]
                    S[i, j] = s
                sd += s * k_t[i]
                so += s * q_t[i]
            acc_d[j] = sd
            acc_o[j] = so
        b_t, v_t, o_t = beta[t, h], v[t, h], o[t, h]
        for j in range(dv):
            d_prev[j] = b_t * (v_t[j] - alpha * acc_d[j])
            o_t[j] = alpha * acc_o[j] + kq * d_prev[j]
        a_prev = alpha
    k_last = k[T - 1, hk]
    for i in range(dk):  # the last token's update
        s_i, k_i = S[i], k_last[i]
        for j in range(dv):
            s_i[j] = a_prev * s_i[j] + k_i * d_prev[j]


def _share(thread, n_threads, args):
    """A thread's run of value heads, each by one thread whatever the thread count."""
    q, k, v, g, beta, state, o = args
    Hv, dv = v.shape[1], v.shape[2]
    scratch = np.empty((3, dv), np.float32)
    kqs = np.empty(q.shape[0], np.float32)
    for h in range(thread * Hv // n_threads, (thread + 1) * Hv // n_threads):
        head(q, k, v, g, beta, state, o, h, scratch[0], scratch[1], scratch[2], kqs)


def _body(q, k, v, g, beta, state, o):
    fork((q, k, v, g, beta, state, o))


_kernels: dict = {}


def _kernel(isa: Isa):
    """The launch for `isa`'s vector width, made on first use."""
    if isa not in _kernels:
        lanes = simd.VEC_OF[isa].nbytes // 4
        sweep, width = _make_sweep(lanes)
        threads = "omp" if omp.available() else "serial"
        variant = f"gdn-prefill-{isa.label}-{threads}"
        # No fast-math: reassociation could reorder the column sums, which are the token
        # loop's in order.
        head = kernel(_head, fastmath=False, variant=variant, sweep=sweep, COLS=width)
        _kernels[isa] = kernel(_body, variant=variant,
                               fork=omp.fork(bind(_share, variant, head=head)))
    return _kernels[isa]


def run(q, k, v, g, beta, state, o, isa: Isa) -> None:
    """The recurrence over T >= 1 tokens (inputs checked by gated_delta.cpu), state in place."""
    _kernel(isa)(q, k, v, g, beta, state, o)
