"""R consecutive decode tokens of one sequence through the Gated DeltaNet mixer between its
projections (a speculative verify step's rows, model/batch.py), as one call: row r is
ops.gdn_step on the state row r-1 left, bit for bit, and the state after each row lands where the
caller says (the last row's: the live state; the others': the step's saves, which a rollback
returns to), or, for 2 rows, the last row is left pending.

Row by row through gdn_step, a verify step of 2 rows forked 3 times a GDN layer (2 steps and the
save of the state after the first) and swept the 2 MB recurrent state 3 times from memory. Here
each thread takes gdn_step's heads for every row (one fork), and per value head runs the rows in
turn, the head's 64 KB of state staying in the thread's cache between them: row r reads its
source's head and writes the updated head to its destination (gated_delta's delta rule with
the source and destination apart, the same operations in the same order; the conv, L2 norms and
gated RMSNorm are gdn_step's own routines, in its order), so the state is read from memory once
and each row's written once; row r's write sweep also makes row r+1's read sweep
(`_recurrent_rows_head`: R + 1 sweeps of a head, not 2R). 30 full-size layers, cold, 2 threads:
2 rows 1.98x one row's time (2.27x with a head's rows one after another), the saves' writes
~2 ms of it (scratch measurement, load ~2).

Two rows (one draft, the default) take `_recurrent_pair_head`, the lazy row: the state after
row 0 (S1) is written over the live state and row 1's rank-1 update (S2 = alpha_1 S1 + k_1
d_1^T) is not applied but kept, a few KB, as the layer's `Pending` record. Rejecting row 1 (the
common rollback) is then dropping the record; keeping it, the next verify step applies it as
its first sweep reads the head (S2's bits), and every other reader of the state applies it first
(`Pending.settle`, through model/state.py GdnState.recurrent). So the state traffic of the step
is a token's: read once, written once (it was read once and written twice, S1 streamed to a
save). 30 full-size layers cold, 2 threads, against a token's gdn_step, 6 interleaved fresh
processes each (a scratch benchmark, medians): the pair that saved S1 2.01x, the lazy row 1.65x
(1.73x applying a pending row, in the first sweep: in a sweep of its own first it was ~0.2x
more). Full-size
reap128, 2 threads, `bench decode --speculative mtp` (its random head's drafts all rejected: no
row pending), 32 interleaved fresh-process rounds against the pair that saved S1 (load 0.2-3):
the GDN rows 2.00x -> 1.70x a token's GDN step (5.4 -> 4.5 ms), the verify step 1.365x ->
1.355x a token (medians; the rounds' ratios swing 1.31-1.77 with the machine's bandwidth).
The rest over a token's is compute (one layer's state in cache, tests/verify_rows_probe.py:
the rows ~1.5x a token's step).

    state_0 = src                     (the live state at the step's start)
    row r:   dst[r] = gdn_step(row r's inputs, state_r), state_{r+1} = dst[r]

with dst[r] the saves' r-th for r < R-1 and the live state for the last (src[r] = dst[r-1]);
for the lazy row, dst[0] the live state and dst[1] the record.

Letters: as ops/gdn_step.py; R rows.
"""

from __future__ import annotations

import numpy as np

from fermijit import FermijitError
from fermijit.jit import omp
from fermijit.jit.cpu import kernel
from fermijit.ops import gated_delta, gdn_step, matvec, rmsnorm


def reference(mixed, z, a, b, conv_w, conv_state, A_log, dt_bias, norm_w, eps, l2_eps, state):
    """gdn_step.reference row by row: mixed [R, C], z [R, Hv, dv], a/b [R, Hv] -> (o [R, Hv, dv],
    the conv states after each row [R, C, Kc-1], the recurrent states after each row
    [R, Hv, dk, dv]); the inputs are left untouched."""
    outs, convs, states = [], [], []
    for r in range(mixed.shape[0]):
        o, conv_state, state = gdn_step.reference(
            mixed[r:r + 1], z[r:r + 1], a[r:r + 1], b[r:r + 1], conv_w, conv_state, A_log,
            dt_bias, norm_w, eps, l2_eps, state)
        outs.append(o[0])
        convs.append(conv_state)
        states.append(state)
    return np.stack(outs), np.stack(convs), np.stack(states)


def _rows_body(mixed, z, a, b, conv_w, conv_src, conv_dst, A_log, dt_bias, norm_w, eps, l2_eps,
               q_scale, rec_src, rec_dst, is_lazy, pending, pending_set, q, k, v, g, beta, o,
               xq, dx, xsum8, lanes, step_blocks, half_lanes):
    for r in range(len(mixed)):
        gated_delta._gates(a[r], b[r], A_log, dt_bias, g[r:r + 1], beta[r:r + 1])
    deltas = np.empty((v.shape[1], 2, v.shape[2]), np.float32)
    is_pending = is_lazy and pending_set[0] != 0
    fork((mixed, conv_w, conv_src, conv_dst, l2_eps, q_scale, q, k, v, g, beta, rec_src, rec_dst,
          o, deltas, z, norm_w, eps, is_lazy, pending, is_pending, xq, dx, xsum8, lanes,
          step_blocks, half_lanes))
    if is_lazy:
        pending_set[0] = 1
    if v.shape[2] % 32:  # a 32-block spans two heads (maybe two threads'): quantised here
        for r in range(len(mixed)):
            o_r = o[r]
            matvec._quantize_act_kernel(o_r.reshape(1, o_r.shape[1] * o_r.shape[2]), xq[r],
                                        dx[r], xsum8[r], lanes, step_blocks, half_lanes)


@kernel
def _recurrent_rows_head(q, k, v, g, beta, src, dst, o, delta, h):
    """gated_delta._recurrent_head of value head h for each row in turn, row r from src[r] into
    dst[r] (src[r] = dst[r-1]), each value by the same operations in the same order (so dst[r] is
    what the in-place update leaves, bit for bit). Row r's write sweep also makes row r+1's read
    sweep (S^T k, S^T q) from each value as it is written: a head takes R + 1 sweeps of its
    state, not 2R. q, k [R, Hk, dk], v [R, Hv, dv], g, beta [R, Hv]; o per row [1, Hv, dv];
    delta [2, dv] scratch. (src and dst apart: one array in place cost decode's gdn_step 1.8x,
    the stores no longer known not to alias the loads.)"""
    R, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    hk = h // (Hv // Hk)
    kq = gated_delta.read_sweep(src[0][h], k[0, hk], q[0, hk], delta[0], o[0][0, h])
    for r in range(R):
        alpha = np.exp(g[r, h])
        d, o_t = delta[r % 2], o[r][0, h]
        for j in range(dv):
            d[j] = beta[r, h] * (v[r, h, j] - alpha * d[j])
            o_t[j] = alpha * o_t[j] + kq * d[j]
        S, D = src[r][h], dst[r][h]
        if r + 1 == R:
            for i in range(dk):
                k_i = k[r, hk, i]
                for j in range(dv):
                    D[i, j] = alpha * S[i, j] + k_i * d[j]
            break
        d1, o1 = delta[(r + 1) % 2], o[r + 1][0, h]
        d1[:] = 0
        o1[:] = 0
        kq = np.float32(0)
        for i in range(dk):
            k_i = k[r, hk, i]
            k1 = k[r + 1, hk, i]
            q1 = q[r + 1, hk, i]
            kq += k1 * q1
            for j in range(dv):
                x = alpha * S[i, j] + k_i * d[j]
                D[i, j] = x
                d1[j] += x * k1                                             # next row's S^T k
                o1[j] += x * q1                                             # and S^T q


class Pending:
    """A verify step's last row not applied to its GDN layer's recurrent state yet (the lazy
    row, `_recurrent_pair_head`): S <- alpha S + k d^T per value head h, alpha = exp(g) [Hv],
    k the row's L2-normed keys [Hk, dk] (head h takes key head h // (Hv / Hk)), d its delta
    [Hv, dv]; `is_set` [1] whether it holds an update not applied (set by the verify step,
    cleared by `settle` and by a rollback of the row, model/batch.py)."""

    def __init__(self, Hk: int, Hv: int, dk: int, dv: int):
        f = np.float32
        self.alpha, self.k, self.d = np.zeros(Hv, f), np.zeros((Hk, dk), f), np.zeros((Hv, dv), f)
        self.is_set = np.zeros(1, np.int32)

    def settle(self, state) -> None:
        """Apply the row to `state` [Hv, dk, dv] in place (once: then cleared)."""
        if self.is_set[0]:
            _settle_kernel()(state, self.alpha, self.k, self.d, self.is_set)


_NO_PENDING = Pending(0, 0, 0, 0)  # the arguments of a call without the lazy row


@kernel
def _pending_head(state, alpha, k, d, h):
    """Value head h of `state` <- alpha_h S + k d_h^T: the pending row's update (Pending.settle),
    by gated_delta._recurrent_head's last sweep's operations in its order (the same bits)."""
    hk = h // (state.shape[0] // k.shape[0])
    gated_delta.write_sweep(state[h], alpha[h], k[hk], d[h])


def _settle_share(thread, n_threads, args):
    state, alpha, k, d = args
    Hv = state.shape[0]
    for h in range(thread * Hv // n_threads, (thread + 1) * Hv // n_threads):
        _pending_head(state, alpha, k, d, h)


def _settle_body(state, alpha, k, d, is_set):
    fork((state, alpha, k, d))
    is_set[0] = 0


_settle_kernel = omp.forking_kernel(_settle_body, fork=_settle_share)


@kernel
def _recurrent_pair_head(q, k, v, g, beta, state, o_0, o_1, delta, h, pending, is_pending):
    """`_recurrent_rows_head` of 2 rows (a verify step of one draft) in place, the last row
    lazy (module docstring): `state` is left after row 0 (S1 = alpha_0 S0 + k_0 d_0^T, what a
    rollback of row 1 returns to) and row 1's update in `pending` ((alpha, d) of Pending
    written here; its k by the caller, once the key head's value heads have read the old one).
    With is_pending, the previous step's pending row is applied as the first sweep reads the
    head (written back: `_pending_head`'s operations, S2's bits). o_0, o_1 [1, Hv, dv] the
    rows' outputs; delta [2, dv]: d_0, d_1."""
    Hk = q.shape[1]
    Hv, dv = v.shape[1], v.shape[2]
    hk = h // (Hv // Hk)
    p_alpha, p_k, p_d = pending
    S = state[h]                                                            # [dk, dv]
    d0, d1 = delta[0], delta[1]
    o0, o1 = o_0[0, h], o_1[0, h]
    if is_pending:  # the pending row applied as the head is read (_pending_head's operations)
        kq = gated_delta.write_read_sweep(S, p_alpha[h], p_k[hk], p_d[h], k[0, hk], q[0, hk],
                                          d0, o0)                           # S^T k, S^T q
    else:
        kq = gated_delta.read_sweep(S, k[0, hk], q[0, hk], d0, o0)
    alpha0 = np.exp(g[0, h])
    for j in range(dv):
        d0[j] = beta[0, h] * (v[0, h, j] - alpha0 * d0[j])
        o0[j] = alpha0 * o0[j] + kq * d0[j]
    # S1 over S0; S1^T k, S1^T q
    kq = gated_delta.write_read_sweep(S, alpha0, k[0, hk], d0, k[1, hk], q[1, hk], d1, o1)
    alpha1 = np.exp(g[1, h])
    for j in range(dv):
        d1[j] = beta[1, h] * (v[1, h, j] - alpha1 * d1[j])
        o1[j] = alpha1 * o1[j] + kq * d1[j]
    p_alpha[h] = alpha1
    p_d[h] = d1


def _rows_share(thread, n_threads, args):
    # gdn_step._heads_share's channels and heads for each row, the rows of a head in turn, then
    # each row's gated norm and quantisation of the thread's heads (one thread quantising both
    # rows' whole outputs after the fork was ~14 us of a full-size layer).
    (mixed, conv_w, conv_src, conv_dst, l2_eps, q_scale, q, k, v, g, beta, rec_src, rec_dst, o,
     deltas, z, norm_w, eps, is_lazy, pending, is_pending, xq, dx, xsum8, lanes, step_blocks,
     half_lanes) = args
    Hk, dk = q.shape[1], q.shape[2]
    Hv, dv = v.shape[1], v.shape[2]
    nk, group = Hk * dk, Hv // Hk
    k0, k1 = thread * Hk // n_threads, (thread + 1) * Hk // n_threads
    h0, h1 = k0 * group, k1 * group
    R = len(mixed)
    for r in range(R):
        m, cs, cd = mixed[r], conv_src[r], conv_dst[r]
        q_r, k_r, v_r = q[r:r + 1], k[r:r + 1], v[r:r + 1]
        for lo, hi in ((k0 * dk, k1 * dk), (nk + k0 * dk, nk + k1 * dk),
                       (2 * nk + h0 * dv, 2 * nk + h1 * dv)):
            cd[lo:hi] = cs[lo:hi]
        gdn_step.prepare_heads(m, conv_w, cd, q_r, k_r, v_r, l2_eps, q_scale, k0, k1)
    for h in range(h0, h1):
        if is_lazy:
            _recurrent_pair_head(q, k, v, g, beta, rec_src[0], o[0], o[R - 1], deltas[h], h,
                                 pending, is_pending)
            if (h + 1) % group == 0:  # the key head's value heads have read the old pending k
                pending[1][h // group] = k[1, h // group]
        else:
            _recurrent_rows_head(q, k, v, g, beta, rec_src, rec_dst, o, deltas[h], h)
    for r in range(R):
        o_r, z_r = o[r], z[r]
        rmsnorm._gated_serial(o_r[0, h0:h1], z_r[0, h0:h1], norm_w, eps, o_r[0, h0:h1])
        if dv % 32 == 0:  # the thread's heads' blocks of each row's output (as gdn_step's)
            matvec.quantize_blocks(o_r[0].reshape(Hv * dv), xq[r][0], dx[r][0], xsum8[r][0],
                                   h0 * dv // 32, h1 * dv // 32, lanes, step_blocks, half_lanes)


_rows_kernel = omp.forking_kernel(_rows_body, fork=_rows_share)


class Scratch:
    """The per-row q, k, v, gates of a call of R rows, made once (a verify step's plan)."""

    def __init__(self, n_rows: int, Hk: int, Hv: int, dk: int, dv: int):
        f = np.float32
        self.q, self.k = np.empty((n_rows, Hk, dk), f), np.empty((n_rows, Hk, dk), f)
        self.v = np.empty((n_rows, Hv, dv), f)
        self.g, self.beta = np.empty((n_rows, Hv), f), np.empty((n_rows, Hv), f)


def launch(mixed, z, a, b, conv_w, conv_src, conv_dst, A_log, dt_bias, norm_w, eps, l2_eps,
           rec_src, rec_dst, scratch: Scratch, o, acts, pending: Pending | None = None):
    """The call's kernel and arguments, for a caller that repeats it (model/batch.py's verify
    plan): (kernel, args). Per row r, in lists of R: mixed [1, C] (overwritten by the conv), z
    [1, Hv, dv], a, b [1, Hv], o [1, Hv, dv] and `acts` (Q8Acts of [1, Hv·dv]) its output, the
    conv and recurrent states it starts from (src: the live state for row 0, else row r-1's
    dst) and where its state goes (dst). With `pending` (2 rows; rec_src [live], rec_dst
    [live]: the lazy row), the live recurrent state, after `pending`'s row where it is set, is
    left after row 0 and row 1's update in `pending` (set). Every array C-contiguous, as
    gdn_step's."""
    R = len(mixed)
    lists = dict(mixed=mixed, z=z, a=a, b=b, conv_src=conv_src, conv_dst=conv_dst,
                 rec_src=rec_src, rec_dst=rec_dst, o=o, acts=acts)
    n_rec = 1 if pending is not None else R
    if (any(len(v) != (n_rec if k.startswith("rec") else R) for k, v in lists.items())
            or R == 0 or scratch.q.shape[0] != R or (pending is not None and R != 2)):
        raise FermijitError(f"gdn_rows: rows differ: {({k: len(v) for k, v in lists.items()})}, "
                            f"scratch of {scratch.q.shape[0]}"
                            f"{', a lazy row' if pending is not None else ''}")
    for name in ("mixed", "z", "a", "b", "conv_src", "conv_dst", "rec_src", "rec_dst", "o"):
        if not all(x.flags.c_contiguous for x in lists[name]):
            raise FermijitError(f"gdn_rows: {name} rows must be C-contiguous")
    if pending is not None and rec_src[0] is not rec_dst[0]:
        raise FermijitError("gdn_rows: a lazy row's state is updated in place (rec_src is rec_dst)")
    p = _NO_PENDING if pending is None else pending
    v_ = acts[0].vec
    half = matvec.simd.HALF_OF.get(v_.isa)
    return _rows_kernel(), (
        tuple(mixed), tuple(z), tuple(a), tuple(b), conv_w, tuple(conv_src), tuple(conv_dst),
        A_log, dt_bias, norm_w, float(eps), float(l2_eps),
        float(1 / np.sqrt(scratch.q.shape[2])), tuple(rec_src), tuple(rec_dst),
        pending is not None, (p.alpha, p.k, p.d), p.is_set, scratch.q,
        scratch.k, scratch.v, scratch.g, scratch.beta, tuple(o), tuple(x.xq for x in acts),
        tuple(x.dx for x in acts), tuple(x.xsum8 for x in acts), v_.lanes,
        matvec.blocks_per_step(v_), half.lanes if half else 0)


def cpu(mixed, z, a, b, conv_w, conv_src, conv_dst, A_log, dt_bias, norm_w, eps, l2_eps,
        rec_src, rec_dst, scratch: Scratch, o, acts, pending: Pending | None = None):
    """`launch`'s call, run once."""
    kernel_, args = launch(mixed, z, a, b, conv_w, conv_src, conv_dst, A_log, dt_bias, norm_w,
                           eps, l2_eps, rec_src, rec_dst, scratch, o, acts, pending)
    kernel_(*args)
    return acts
