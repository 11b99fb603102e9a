"""One decode token of the Gated DeltaNet mixer between its projections (MODEL.md §6.2-6.8), as
one call: causal conv + SiLU over the mixed channels, the split into q | k | v, the L2 norms, the
gates, the delta-rule step, the gated RMSNorm, and the output quantised for out_proj.

Every stage is an existing op's kernel (ops.conv1d, l2norm, gated_delta, rmsnorm, matvec's
activation quantiser), called in the same order from one compiled function (one fork a layer:
each thread takes its key heads' channels and heads), so the result is the ops' one by one, bit
for bit (tests/ops/test_gdn_step.py), and decode pays one dispatch and one
set of argument checks a layer instead of nine: ~60 us of Python per GDN layer on the default
model's profile (`bench decode --profile`), ~2 ms a token on the 30 GDN layers of the real model.

Letters: C conv channels (q Hk·dk | k Hk·dk | v Hv·dv), Kc taps, Hk/Hv key/value heads.
"""

from __future__ import annotations

import numpy as np

from fermijit.jit import omp
from fermijit.jit.cpu import kernel
from fermijit.ops import conv1d, gated_delta, l2norm, matvec, rmsnorm
from fermijit.ops.matvec import Q8Act


def reference(mixed, z, a, b, conv_w, conv_state, A_log, dt_bias, norm_w, eps, l2_eps, state):
    """The stages' references in order -> (o [1, Hv, dv] fp32, new conv state, new state); the
    inputs are left untouched. mixed [1, C], z [1, Hv, dv], a/b [1, Hv]."""
    Hv, dk, dv = state.shape
    c, new_conv = conv1d.reference(mixed, conv_w, conv_state)
    nk = (c.shape[1] - Hv * dv) // 2
    q = l2norm.reference(c[:, :nk].reshape(1, -1, dk), l2_eps, 1 / np.sqrt(dk))
    k = l2norm.reference(c[:, nk:2 * nk].reshape(1, -1, dk), l2_eps)
    v = c[:, 2 * nk:].reshape(1, Hv, dv)
    g, beta = gated_delta.gates_reference(a, b, A_log, dt_bias)
    o, new_state = gated_delta.reference(q, k, v, g, beta, state)
    return rmsnorm.gated_reference(o, z, norm_w, eps), new_conv, new_state


def _step_body(mixed, z, a, b, conv_w, conv_state, A_log, dt_bias, norm_w, eps, l2_eps, q_scale,
               recurrent, q, k, v, g, beta, o, xq, dx, xsum8, lanes, step_blocks, half_lanes):
    gated_delta._gates(a, b, A_log, dt_bias, g, beta)
    deltas = np.empty((v.shape[1], v.shape[2]), np.float32)
    fork((mixed, conv_w, conv_state, l2_eps, q_scale, q, k, v, g, beta, recurrent, o, deltas, z,
          norm_w, eps, xq[0], dx[0], xsum8[0], lanes, step_blocks, half_lanes))
    if v.shape[2] % 32:  # a 32-block spans two heads (maybe two threads'): quantised here
        matvec._quantize_act_kernel(o.reshape(1, o.shape[1] * o.shape[2]), xq, dx, xsum8, lanes,
                                    step_blocks, half_lanes)


@kernel
def prepare_heads(mixed, conv_w, conv_state, q, k, v, l2_eps, q_scale, k0, k1):
    """Key heads [k0, k1) and their value heads of one token: the conv of their channels
    (mixed [1, C] in place, conv_state updated), q, k, v [1, H, d] copied out, q and k
    L2-normed (q scaled)."""
    Hk, dk = q.shape[1], q.shape[2]
    Hv, dv = v.shape[1], v.shape[2]
    nk, group = Hk * dk, Hv // Hk
    h0, h1 = k0 * group, k1 * group
    conv1d._conv_range(mixed, conv_w, conv_state, mixed, k0 * dk, k1 * dk)               # q
    conv1d._conv_range(mixed, conv_w, conv_state, mixed, nk + k0 * dk, nk + k1 * dk)     # k
    conv1d._conv_range(mixed, conv_w, conv_state, mixed, 2 * nk + h0 * dv, 2 * nk + h1 * dv)
    for h in range(k0, k1):  # row-major copies: an index divided per element cost ~100 us
        for i in range(dk):
            q[0, h, i] = mixed[0, h * dk + i]
            k[0, h, i] = mixed[0, nk + h * dk + i]
    for h in range(h0, h1):
        for i in range(dv):
            v[0, h, i] = mixed[0, 2 * nk + h * dv + i]
    l2norm._l2norm_serial(q[0, k0:k1], l2_eps, q_scale, q[0, k0:k1])
    l2norm._l2norm_serial(k[0, k0:k1], l2_eps, 1.0, k[0, k0:k1])


def _heads_share(thread, n_threads, args):
    # A thread's key heads and their value heads, from the conv to the gated RMSNorm and the
    # quantisation of their output blocks (where a head is whole 32-blocks): every channel and
    # head is one thread's (the same bits whatever the thread count), and nothing but the gates
    # waits on one thread (the quantiser of the whole output was ~7 us of a full-size layer on
    # one thread here).
    (mixed, conv_w, conv_state, l2_eps, q_scale, q, k, v, g, beta, recurrent, o, deltas, z,
     norm_w, eps, xq, dx, xsum8, lanes, step_blocks, half_lanes) = args
    Hk, Hv, dv = q.shape[1], v.shape[1], v.shape[2]
    group = Hv // Hk
    k0, k1 = thread * Hk // n_threads, (thread + 1) * Hk // n_threads
    h0, h1 = k0 * group, k1 * group
    prepare_heads(mixed, conv_w, conv_state, q, k, v, l2_eps, q_scale, k0, k1)
    for h in range(h0, h1):
        gated_delta._recurrent_head(q, k, v, g, beta, recurrent, o, deltas[h], h)
    rmsnorm._gated_serial(o[0, h0:h1], z[0, h0:h1], norm_w, eps, o[0, h0:h1])
    if dv % 32 == 0:  # the thread's heads are whole 32-blocks of the output: quantised here
        matvec.quantize_blocks(o[0].reshape(Hv * dv), xq, dx, xsum8, h0 * dv // 32,
                               h1 * dv // 32, lanes, step_blocks, half_lanes)


_step_kernel = omp.forking_kernel(_step_body, fork=_heads_share)


def cpu(mixed, z, a, b, conv_w, conv_state, A_log, dt_bias, norm_w, eps, l2_eps, recurrent,
        q, k, v, g, beta, o, act: Q8Act) -> Q8Act:
    """`reference` for decode, into preallocated buffers: o [1, Hv, dv] and its quantisation
    `act` (a Q8Act of [1, Hv·dv]); conv_state and recurrent updated in place, mixed overwritten
    (the conv's output). q, k [1, Hk, dk], v [1, Hv, dv], g, beta [1, Hv] are scratch. The
    caller (model/forward.py's decode) made every buffer once, of the right shapes and dtypes:
    only the kernel's signature checks them here."""
    kernel_, args = launch(mixed, z, a, b, conv_w, conv_state, A_log, dt_bias, norm_w, eps,
                           l2_eps, recurrent, q, k, v, g, beta, o, act)
    kernel_(*args)
    return act


def launch(mixed, z, a, b, conv_w, conv_state, A_log, dt_bias, norm_w, eps, l2_eps, recurrent,
           q, k, v, g, beta, o, act: Q8Act):
    """`cpu`'s kernel and arguments, for a caller that repeats the call every token (model/
    forward.py's decode plan): (kernel, args)."""
    v_ = act.vec
    half = matvec.simd.HALF_OF.get(v_.isa)
    return _step_kernel(), (mixed, z, a, b, conv_w, conv_state, A_log, dt_bias, norm_w,
                            float(eps), float(l2_eps), float(1 / np.sqrt(q.shape[2])), recurrent,
                            q, k, v, g, beta, o, act.xq, act.dx, act.xsum8, v_.lanes,
                            matvec.blocks_per_step(v_), half.lanes if half else 0)

