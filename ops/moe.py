"""The MoE feed-forward of every layer (MODEL.md §4): routed SwiGLU experts plus the shared
expert scaled by its sigmoid gate.

    E_e(x) = Wd[e] · (silu(g) ⊙ u),  [g; u] = Wgu[e] · x
    MoE(x) = Σ_k w_k · E_{ids_k}(x) + σ(w_sg · x) · S(x)

Letters: T tokens, k experts per token, E experts, H hidden, I expert intermediate, Is shared
intermediate. Weights are Q4_0 (ops.quant); the shared expert is stored as one more expert
tensor of its own ([1, ...]), so it is "the routed op with E = 1" (ops.expert_matmul).

`reference` is the fp32-activation spec (ops.expert_matmul.reference, twice). `cpu` is W4A8:
decode (T = 1) runs the selected experts and the shared one in one dispatch (a gate_up launch with
the SwiGLU and its quantisation in its shares, then a down launch with the combination:
`_fused_body`); a speculative verify step's few tokens, the union of their experts, each read
once (`rows_launch`); CPU prefill (T > 1) sorts the tokens by expert once (a counting sort) and runs
each projection of all experts as one grouped GEMM launch (matvec.grouped).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
from numba import prange

from fermijit import FermijitError
from fermijit.jit.checks import check_array, output
from fermijit.jit import mathf, omp
from fermijit.jit import simd
from fermijit.jit.cpu import bind, decode_isa, kernel
from fermijit.ops import expert_matmul, matvec
from fermijit.ops.gemm import prefetch_bytes
from fermijit.ops.matvec import Q8Act


@dataclass(frozen=True)
class MoeWeights:
    gate_up_qs: np.ndarray         # [E, 2I, H/2] uint8, rows 0..I-1 gate, I..2I-1 up
    gate_up_d: np.ndarray          # [E, 2I, H/32] float16
    down_qs: np.ndarray            # [E, H, I/2] uint8
    down_d: np.ndarray             # [E, H, I/32] float16
    shared_gate_up_qs: np.ndarray  # [1, 2Is, H/2]
    shared_gate_up_d: np.ndarray   # [1, 2Is, H/32]
    shared_down_qs: np.ndarray     # [1, H, Is/2]
    shared_down_d: np.ndarray      # [1, H, Is/32]
    shared_gate: np.ndarray        # [H] float32: σ(shared_gate · x) scales S(x)

    def __post_init__(self):
        _check_weights(self)

    @cached_property
    def d_bits(self):
        """The four scale tensors' bits as uint16 (gate_up, shared gate_up, down, shared down),
        as the gathered launches take them: viewed once, not per token."""
        return tuple(d.view(np.uint16) for d in (self.gate_up_d, self.shared_gate_up_d,
                                                 self.down_d, self.shared_down_d))

    @property
    def routed(self):
        return self.gate_up_qs, self.gate_up_d, self.down_qs, self.down_d

    @property
    def shared(self):
        return self.shared_gate_up_qs, self.shared_gate_up_d, self.shared_down_qs, self.shared_down_d


def _shared_gate(x, w_sg):
    return 1.0 / (1.0 + np.exp(-(x.astype(np.float64) @ w_sg.astype(np.float64))))  # [T]


def reference(x, ids, weights, w: MoeWeights):
    """x [T, H] fp32, ids [T, k] int32, weights [T, k] fp32 -> [T, H] fp32."""
    routed = expert_matmul.reference(x, ids, weights, *w.routed).astype(np.float64)
    n_tok = x.shape[0]
    gate = _shared_gate(x, w.shared_gate)[:, None].astype(np.float32)
    shared = expert_matmul.reference(x, np.zeros((n_tok, 1), np.int32), gate, *w.shared)
    return (routed + shared).astype(np.float32)


# --- cpu ----------------------------------------------------------------------------------------

@kernel
def swiglu_range(gu_i, h_i, j0, j1):
    """h_i[j] = silu(g[j]) · u[j] for j in [j0, j1), gu_i = [g | u] one row: every SwiGLU of
    this module calls it (decode's fused gate_up share on its 32-blocks too), so every path has
    the same bits."""
    n_inter = h_i.size
    # Row views: with 2-D indices LLVM left this loop scalar (4 ns per element at full size).
    g, u = gu_i[:n_inter], gu_i[n_inter:]
    for j in range(j0, j1):
        h_i[j] = mathf.silu(g[j]) * u[j]


def _swiglu_body(gu, h):  # gu [n, 2I] -> h [n, I]
    for i in prange(h.shape[0]):
        swiglu_range(gu[i], h[i], 0, h.shape[1])


# One body twice: decode's few rows on one thread, prefill's rows on all threads.
_swiglu = kernel(_swiglu_body)
_swiglu_rows = kernel(parallel=True, variant="parallel")(_swiglu_body)


@kernel
def _shared_gate_kernel(x, w_sg):
    """σ(w_sg · x), the dot product in float64, as `reference` computes it."""
    dot = 0.0
    for j in range(x.size):
        dot += np.float64(x[j]) * np.float64(w_sg[j])
    return np.float32(1.0 / (1.0 + np.exp(-dot)))


# The down shares' claimed runs are whole multiples of this many rows (times ROWS): their fp32
# outputs (each matrix's rows, the combination) then fill whole cache lines, never one line
# written by two threads' adjacent runs, and the last runs are not a few rows each. Claims forced
# on 2 threads (omp.set_dynamic(from_team=1); teams that small take static runs by default), the
# fused MoE's 40 full-size layers cold in a fast-bandwidth phase: 13.35-13.38 -> 12.68-12.73 ms
# (static 10.4-10.7); for the 16-thread teams that claim.
LINE_ROWS = 16


@kernel(fastmath=False)
def _weighted_range(routed, weights, shared, gate, y, j0, j1):
    """y[j0:j1] = gate · shared + weights[0] · routed[0] + weights[1] · routed[1] + ..., in
    that order for every element: a row at a time (vectorised along it; the experts' sum per
    element as one dependent chain cost ~4x as long, 9 rows of 2048 on this machine). Each
    element's bits whatever the range (no fast-math: no reordering, no contraction)."""
    for j in range(j0, j1):
        y[j] = gate * shared[j]
    for i in range(weights.size):
        w_i, r_i = weights[i], routed[i]
        for j in range(j0, j1):
            y[j] = y[j] + w_i * r_i[j]


@kernel
def _combine(routed, weights, shared, x, w_sg, y):
    """y = Σ_k weights[k] · routed[k] + σ(w_sg · x) · shared; routed [k, H], shared [H]."""
    _weighted_range(routed, weights, shared, _shared_gate_kernel(x, w_sg), y, 0, y.size)


@dataclass
class Scratch:
    """Decode's buffers for one layer shape, made once: per-token MoE allocates nothing (and
    the last prefill pass's, `prefill`, made by that pass). The shared expert has buffers of its
    own (its intermediate size Is may differ from the routed experts' I, as in the default
    model) but rides in the routed experts' two launches; its down output is row k of
    `routed`."""

    gu: np.ndarray         # [k, 2I]
    h: np.ndarray          # [k, I]
    routed: np.ndarray     # [k + 1, H]
    shared_gu: np.ndarray  # [1, 2Is]
    shared_h: np.ndarray   # [1, Is]
    act_x: Q8Act | None = None  # made by the first call, reused after
    act_h: Q8Act | None = None
    act_sh: Q8Act | None = None
    prefill: "PrefillBuffers | None" = None  # the last prefill pass's, reused by the next

    @classmethod
    def make(cls, w: MoeWeights, top_k: int) -> "Scratch":
        two_i, hidden = w.gate_up_d.shape[1], w.down_d.shape[1]
        two_is = w.shared_gate_up_d.shape[1]
        f = np.float32
        return cls(np.empty((top_k, two_i), f), np.empty((top_k, two_i // 2), f),
                   np.empty((top_k + 1, hidden), f), np.empty((1, two_is), f),
                   np.empty((1, two_is // 2), f))


def _gate_up_share(thread, n_threads, args, counter):
    """A thread's runs of 32-blocks of h (claimed while any are left: jit.omp.first_run), in
    (matrix, block) order over the routed experts then the shared one (its own buffers: its
    intermediate size may differ): each block's 32 gate rows and 32 up rows side by side (the
    GEMV tile's two streams, gate row j beside up row I + j; one at a time where the tile takes
    one row), then that block's SwiGLU and its quantisation for the down projection. Where the
    tile takes 4 rows (`_gate_up_rows`) and the matrix has an even number of blocks, a unit is
    blocks b and b + n/2 together: rows j, j + I/2, I + j and I + j + I/2 (four streams, each
    activation load shared by four rows). So only the down launch waits for all threads, and no
    thread waits through the SwiGLU and the quantiser of every row (~11 us of a full-size layer
    on one thread, this machine). `args` holds each token's arguments (decode: one; given
    several, the tokens' same block in turn, each token's experts read apart: how a verify
    step's rows ran before `rows_launch`, kept for tests/verify_rows_probe.py's comparison)."""
    a0 = args[0]
    per_row, per_shared = a0[9].shape[1] // 32, a0[17].shape[1] // 32  # h's, the shared h's
    units_row = per_row // 2 if ROWS == 4 and per_row % 2 == 0 else per_row
    units_shared = per_shared // 2 if ROWS == 4 and per_shared % 2 == 0 else per_shared
    n_routed = a0[2].size * units_row
    n_units = n_routed + a0[3].shape[0] * units_shared
    least = omp.least_units(64 * (a0[0].shape[2] + 2 * a0[1].shape[2]) * len(args)
                            * (per_row // units_row))
    first, last = omp.first_run(counter, thread, n_threads, n_units, least, 1)
    while first < last:
        for unit in range(first, last):
            is_routed = unit < n_routed
            local, units, per = ((unit, units_row, per_row) if is_routed else
                                 (unit - n_routed, units_shared, per_shared))
            i = local // units
            b = local - i * units
            paired = units < per  # blocks b and b + units
            for a in args:
                (qs, d, idx, sqs, sd, xq, dx, xsum8, gu, h, hq, hdx, hxsum8, lanes, step_blocks,
                 half_lanes, sgu, sh, shq, shdx, shxsum8) = a
                if is_routed:
                    w, s = qs[idx[i]], d[idx[i]]
                    gu_o, h_o, q_o, dx_o, sum_o = gu, h, hq, hdx, hxsum8
                else:
                    w, s = sqs[i], sd[i]
                    gu_o, h_o, q_o, dx_o, sum_o = sgu, sh, shq, shdx, shxsum8
                n_inter = h_o.shape[1]
                for j in range(b * 32, b * 32 + 32):
                    if paired:  # rows j, j + I/2, I + j, I + j + I/2
                        spread_tile(w, s, xq, dx, xsum8, gu_o, j, 0, i, n_inter // 2)
                    elif ROWS == 1:
                        spread_tile(w, s, xq, dx, xsum8, gu_o, j, 0, i, n_inter)
                        spread_tile(w, s, xq, dx, xsum8, gu_o, n_inter + j, 0, i, n_inter)
                    else:
                        pair_tile(w, s, xq, dx, xsum8, gu_o, j, 0, i, n_inter)  # rows j, I + j
                for k in range(2 if paired else 1):  # the unit's blocks: b (and b + units)
                    bb = b + k * units
                    swiglu_range(gu_o[i], h_o[i], bb * 32, bb * 32 + 32)
                    matvec.quantize_blocks(h_o[i], q_o[i], dx_o[i], sum_o[i], bb, bb + 1, lanes,
                                           step_blocks, half_lanes)
        first, last = omp.next_run(counter, thread, n_threads, n_units, least, 1)


def _down_share(thread, n_threads, args, counter):
    """The down launch and the combination, by rows: each run [j0, j1) the thread claims
    (jit.omp.first_run: while any are left, so faster threads take more) of the rows of every
    matrix (routed experts, then the shared one from its own activations; each run as ROWS
    side-by-side streams), then each token's combination of those rows (`_combine`'s, each
    element its bits whatever the run; the shared expert's gate σ(w_sg · x) computed by every
    thread, the same bits). So no thread combines all the rows while the team waits (~20 us of
    a full-size layer on one thread, cold, this machine: ~0.8 ms of a 40-layer token at every
    thread count). `args`: the tokens' down arguments, then their combination arguments (as
    _gate_up_share, the tokens' same matrix in turn)."""
    down, combine = args
    qs0, d0, sqs0, sd0 = down[0][0], down[0][1], down[0][3], down[0][4]
    n_rows = qs0.shape[1]
    n_routed = down[0][2].size
    row_bytes = (n_routed * (qs0.shape[2] + 2 * d0.shape[2])
                 + sqs0.shape[0] * (sqs0.shape[2] + 2 * sd0.shape[2]))
    least = omp.least_units(row_bytes * len(down))
    g0, g1 = omp.first_run(counter, thread, n_threads, n_rows, least, ROWS * LINE_ROWS)
    if g0 >= g1:
        return
    gates = np.empty(len(combine), np.float32)  # each token's, once a thread, not once a run
    n = 0
    for c in combine:
        gates[n] = _shared_gate_kernel(c[0], c[4])
        n += 1
    while g0 < g1:
        per = (g1 - g0) // ROWS
        for i in range(n_routed + sqs0.shape[0]):
            for a in down:
                qs, d, idx, sqs, sd, xq, dx, xsum8, sxq, sdx, sxsum8, out = a
                if i < n_routed:
                    w, s, aq, adx, asum, ai = qs[idx[i]], d[idx[i]], xq, dx, xsum8, i
                else:
                    ai = i - n_routed
                    w, s, aq, adx, asum = sqs[ai], sd[ai], sxq, sdx, sxsum8
                for j in range(per):
                    spread_tile(w, s, aq, adx, asum, out, g0 + j, ai, i, per)
                for r in range(g0 + per * ROWS, g1):
                    one_by_1(w, s, aq, adx, asum, out, r, ai, i)
        n = 0
        for c in combine:
            x, idx, weights, routed, w_sg, out = c
            k = idx.size
            _weighted_range(routed[:k], weights, routed[k], gates[n], out, g0, g1)
            n += 1
        g0, g1 = omp.next_run(counter, thread, n_threads, n_rows, least, ROWS * LINE_ROWS)


def _fused_body(gate_up, down, combine):
    """A decode token's MoE (or several tokens', each bit for bit its decode: _gate_up_share) with
    the shared expert riding in the routed launches (Scratch): the gate_up launch with the
    SwiGLU and its quantisation in its shares (_gate_up_share), then the down launch with the
    combination in its shares (_down_share), in one dispatch: decode paid ~27 us of Python
    and dispatch a layer for them as four calls (`bench decode --profile`, 8 full-size layers),
    the default model's shared expert of its own width ~9 calls a layer (0.27 of its 0.49 ms
    a token). The same bits as those calls one by one. Each argument holds the tokens'
    arguments."""
    fork_gate_up(gate_up)
    fork_down((down, combine))


def _gate_up_rows(isa) -> int:
    """Rows decode's gate_up tile reads side by side: 4 where the decode GEMV reads more than two
    (32 vector registers: matvec.gemv_shape), else the GEMV's streams (gate row j beside up row
    I + j, or one row)."""
    return 4 if matvec.gemv_shape(isa)[0] > 2 else matvec.GEMV_STREAMS[isa]


_fused_kernels: dict = {}  # Isa -> the kernel, made on first use (no AVX2 code for Westmere)


def _fused_kernel(isa):
    if isa not in _fused_kernels:
        _, gate_up = matvec.gemv_fork(isa, _gate_up_share, "moe-gate-up", _gate_up_rows(isa),
                                      chunked=True, pair_tile=matvec.spread_tile_of(isa, 2))
        variant, down = matvec.gemv_fork(isa, _down_share, "moe-down", chunked=True)
        # No fast-math, as matvec's kernels: it would reach the tiles' IR inlined here.
        _fused_kernels[isa] = kernel(_fused_body, fastmath=False, variant=variant + "-swiglu",
                                     fork_down=down, fork_gate_up=gate_up)
    return _fused_kernels[isa]


def _check_weights(w: MoeWeights) -> None:
    """Every tensor's dtype, layout and shape, once (MoeWeights.__post_init__): decode reads the
    same weights every token."""
    hidden = w.shared_gate.shape[0] if np.ndim(w.shared_gate) == 1 else -1
    check_array("moe", "shared_gate", w.shared_gate, np.float32, (hidden,))
    for name, qs, d in (("gate_up", w.gate_up_qs, w.gate_up_d), ("down", w.down_qs, w.down_d),
                        ("shared_gate_up", w.shared_gate_up_qs, w.shared_gate_up_d),
                        ("shared_down", w.shared_down_qs, w.shared_down_d)):
        check_array("moe", f"{name}_d", d, np.float16, ndim=3)
        check_array("moe", f"{name}_qs", qs, np.uint8, d.shape[:2] + (d.shape[2] * 16,))
    n_experts, two_i, _ = w.gate_up_d.shape
    if w.shared_gate_up_d.shape[0] != 1 or w.shared_down_d.shape[0] != 1:
        raise FermijitError(f"moe: one shared expert expected, got "
                            f"{w.shared_gate_up_d.shape[0]} / {w.shared_down_d.shape[0]}")
    if (w.gate_up_d.shape[2] * 32 != hidden or w.down_d.shape[:2] != (n_experts, hidden)
            or w.down_d.shape[2] * 64 != two_i or w.shared_down_d.shape[1] != hidden
            or w.shared_down_d.shape[2] * 64 != w.shared_gate_up_d.shape[1]
            or w.shared_gate_up_d.shape[2] * 32 != hidden):
        raise FermijitError(f"moe: inconsistent weight shapes for hidden {hidden}: gate_up_d "
                            f"{list(w.gate_up_d.shape)}, down_d {list(w.down_d.shape)}, shared "
                            f"{list(w.shared_gate_up_d.shape)} / {list(w.shared_down_d.shape)}")


def _check(x, ids, weights, w: MoeWeights):
    """Per call: the activations and the routing (the weights were checked when made). `decode`
    (model/forward.py's, with the router's own indices) checks nothing."""
    check_array("moe", "x", x, np.float32, ndim=2)
    n_tok, hidden = x.shape
    check_array("moe", "ids", ids, np.int32, (n_tok, None))
    check_array("moe", "weights", weights, np.float32, ids.shape)
    if hidden != w.shared_gate.shape[0]:
        raise FermijitError(f"moe: x has {hidden} features, the weights {w.shared_gate.shape[0]}")
    n_experts = w.gate_up_d.shape[0]
    if ids.size and (ids.min() < 0 or ids.max() >= n_experts):
        raise FermijitError(f"moe: expert index out of range [0, {n_experts})")


def _decode(x, ids, weights, w, out, s: Scratch):
    s.act_x = matvec.quantize_act(x[0], out=s.act_x)
    decode(x, s.act_x, ids, weights, w, out, s)


def decode(x, act: Q8Act, ids, weights, w: MoeWeights, out, s: Scratch) -> None:
    """`cpu` for one token with x [1, H] already quantised (`act`), into `out` [1, H], with no
    checks of its own: model/forward.py's decode made every buffer once (`Scratch.make`)."""
    kernel_, args = decode_launch(x, act, ids, weights, w, out, s)
    kernel_(*args)


def decode_launch(x, act: Q8Act, ids, weights, w: MoeWeights, out, s: Scratch):
    """`decode`'s kernel and arguments, for a caller that repeats the call every token (model/
    forward.py's decode plan): the fused kernel and its arguments for one token."""
    gu_bits, shared_gu_bits, down_bits, shared_down_bits = w.d_bits
    # moe's checks cover the weights: the prepared launches check only what each call adds.
    if s.act_h is None or s.act_h.vec is not act.vec:
        s.act_h = matvec.quantize_act(s.h, act.vec.isa)
        s.act_sh = matvec.quantize_act(s.shared_h, act.vec.isa)
    v, h, sh = act.vec, s.act_h, s.act_sh
    half = matvec.simd.HALF_OF.get(v.isa)
    gate_up = (w.gate_up_qs, gu_bits, ids[0], w.shared_gate_up_qs, shared_gu_bits, act.xq,
               act.dx, act.xsum8, s.gu, s.h, h.xq, h.dx, h.xsum8, v.lanes,
               matvec.blocks_per_step(v), half.lanes if half else 0, s.shared_gu, s.shared_h,
               sh.xq, sh.dx, sh.xsum8)
    down = (w.down_qs, down_bits, ids[0], w.shared_down_qs, shared_down_bits, h.xq, h.dx,
            h.xsum8, sh.xq, sh.dx, sh.xsum8, s.routed)
    combine = (x[0], ids[0], weights[0], s.routed, w.shared_gate, out[0])
    return _fused_kernel(act.vec.isa), ((gate_up,), (down,), (combine,))


# --- a verify step's few tokens: their experts' union, each expert read once ----------------------
#
# Decode's fused kernel over a verify step's R tokens read each token's experts in turn: an expert
# two tokens chose was streamed from memory twice, and each token's rows dotted one activation a
# weight load. Here the launch first makes the union of the tokens' experts (the shared expert
# last, chosen by every token); its units are (union expert, block of rows), and each weight row
# is loaded once for every token that chose the expert: two tokens' activations against the same
# weight block in one tile (matvec's few-token tile of 2 tokens, `spread_pair`; vpdpbusd where
# the few-token products take it), a lone token's through decode's tile. Every (row, token) is
# the one-token tile's value, so each token keeps decode's bits. Token t's rows of union expert u
# live at row u·R + t of the scratch (gu, h, its quantisation, the down outputs).


@kernel
def _union_of(ids, n_experts, union, chosen, slots):
    """The union of the tokens' experts in order of first choice: union[:U] their ids, chosen[u,
    t] whether token t chose union[u] (row U, the shared expert: every token), slots[t, j] the
    union position of token t's j-th choice. Returns U."""
    n_tok, top_k = ids.shape
    n_union = 0
    for t in range(n_tok):
        for j in range(top_k):
            e = ids[t, j]
            if e < 0 or e >= n_experts:
                raise IndexError("expert index out of range")
            u = 0
            while u < n_union and union[u] != e:
                u += 1
            if u == n_union:
                union[u] = e
                chosen[u, :] = 0
                n_union += 1
            chosen[u, t] = 1
            slots[t, j] = u
    chosen[n_union, :] = 1
    return n_union


@kernel(fastmath=False)
def _weighted_gather(routed, n_tok, t, slots, weights, shared_row, gate, y, j0, j1):
    """`_weighted_range` of token t of the union launch (its routed rows at routed[slots[i] · n_tok
    + t], the shared expert's at routed[shared_row]): the same operations in the same order, so
    each element has decode's bits."""
    sh = routed[shared_row]
    for j in range(j0, j1):
        y[j] = gate * sh[j]
    for i in range(weights.size):
        w_i, r_i = weights[i], routed[slots[i] * n_tok + t]
        for j in range(j0, j1):
            y[j] = y[j] + w_i * r_i[j]


def _union_gate_up_share(thread, n_threads, args, counter):
    """`_gate_up_share` over the union: a thread's claimed runs of (union expert, 32-block of h)
    units, the shared expert's last (into its own buffers), each block's 32 gate and 32 up rows
    loaded once for the tokens that chose the expert (two consecutive ones in one `spread_pair`
    tile), then each such token's SwiGLU and quantisation of the block."""
    (qs, d, sqs, sd, xq, dx, xsum8, gu, h, hq, hdx, hxsum8, lanes, step_blocks, half_lanes,
     sgu, sh, shq, shdx, shxsum8), idx, chosen = args
    n_tok = xq.shape[0]
    per_row, per_shared = h.shape[1] // 32, sh.shape[1] // 32
    n_routed = idx.size * per_row
    n_units = n_routed + sqs.shape[0] * per_shared
    least = omp.least_units(64 * (qs.shape[2] + 2 * d.shape[2]))
    first, last = omp.first_run(counter, thread, n_threads, n_units, least, 1)
    while first < last:
        for unit in range(first, last):
            if unit < n_routed:
                i = unit // per_row
                b = unit - i * per_row
                w, s = qs[idx[i]], d[idx[i]]
                gu_o, h_o, q_o, dx_o, sum_o, o0 = gu, h, hq, hdx, hxsum8, i * n_tok
            else:
                i_s = (unit - n_routed) // per_shared
                b = unit - n_routed - i_s * per_shared
                w, s = sqs[i_s], sd[i_s]
                gu_o, h_o, q_o, dx_o, sum_o, o0 = sgu, sh, shq, shdx, shxsum8, i_s * n_tok
                i = idx.size + i_s  # its row of `chosen`
            n_inter = h_o.shape[1]
            for j in range(b * 32, b * 32 + 32):
                t = 0
                while t < n_tok:
                    o = o0 + t
                    if chosen[i, t] == 0:
                        t += 1
                    elif t + 1 < n_tok and chosen[i, t + 1] != 0:
                        spread_pair(w, s, xq, dx, xsum8, gu_o, j, t, o, n_inter)  # rows j, I + j
                        if ROWS == 1:
                            spread_pair(w, s, xq, dx, xsum8, gu_o, n_inter + j, t, o, n_inter)
                        t += 2
                    else:
                        spread_tile(w, s, xq, dx, xsum8, gu_o, j, t, o, n_inter)
                        if ROWS == 1:
                            spread_tile(w, s, xq, dx, xsum8, gu_o, n_inter + j, t, o, n_inter)
                        t += 1
            for t in range(n_tok):
                if chosen[i, t] != 0:
                    o = o0 + t
                    swiglu_range(gu_o[o], h_o[o], b * 32, b * 32 + 32)
                    matvec.quantize_blocks(h_o[o], q_o[o], dx_o[o], sum_o[o], b, b + 1, lanes,
                                           step_blocks, half_lanes)
        first, last = omp.next_run(counter, thread, n_threads, n_units, least, 1)


def _union_down_share(thread, n_threads, args, counter):
    """`_down_share` over the union: a thread's claimed runs of rows of every union matrix (each
    row loaded once for the tokens that chose it, as `_union_gate_up_share`; the shared
    expert's from its own activations), then each token's combination of those rows
    (`_weighted_gather`)."""
    ((qs, d, sqs, sd, hq, hdx, hxsum8, shq, shdx, shxsum8, routed), idx, chosen,
     (x, weights, w_sg, out), slots) = args
    n_tok, n_rows, n_routed = x.shape[0], qs.shape[1], idx.size
    least = omp.least_units(n_routed * (qs.shape[2] + 2 * d.shape[2])
                            + sqs.shape[0] * (sqs.shape[2] + 2 * sd.shape[2]))
    g0, g1 = omp.first_run(counter, thread, n_threads, n_rows, least, ROWS * LINE_ROWS)
    if g0 >= g1:
        return
    gates = np.empty(n_tok, np.float32)  # each token's, once a thread, not once a run
    for t in range(n_tok):
        gates[t] = _shared_gate_kernel(x[t], w_sg)
    while g0 < g1:
        per = (g1 - g0) // ROWS
        for i in range(n_routed + sqs.shape[0]):
            if i < n_routed:
                w, s, aq, adx, asum, a0 = qs[idx[i]], d[idx[i]], hq, hdx, hxsum8, i * n_tok
            else:
                a0 = (i - n_routed) * n_tok
                w, s, aq, adx, asum = sqs[i - n_routed], sd[i - n_routed], shq, shdx, shxsum8
            t = 0
            while t < n_tok:
                o, a = i * n_tok + t, a0 + t  # its output row, its activations' row
                if chosen[i, t] == 0:
                    t += 1
                elif t + 1 < n_tok and chosen[i, t + 1] != 0:
                    for j in range(per):
                        spread_pair(w, s, aq, adx, asum, routed, g0 + j, a, o, per)
                    for r in range(g0 + per * ROWS, g1):
                        pair_by_1(w, s, aq, adx, asum, routed, r, a, o)
                    t += 2
                else:
                    for j in range(per):
                        spread_tile(w, s, aq, adx, asum, routed, g0 + j, a, o, per)
                    for r in range(g0 + per * ROWS, g1):
                        one_by_1(w, s, aq, adx, asum, routed, r, a, o)
                    t += 1
        for t in range(n_tok):
            _weighted_gather(routed, n_tok, t, slots[t], weights[t], n_routed * n_tok + t,
                             gates[t], out[t], g0, g1)
        g0, g1 = omp.next_run(counter, thread, n_threads, n_rows, least, ROWS * LINE_ROWS)


def _union_body(gate_up, down, combine, union):
    """A verify step's few tokens' MoE in one dispatch: their experts' union (`_union_of`), then
    the gate_up and down launches over it (each with the SwiGLU, the quantisation, the
    combination in its shares, as `_fused_body`)."""
    ids, union_ids, chosen, slots = union
    n_union = _union_of(ids, gate_up[0].shape[0], union_ids, chosen, slots)
    idx = union_ids[:n_union]
    fork_gate_up((gate_up, idx, chosen))
    fork_down((down, idx, chosen, combine, slots))


_union_kernels: dict = {}  # Isa -> the kernel, made on first use


def _union_kernel(isa):
    if isa not in _union_kernels:
        pair_v = matvec._few_tokens_vec(isa) or simd.VEC_OF[isa]  # the few-token products'
        forks = {}
        for name, share, rows in (
                ("gate_up", _union_gate_up_share, matvec.GEMV_STREAMS[isa]),  # rows j, I + j
                ("down", _union_down_share, matvec.gemv_shape(isa)[0])):
            variant, tiles = matvec._tiles(isa, (rows, 1), matvec.Q4_0)
            variant += f"-moe-union-{name}-pair-{pair_v.isa.label}{pair_v.nbytes * 8}"
            tiles.update(spread_pair=matvec._make_tile(matvec.Q4_0, pair_v, rows, 2, True),
                         pair_by_1=matvec._make_tile(matvec.Q4_0, pair_v, 1, 2))
            forks[f"fork_{name}"] = omp.fork(bind(share, variant, **tiles), chunked=True)
        # No fast-math, as matvec's kernels: it would reach the tiles' IR inlined here.
        _union_kernels[isa] = kernel(_union_body, fastmath=False, variant=variant + "-union",
                                     **forks)
    return _union_kernels[isa]


@dataclass
class RowsScratch:
    """`rows_launch`'s buffers for R tokens, made once (a verify step's workspace): the union
    (at most R·k routed experts, the shared one after them) and, per (union expert u, token t),
    row u·R + t of gu, h and the down outputs (the shared expert's gu and h: row t of its own,
    its intermediate size may differ)."""

    union: np.ndarray      # [R·k] int32
    chosen: np.ndarray     # [R·k + 1, R] uint8
    slots: np.ndarray      # [R, k] int64
    gu: np.ndarray         # [R·k·R, 2I]
    h: np.ndarray          # [R·k·R, I]
    routed: np.ndarray     # [(R·k + 1)·R, H]
    shared_gu: np.ndarray  # [R, 2Is]
    shared_h: np.ndarray   # [R, Is]
    act_h: Q8Act | None = None  # made by the first launch
    act_sh: Q8Act | None = None

    @classmethod
    def make(cls, w: MoeWeights, top_k: int, n_tok: int) -> "RowsScratch":
        n = n_tok * top_k
        f = np.float32
        two_i, hidden = w.gate_up_d.shape[1], w.down_d.shape[1]
        two_is = w.shared_gate_up_d.shape[1]
        return cls(np.zeros(n, np.int32), np.zeros((n + 1, n_tok), np.uint8),
                   np.zeros((n_tok, top_k), np.int64), np.empty((n * n_tok, two_i), f),
                   np.zeros((n * n_tok, two_i // 2), f), np.empty(((n + 1) * n_tok, hidden), f),
                   np.empty((n_tok, two_is), f), np.zeros((n_tok, two_is // 2), f))


def rows_launch(x, act: Q8Act, ids, weights, w: MoeWeights, out, s: RowsScratch):
    """A verify step's R >= 2 tokens of one sequence in one call (model/batch.py): x [R, H], its
    quantisation `act`, ids, weights [R, k], out [R, H]; each token bit for bit its decode
    (`decode_launch`), each expert of the tokens' union read once for all the tokens that chose
    it (the section above)."""
    n_tok, top_k = ids.shape
    hidden = w.shared_gate.shape[0]
    check_array("moe", "x", x, np.float32, (n_tok, hidden))
    check_array("moe", "out", out, np.float32, (n_tok, hidden))
    check_array("moe", "ids", ids, np.int32, (n_tok, top_k))
    check_array("moe", "weights", weights, np.float32, (n_tok, top_k))
    if act.xq.shape != (n_tok, hidden) or s.slots.shape != (n_tok, top_k) \
            or s.gu.shape[1] != w.gate_up_d.shape[1] \
            or s.shared_gu.shape[1] != w.shared_gate_up_d.shape[1]:
        raise FermijitError(f"moe: rows launch of {n_tok} tokens, top-{top_k}: act "
                            f"{list(act.xq.shape)}, scratch for {list(s.slots.shape)}")
    if s.act_h is None or s.act_h.vec is not act.vec:
        s.act_h = matvec.quantize_act(s.h, act.vec.isa)
        s.act_sh = matvec.quantize_act(s.shared_h, act.vec.isa)
    gu_bits, shared_gu_bits, down_bits, shared_down_bits = w.d_bits
    v, h, sh = act.vec, s.act_h, s.act_sh
    half = simd.HALF_OF.get(v.isa)
    gate_up = (w.gate_up_qs, gu_bits, w.shared_gate_up_qs, shared_gu_bits, act.xq, act.dx,
               act.xsum8, s.gu, s.h, h.xq, h.dx, h.xsum8, v.lanes, matvec.blocks_per_step(v),
               half.lanes if half else 0, s.shared_gu, s.shared_h, sh.xq, sh.dx, sh.xsum8)
    down = (w.down_qs, down_bits, w.shared_down_qs, shared_down_bits, h.xq, h.dx, h.xsum8,
            sh.xq, sh.dx, sh.xsum8, s.routed)
    return _union_kernel(v.isa), (gate_up, down, (x, weights, w.shared_gate, out),
                                  (ids, s.union, s.chosen, s.slots))


@kernel
def _sort_slots(ids, n_experts, rows, slot_pos, offsets):
    """Counting sort of the slots (token t, choice j) by expert, stable: rows [S] the token of each
    sorted slot, slot_pos [T, k] where slot (t, j) went, offsets [E+1] each expert's run."""
    n_tok, top_k = ids.shape
    offsets[:] = 0
    for t in range(n_tok):
        for j in range(top_k):
            offsets[ids[t, j] + 1] += 1
    for e in range(n_experts):
        offsets[e + 1] += offsets[e]
    fill = offsets[:n_experts].copy()
    for t in range(n_tok):
        for j in range(top_k):
            e = ids[t, j]
            slot_pos[t, j] = fill[e]
            rows[fill[e]] = t
            fill[e] += 1


COMBINE_AHEAD = 4  # tokens ahead whose routed rows _combine_rows prefetches (1, 2, 8: slower)


@kernel(parallel=True)
def _combine_rows(routed, slot_pos, weights, shared, x, w_sg, y):
    """y[t] = σ(w_sg · x[t])·shared[t] + Σ_j weights[t, j]·routed[slot_pos[t, j]]: a gather per
    token, so the threads never write one row; the gate's dot product in float64 as `reference`
    (numpy's float64 product of all of x was 6 ms a layer at full size). y may be x. The rows a
    token gathers are prefetched COMBINE_AHEAD tokens before (default model, 8 layers of 512
    tokens, 1 thread: 1.45-1.65 -> 1.15-1.4 ms)."""
    n_tok, row_bytes = y.shape[0], 4 * routed.shape[1]
    for t in prange(n_tok):
        if t + COMBINE_AHEAD < n_tok:  # a later token's routed rows: scattered over the slots
            for j in range(weights.shape[1]):
                lo = slot_pos[t + COMBINE_AHEAD, j] * row_bytes
                prefetch_bytes(routed, lo, lo + row_bytes)
        x_t, y_t, sh_t = x[t], y[t], shared[t]
        dot = 0.0
        for c in range(x_t.size):
            dot += np.float64(x_t[c]) * np.float64(w_sg[c])
        gate = np.float32(1.0 / (1.0 + np.exp(-dot)))
        for c in range(y_t.size):
            y_t[c] = gate * sh_t[c]
        for j in range(weights.shape[1]):
            w_j, r_j = weights[t, j], routed[slot_pos[t, j]]
            for c in range(y_t.size):
                y_t[c] += w_j * r_j[c]


@dataclass
class FfnBuffers:
    """One SwiGLU pass's buffers over n activation rows: reused by every layer of a prefill pass
    (fresh ones cost a page fault per 4 KiB: ~3 ms per 32 MB at full size)."""

    gu: np.ndarray               # [n, 2I]
    h: np.ndarray                # [n, I]
    out: np.ndarray              # [n, H]
    act_h: Q8Act | None = None   # made by the first pass

    @classmethod
    def make(cls, n: int, qs_gate_up, qs_down) -> "FfnBuffers":
        two_i, empty = qs_gate_up.shape[1], matvec.aligned_empty  # on cache lines: matvec.LINE
        return cls(empty((n, two_i)), empty((n, two_i // 2)), empty((n, qs_down.shape[1])))


def _ffn(qs_gate_up, d_gate_up, qs_down, d_down, act: Q8Act, offsets, swiglu=_swiglu_rows,
         buffers: FfnBuffers | None = None, *, like_gemv: bool = False, x_rows=None):
    """SwiGLU experts over the rows of `act` (or its rows `x_rows`), grouped by `offsets` (one
    launch per projection); `like_gemv`: each row bit for bit decode's (matvec.grouped)."""
    n = act.xq.shape[0] if x_rows is None else x_rows.size
    b = buffers or FfnBuffers.make(n, qs_gate_up, qs_down)
    # Launches without matvec.grouped's checks: offsets and rows come from _sort_slots of
    # checked ids, the buffers from FfnBuffers.make for these weights.
    matvec.grouped_launch(qs_gate_up, d_gate_up, offsets, act, b.gu, like_gemv=like_gemv,
                          x_rows=x_rows)
    swiglu(b.gu, b.h)
    b.act_h = matvec.quantize_act(b.h, act.vec.isa, out=b.act_h)
    return matvec.grouped_launch(qs_down, d_down, offsets, b.act_h, b.out, like_gemv=like_gemv)


@dataclass
class PrefillBuffers:
    """A prefill pass's MoE buffers for T tokens (Scratch.prefill keeps one set)."""

    n_tok: int
    rows: np.ndarray        # [T·k] the token of each slot sorted by expert
    slot_pos: np.ndarray    # [T, k]
    offsets: np.ndarray     # [E+1]
    routed: FfnBuffers
    shared: FfnBuffers
    act_x: Q8Act | None = None

    def fits(self, w: MoeWeights, n_tok: int, top_k: int) -> bool:
        """Made for this pass size and these weights' shapes (layers may differ: pruned)."""
        return (self.n_tok == n_tok and self.slot_pos.shape[1] == top_k
                and self.offsets.size == w.gate_up_qs.shape[0] + 1
                and self.routed.gu.shape[1] == w.gate_up_qs.shape[1]
                and self.routed.out.shape[1] == w.down_qs.shape[1]
                and self.shared.gu.shape[1] == w.shared_gate_up_qs.shape[1])

    @classmethod
    def make(cls, w: MoeWeights, n_tok: int, top_k: int) -> "PrefillBuffers":
        return cls(n_tok, np.empty(n_tok * top_k, np.int64), np.empty((n_tok, top_k), np.int64),
                   np.empty(w.gate_up_qs.shape[0] + 1, np.int64),
                   FfnBuffers.make(n_tok * top_k, w.gate_up_qs, w.down_qs),
                   FfnBuffers.make(n_tok, w.shared_gate_up_qs, w.shared_down_qs))


def _prefill(x, ids, weights, w, out, b: PrefillBuffers):
    """The tokens sorted by expert once; each projection of every expert (and of the shared one,
    as E = 1) one launch, the routed gate_up reading each slot's token row in place; the
    weighted sum a gather per token."""
    n_tok = ids.shape[0]
    _sort_slots(ids, w.gate_up_qs.shape[0], b.rows, b.slot_pos, b.offsets)
    b.act_x = act = matvec.quantize_act(x, out=b.act_x)
    gu_bits, shared_gu_bits, down_bits, shared_down_bits = w.d_bits
    routed = _ffn(w.gate_up_qs, gu_bits, w.down_qs, down_bits, act, b.offsets,
                  buffers=b.routed, x_rows=b.rows)
    shared = _ffn(w.shared_gate_up_qs, shared_gu_bits, w.shared_down_qs, shared_down_bits, act,
                  np.array([0, n_tok], np.int64), buffers=b.shared)
    _combine_rows(routed, b.slot_pos, weights, shared, x, w.shared_gate, out)


def cpu(x, ids, weights, w: MoeWeights, out=None, scratch: Scratch | None = None):
    """W4A8 MoE; `scratch` (from Scratch.make) makes decode allocation-free."""
    _check(x, ids, weights, w)
    y = output("moe", out, x.shape)
    if x.shape[0] == 1:
        _decode(x, ids, weights, w, y, scratch or Scratch.make(w, ids.shape[1]))
    else:
        n_tok, top_k = ids.shape
        b = scratch.prefill if scratch is not None else None
        if b is None or not b.fits(w, n_tok, top_k):
            b = PrefillBuffers.make(w, n_tok, top_k)
            if scratch is not None:
                scratch.prefill = b
        _prefill(x, ids, weights, w, y, b)
    return y


def batched(x, ids, weights, w: MoeWeights, out=None):
    """`cpu` for B sequences' decode tokens (x [B, H]), each row bit for bit `cpu` on that row
    alone (model/batch.py): the experts as grouped launches (slots sorted by expert) with the
    `like_gemv` tile, which accumulates each (row, token) as decode's GEMV does; the shared expert
    as one more grouped launch; the weighted sum by decode's own `_combine`, row by row (prefill's
    gate is a numpy float64 dot, whose summation order is BLAS's)."""
    _check(x, ids, weights, w)
    y = output("moe", out, x.shape)
    n_seq, top_k = ids.shape
    n_experts = w.gate_up_qs.shape[0]
    if ids.size and (ids.min() < 0 or ids.max() >= n_experts):  # _check skips one token's
        raise FermijitError(f"moe: expert index out of range [0, {n_experts})")
    rows = np.empty(n_seq * top_k, np.int64)
    slot_pos = np.empty((n_seq, top_k), np.int64)
    offsets = np.empty(n_experts + 1, np.int64)
    _sort_slots(ids, n_experts, rows, slot_pos, offsets)
    act = matvec.quantize_act(x, decode_isa())  # one token's variant, as `cpu` per row
    gu_bits, shared_gu_bits, down_bits, shared_down_bits = w.d_bits
    # SwiGLU on one thread, as decode: a parallel launch's wake-up cost more than B·k rows of it
    # (0.42 ms a call on the default model, 4 sequences, a busy 2-core machine).
    routed = _ffn(w.gate_up_qs, gu_bits, w.down_qs, down_bits, act.rows(rows), offsets, _swiglu,
                  like_gemv=True)
    shared = _ffn(w.shared_gate_up_qs, shared_gu_bits, w.shared_down_qs, shared_down_bits, act,
                  np.array([0, n_seq], np.int64), _swiglu, like_gemv=True)
    per_seq = routed[slot_pos]                                          # [B, k, H]
    for b in range(n_seq):
        _combine(per_seq[b], weights[b], shared[b], x[b], w.shared_gate, y[b])
    return y
