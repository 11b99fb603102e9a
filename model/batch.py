"""Batched decode: one forward step of B sequences, each one token after its
own `State` (KV caches, GDN conv and recurrent state, position), for a server decoding several
requests at once.

What reads weights is batched over the B rows, so the weights stream from memory once a step, not
B times: the mixers' projections as one W4A8 GEMM over B rows (matvec.product), the MoE's
experts as one grouped GEMM per projection over the (sequence, expert) slots sorted by expert
(ops.moe.batched; a batch of at most ROW_MOE_MAX_ROWS runs through a plan of its calls, as
decode's token does, its MoE the rows launch: the union of the rows' experts, each read once).
What reads a sequence's own state, or is fp32 and small, runs per sequence,
through the same fused step kernels as `Model.decode` (model/forward.py `_decode_fused`): the
residual add + norm + quantisation + fp32 gates or router (ops.residual_step), the attention step
over its KV cache (ops.attention_step), the GDN step on its conv and recurrent state
(ops.gdn_step).

Row b of the logits is bit for bit `Model.decode(tokens[b], states[b])`
(tests/model/test_batch.py): the products take the `like_gemv` tile, which accumulates each
(row, token) exactly as the GEMV does; everything else is decode's own kernels on row b. So a
request's tokens at temperature 0 do not depend on what else is in the batch.

Dimension legend: as model/forward.py; B sequences in the batch.
"""

from __future__ import annotations

import numpy as np

from fermijit import FermijitError
from fermijit.jit import omp, sequence
from fermijit.jit.cpu import decode_isa
from fermijit.model.forward import (L2NORM_EPS, DecodePlan, Model, _state_arrays, linear,
                                    linear_step, run_steps)
from fermijit.model.state import GdnState, KvCache, State
from fermijit.ops import (attention_step, embedding, gdn_rows, gdn_step, matvec, moe,
                          residual_rows, residual_step)


def _rows(act: matvec.Q8Act) -> list[matvec.Q8Act]:
    """One Q8Act per row of `act`, each a view of it (so per-row kernels fill the batch's)."""
    return [matvec.Q8Act(act.xq[b:b + 1], act.dx[b:b + 1], act.xsum8[b:b + 1], act.vec)
            for b in range(act.xq.shape[0])]


# One sequence's verify step of at most this many rows runs decode's fused MoE kernel on its rows
# (bit for bit the same as moe.batched): the default model's 2-row step took 2.2x a decode token
# through the grouped launches (allocations, sorting). A batch of at most this many sequences runs
# through a plan too (_planned_rows: the MoE's union of experts); larger ones op by op (a plan's
# joined steps grow with the rows: a batch of 513 made one past the memory). 8 was measured
# (session 26, 2 threads: the embedded model's steps of 5 / 8 sequences 3.4 / 4.6-5.1 -> 1.4-2.1
# / 2.5-3.1 ms, full-size reap128 155-175 / 246-271 -> 154-159 / 234-251 ms) and left: each
# size a plan takes has joined kernels of its own, which serve's warm-up must load (sizes 5-7:
# +0.14 s of a warm start, +31 s of a cold one), against issue 28 item 4's start.
ROW_MOE_MAX_ROWS = 4


def can_batch(model: Model) -> bool:
    """Whether `decode_batch` takes this model: decode's fused path over Q4_0 weights, joined
    input projections."""
    return (model.fused_decode and isinstance(model.layers[0].experts, moe.MoeWeights)
            and all(w.joined_in is not None for w in model.layers))


class BatchWorkspace:
    """Every intermediate of one batched step of B sequences, made once per B."""

    def __init__(self, model: Model, n_seqs: int):
        f, B = np.float32, n_seqs
        H, Hq, Hkv, D = model.hidden, model.n_heads, model.n_kv_heads, model.head_dim
        Hk, Hv, dk, dv = model.n_key_heads, model.n_value_heads, model.key_dim, model.value_dim
        C, Cq = model.conv_dim, Hq * 2 * D
        self.n_seqs = B
        self.tokens = np.empty(B, np.int32)
        self.positions = np.empty(B, np.int64)
        self.x = np.empty((B, H), f)             # the residual stream
        self.xn = np.empty((B, H), f)            # its norm: a sublayer's input
        self.y = np.empty((B, H), f)             # a sublayer's output
        # Quantised for decode's variant (jit.cpu.decode_isa): each row bit for bit one decode's.
        isa = decode_isa()
        self.act = matvec.quantize_act(self.xn, isa)  # xn quantised, filled row by row
        self.act_rows = _rows(self.act)
        # attention: q (query D | gate D per head) | k | v; one sequence's step scratch
        self.attn_in = np.empty((B, Cq + 2 * Hkv * D), f)
        self.q = np.empty((1, Hq, D), f)
        self.gate = np.empty((1, Hq, D), f)
        self.o = np.empty((B, Hq, D), f)
        self.q_rows, self.gate_rows = np.empty((B, Hq, D), f), np.empty((B, Hq, D), f)
        self.act_attn = matvec.quantize_act(self.o.reshape(B, -1), isa)
        self.act_attn_rows = _rows(self.act_attn)
        # gated deltanet: qkv | z, b | a; one sequence's step scratch
        self.gdn_in = np.empty((B, C + Hv * dv), f)
        self.gates_in = np.empty((B, 2 * Hv), f)
        self.gq = np.empty((1, Hk, dk), f)
        self.gk = np.empty((1, Hk, dk), f)
        self.gv = np.empty((1, Hv, dv), f)
        self.g = np.empty((1, Hv), f)
        self.beta = np.empty((1, Hv), f)
        self.go = np.empty((B, Hv, dv), f)
        self.act_gdn = matvec.quantize_act(self.go.reshape(B, -1), isa)
        self.act_gdn_rows = _rows(self.act_gdn)
        # moe
        self.router_logits = np.empty((B, model.n_experts), f)
        self.ids = np.empty((B, model.top_k), np.int32)
        self.weights = np.empty((B, model.top_k), f)
        self.logits = np.empty((B, model.vocab_size), f)
        # A verify step's few rows: decode's fused MoE for one, the rows launch (the union of
        # their experts) for more (decode_rows).
        experts = model.layers[0].experts
        self.moe_scratch = moe.Scratch.make(experts, model.top_k)
        self.moe_rows = moe.RowsScratch.make(experts, model.top_k, B) if B > 1 else None
        self.no_product = np.empty((0, H), f)
        self.no_product.flags.writeable = False
        self.no_p = np.empty((1, 0), f)
        self.no_p_rows = np.empty((B, 0), f)       # the same for B rows (ops.residual_rows)
        self.no_ids, self.no_weights = np.empty((B, 0), np.int32), np.empty((B, 0), f)
        self.plans: list[DecodePlan] = []  # one sequence's rows' (decode_rows)
        self.gdn_scratch: gdn_rows.Scratch | None = None  # its GDN rows' (ops.gdn_rows)


def decode_batch(model: Model, tokens, states: list[State],
                 ws: BatchWorkspace | None = None) -> np.ndarray:
    """Logits [B, V] after tokens[b] for each sequence b (`states[b]` advanced by one); row b is
    `model.decode(tokens[b], states[b])` bit for bit. `ws` (a BatchWorkspace of B) avoids
    allocating one per step; the result is a view of it."""
    if len({id(s) for s in states}) != len(states):
        raise FermijitError("decode_batch: a state appears twice")
    return decode_rows(model, tokens, states, ws)


def decode_rows(model: Model, tokens, states: list[State], ws: BatchWorkspace | None = None,
                saves: "list[GdnSaves | None] | None" = None) -> np.ndarray:
    """`decode_batch` where a sequence may take several rows: consecutive rows of one state are
    its next positions (a speculative verify step, fermijit/speculative.py), each bit for bit
    `model.decode` of that token after the ones before it, the GDN state advanced token by
    token. With `saves` (per row, its state's GdnSaves or None), the GDN states after each row
    but the last of a state are kept (`rollback` returns to them; one sequence's 2 rows leave
    the last row's recurrent update pending instead: GdnSaves). A state with the MTP layer
    gets the rows' hidden states."""
    tokens = np.asarray(tokens, np.int32)
    B = len(states)
    if tokens.shape != (B,) or B == 0:
        raise FermijitError(f"decode_batch: {tokens.size} tokens for {B} states (need one each, "
                            f"at least one)")
    if not can_batch(model):
        raise FermijitError("decode_batch needs a 4-bit fermijit model with Q4_0 mixers and "
                            "joined input projections (convert the model again)")
    offsets = _offsets(states)
    distinct = list({id(s): s for s in states}.values())
    n_seqs = len(distinct)
    for s in distinct:
        model._check_room(s, sum(t is s for t in states))
    model._check_token(tokens)
    if ws is None or ws.n_seqs != B:
        ws = BatchWorkspace(model, B)
    ws.tokens[:] = tokens
    ws.positions[:] = [s.position + s.rope_delta + o for s, o in zip(states, offsets)]
    if n_seqs == 1 and B <= ROW_MOE_MAX_ROWS:
        return _planned_rows(model, states, distinct, ws,
                             None if saves is None else saves[0])
    if n_seqs == B <= ROW_MOE_MAX_ROWS and (saves is None or all(v is None for v in saves)):
        return _planned_rows(model, states, distinct, ws, None)
    embedding.cpu(ws.tokens, model.embed, out=ws.x)
    eps, y = model.eps, None                                         # y: the sublayer output
    n_gdn = 0
    for i, w in enumerate(model.layers):
        mixer, layer_states = w.mixer, [s.layers[i] for s in states]
        if model.is_attention[i]:
            _residual(ws, y, w.input_norm, eps, ws.no_product, None)
            linear(ws.xn, w.joined_in, ws.attn_in, ws.act, like_gemv=True)  # q | k | v
            for b, cache in enumerate(layer_states):
                attention_step.cpu(ws.attn_in[b:b + 1], mixer.q_norm, mixer.k_norm, eps,
                                   ws.positions[b:b + 1], model.rotary_dim, model.theta,
                                   cache.k, cache.v, ws.q, ws.gate, ws.o[b:b + 1],
                                   ws.act_attn_rows[b])
            linear(ws.o.reshape(B, -1), mixer.o_proj, ws.y, ws.act_attn, like_gemv=True)
        else:
            _residual(ws, y, w.input_norm, eps, w.gates_in, ws.gates_in)    # b | a
            linear(ws.xn, w.joined_in, ws.gdn_in, ws.act, like_gemv=True)   # qkv | z
            _gdn_steps(model, mixer, layer_states, ws,
                       None if saves is None else (saves, offsets, n_gdn))
            linear(ws.go.reshape(B, -1), mixer.out_proj, ws.y, ws.act_gdn, like_gemv=True)
            n_gdn += 1
        y = ws.y
        _residual(ws, y, w.post_norm, eps, w.router, ws.router_logits, routed=True)
        if model.moe_observer is not None:
            model.moe_observer(w, ws.xn, ws.ids, ws.weights)
        moe.batched(ws.xn, ws.ids, ws.weights, w.experts, out=ws.y)
    _residual(ws, y, model.norm, eps, ws.no_product, None)
    _advance(states, distinct, ws)
    return linear(ws.xn, model.lm_head, ws.logits, ws.act, like_gemv=True)


def _advance(states: list[State], distinct: list[State], ws: BatchWorkspace) -> None:
    """After a step of ws's rows (ws.xn their final norms): each state past its rows, and a
    state with the MTP layer given their hidden states (model/mtp.py)."""
    for s in distinct:
        rows = [b for b, t in enumerate(states) if t is s]
        s.position += len(rows)
        if s.hidden is not None:
            s.hidden = np.concatenate([s.hidden, ws.xn[rows]])


def _planned_rows(model: Model, states: list[State], distinct: list[State], ws: BatchWorkspace,
                  saves) -> np.ndarray:
    """`decode_rows` of ws's rows (ws.tokens and ws.positions set) through a plan of their calls
    made once per states' and saves' arrays and workspace (a DecodePlan), as decode runs its
    token: one sequence's R rows (its GDN states not settled first where the GDN rows apply a
    pending row themselves: 2 rows), or R sequences' one row each (a server's batch: op by op
    through Python, the embedded model's step of 2 took 3.3x a token). A rollback swaps arrays
    between the state and the saves, a batch changes its sequences: the plans of the last few
    arrangements are kept. `distinct`: the states, each once."""
    is_lazy = saves is not None and ws.n_seqs == 2
    if is_lazy:  # the GDN rows leave the last row pending (ops/gdn_rows.py): its records
        for s in states[0].layers:
            if isinstance(s, GdnState) and s.pending is None:
                s.pending = gdn_rows.Pending(model.n_key_heads, model.n_value_heads,
                                             model.key_dim, model.value_dim)
    arrays = (tuple(a for s in distinct for a in _state_arrays(s, settle=not is_lazy))
              + (() if saves is None else saves.arrays))
    plan = next((p for p in ws.plans if p.fits_arrays(arrays, model.moe_observer)), None)
    if plan is None:
        plan = DecodePlan(arrays, model.moe_observer, _rows_steps(model, states, ws, saves))
        ws.plans = ws.plans[-(MAX_PLANS - 1):] + [plan]
    if omp.in_forked_child:
        omp.check_process()
    run_steps(plan.steps)
    _advance(states, distinct, ws)
    return ws.logits


# Plans a workspace keeps (_planned_rows): R rows' rollbacks arrange the live and saved arrays in
# at most R! ways (2 for a 2-row step), a batch's sequences change as requests come and go; a
# plan costs ~50-100 us a layer to make (DecodePlan).
MAX_PLANS = 8


def _rows_steps(model: Model, states: list[State], ws: BatchWorkspace, saves) -> list:
    """The calls of `decode_rows` over ws's R rows (row r of states[r]: one sequence's next
    positions, or R sequences' one each), as `Model._decode_steps` lists a
    token's: per row decode's own fused steps (attention, MoE), the products over the R rows
    at once (`like_gemv`: each row the GEMV's bits, matvec's few-token tiles; the GDN gates'
    fp32 rows in the fork of its input projection, as decode's), the residual steps of the R
    rows in one call (ops.residual_rows: the fp32 router read once),
    the GDN rows in one call that leaves the state after every row but the last in `saves`
    or, of 2 rows, the last row pending (ops.gdn_rows; without saves, decode's step row by
    row)."""
    R, eps, y = ws.n_seqs, model.eps, None                           # y: the sublayer output
    rows = [slice(b, b + 1) for b in range(R)]

    def residual(norm_w, w, p, routed=False):
        return [residual_rows_step(ws, y, norm_w, eps, w, p, routed)]

    def product(x_act, w, out):
        if isinstance(w, matvec.Q4Matrix):
            return ("matvec.product", *matvec.launch(w, x_act, out, like_gemv=True))
        return linear_step(ws.xn, w, out, x_act)  # the LM head: Q8_0 (or fp32: of xn)

    steps = [("embedding.cpu", embedding.cpu, (ws.tokens, model.embed, ws.x))]
    C, Hv, dv = model.conv_dim, model.n_value_heads, model.value_dim
    n_gdn = 0
    attention_scratch: dict = {}                                 # one set for every layer
    is_one = all(s is states[0] for s in states)
    for i, w in enumerate(model.layers):
        steps.append(sequence.BREAK)                             # a joined step a layer
        mixer, layer_states = w.mixer, [s.layers[i] for s in states]
        if model.is_attention[i]:
            steps += residual(w.input_norm, ws.no_product, None)
            steps.append(product(ws.act, w.joined_in, ws.attn_in))       # q | k | v
            if is_one:
                steps += attention_rows_steps(model, mixer, layer_states[0], ws,
                                              attention_scratch)
            else:  # each row over its sequence's cache: decode's step
                steps += [step for b, (r, cache) in enumerate(zip(rows, layer_states))
                          for step in attention_step.launch(
                              ws.attn_in[r], mixer.q_norm, mixer.k_norm, eps, ws.positions[r],
                              model.rotary_dim, model.theta, cache.k, cache.v, ws.q, ws.gate,
                              ws.o[r], ws.act_attn_rows[b], attention_scratch)]
            steps.append(product(ws.act_attn, mixer.o_proj, ws.y))
        else:
            if isinstance(w.joined_in, matvec.Q4Matrix) and R <= matvec.FEW_TOKENS:
                steps += residual(w.input_norm, ws.no_product, None)
                # qkv | z with b | a (fp32) in its fork, as decode's: one fork fewer
                steps.append(("matvec.product", *matvec.launch_with_rows(
                    w.joined_in, ws.act, ws.gdn_in, ws.xn, w.gates_in, ws.gates_in)))
            else:
                steps += residual(w.input_norm, w.gates_in, ws.gates_in)  # b | a
                steps.append(product(ws.act, w.joined_in, ws.gdn_in))     # qkv | z
            if saves is not None:  # every row in one call, the state after each kept
                steps.append(_gdn_rows_step(model, mixer, layer_states[0], ws, saves, n_gdn))
            else:  # row by row through decode's step, each on its sequence's state
                steps += [("gdn_step.cpu", *gdn_step.launch(
                    ws.gdn_in[r, :C], ws.gdn_in[r, C:].reshape(1, Hv, dv), ws.gates_in[r, Hv:],
                    ws.gates_in[r, :Hv], mixer.conv1d, s.conv, mixer.A_log, mixer.dt_bias,
                    mixer.norm, eps, L2NORM_EPS, s.recurrent, ws.gq, ws.gk, ws.gv, ws.g,
                    ws.beta, ws.go[r], ws.act_gdn_rows[b]))
                    for b, (r, s) in enumerate(zip(rows, layer_states))]
            steps.append(product(ws.act_gdn, mixer.out_proj, ws.y))
            n_gdn += 1
        y = ws.y
        steps += residual(w.post_norm, w.router, ws.router_logits, routed=True)
        if model.moe_observer is not None:
            steps.append(("moe_observer", model.moe_observer, (w, ws.xn, ws.ids, ws.weights)))
        steps += moe_rows_steps(ws, w.experts)
    steps.append(sequence.BREAK)
    steps += residual(model.norm, ws.no_product, None)
    steps.append(product(ws.act, model.lm_head, ws.logits))
    return steps


def residual_rows_step(ws: BatchWorkspace, y, norm_w, eps, w, p, routed=False):
    """The plan's residual step of ws's rows (x += y, xn its norm, the act its rounding, p =
    xn · w, with `routed` the top-k of p into ws.ids, ws.weights): one call (ops.residual_rows:
    the fp32 router and gates read once, each row its decode's bits)."""
    return ("residual_rows.cpu", *residual_rows.launch(
        ws.x, y, norm_w, eps, ws.xn, ws.act, w, ws.no_p_rows if p is None else p,
        ws.ids if routed else ws.no_ids, ws.weights if routed else ws.no_weights))


def attention_rows_steps(model: Model, mixer, kv: KvCache, ws: BatchWorkspace,
                         shared: dict | None = None) -> list:
    """The plan's attention steps of ws's rows (ws.attn_in, consecutive positions of the `kv`
    cache) into ws.o: kernels only (ops.attention_step.rows_launch: each row its decode's bits),
    joined with the layer's products; `shared` the plan's attention scratch, one set for its
    layers (as decode's plan)."""
    return attention_step.rows_launch(
        ws.attn_in, mixer.q_norm, mixer.k_norm, model.eps, ws.positions, model.rotary_dim,
        model.theta, kv.k, kv.v, ws.q_rows, ws.gate_rows, ws.o, ws.act_attn, shared)


def moe_rows_steps(ws: BatchWorkspace, experts) -> list:
    """The plan's MoE of ws's rows (ws.xn, routed into ws.ids, ws.weights) into ws.y: every row
    in one call (moe.rows_launch: the union of the rows' experts, each read once; each row its
    decode's bits), one row by decode's fused kernel."""
    if ws.moe_rows is not None:
        return [("moe.decode", *moe.rows_launch(ws.xn, ws.act, ws.ids, ws.weights, experts,
                                                ws.y, ws.moe_rows))]
    return [("moe.decode", *moe.decode_launch(ws.xn, ws.act_rows[0], ws.ids, ws.weights,
                                              experts, ws.y, ws.moe_scratch))]


def _gdn_rows_step(model: Model, mixer, s, ws: BatchWorkspace, saves: "GdnSaves", g: int):
    """The plan's step of GDN layer g (its `s` state) over ws's R rows (ops.gdn_rows): row r
    from the state row r-1 left, into saves' r-th (the live state for the last row); of 2 rows,
    the recurrent state left after the first, the second's update pending (s.pending: the lazy
    row, which a rollback drops)."""
    R, C, Hv, dv = ws.n_seqs, model.conv_dim, model.n_value_heads, model.value_dim
    if ws.gdn_scratch is None:
        ws.gdn_scratch = gdn_rows.Scratch(R, model.n_key_heads, Hv, model.key_dim, dv)
    conv_dst = [saves.conv[r][g] for r in range(R - 1)] + [s.conv]
    if R == 2:
        rec_src = rec_dst = [s.held]
    else:
        rec_dst = [saves.recurrent[r][g] for r in range(R - 1)] + [s.recurrent]
        rec_src = [s.recurrent] + rec_dst[:-1]
    rows = [ws.gdn_in[r:r + 1] for r in range(R)]
    return ("gdn_rows.cpu", *gdn_rows.launch(
        [row[:, :C] for row in rows], [row[:, C:].reshape(1, Hv, dv) for row in rows],
        [ws.gates_in[r:r + 1, Hv:] for r in range(R)],
        [ws.gates_in[r:r + 1, :Hv] for r in range(R)],
        mixer.conv1d, [s.conv] + conv_dst[:-1], conv_dst, mixer.A_log, mixer.dt_bias, mixer.norm,
        model.eps, L2NORM_EPS, rec_src, rec_dst, ws.gdn_scratch,
        [ws.go[r:r + 1] for r in range(R)], ws.act_gdn_rows, s.pending if R == 2 else None))


def _offsets(states: list[State]) -> list[int]:
    """Each row's position past its state's: 0, 1, ... along a state's consecutive rows."""
    offsets, seen = [], {}
    for b, s in enumerate(states):
        if id(s) in seen and states[b - 1] is not s:
            raise FermijitError("decode_rows: a state's rows must be consecutive")
        offsets.append(seen.get(id(s), -1) + 1)
        seen[id(s)] = offsets[-1]
    return offsets


class GdnSaves:
    """The GDN states of one sequence after each of the first R rows of a step (R = rows - 1:
    the last row's state is the live one), preallocated, per row and GDN layer an array of its
    own (conv[r][g], recurrent[r][g]): what `rollback` swaps in. A step of 2 rows of one
    sequence (the verify step of one draft) saves the conv states only: its recurrent state is
    the one after the first row, the second's update pending (GdnState; recurrent[0] is written
    only by `decode_rows`' path for several sequences)."""

    def __init__(self, model: Model, n_rows: int):
        n_gdn = sum(not a for a in model.is_attention)
        f, R = np.float32, max(n_rows - 1, 0)
        conv = (model.conv_dim, model.conv_taps - 1)
        recurrent = (model.n_value_heads, model.key_dim, model.value_dim)
        self.n_rows = n_rows
        self.conv = [[np.empty(conv, f) for _ in range(n_gdn)] for _ in range(R)]
        self.recurrent = [[np.empty(recurrent, f) for _ in range(n_gdn)]
                          for _ in range(R)]

    @property
    def arrays(self) -> tuple:
        return tuple(a for saved in (self.conv, self.recurrent) for row in saved for a in row)


def rollback(model: Model, state: State, saves: GdnSaves, n_rows: int, n_kept: int) -> None:
    """Undo the last `n_rows - n_kept` rows of a `decode_rows` step of `n_rows` rows of `state`:
    its GDN states those after row n_kept - 1, swapped in from `saves` (no copy: the live arrays
    go to the saves in their place, overwritten by the next step) or, where the last row's
    update is pending (a step of 2 rows), that update dropped; its position n_kept past the
    step's start (KV rows past it are never read), the rejected rows' hidden states dropped."""
    if not 1 <= n_kept <= n_rows <= saves.n_rows:
        raise FermijitError(f"rollback: keep {n_kept} of {n_rows} rows (saved: {saves.n_rows})")
    if n_kept == n_rows:
        return
    gdn = [s for s in state.layers[:len(model.layers)] if not isinstance(s, KvCache)]
    conv, recurrent = saves.conv[n_kept - 1], saves.recurrent[n_kept - 1]
    for g, s in enumerate(gdn):
        s.conv, conv[g] = conv[g], s.conv
        if s.pending is not None and s.pending.is_set[0]:  # the state after row n_kept - 1
            if n_rows - n_kept != 1:
                raise FermijitError(f"rollback: {n_rows - n_kept} rows back, 1 pending")
            s.pending.is_set[0] = 0
        else:
            s.recurrent, recurrent[g] = recurrent[g], s.recurrent
    state.position -= n_rows - n_kept
    if state.hidden is not None:
        state.hidden = state.hidden[:state.hidden.shape[0] - (n_rows - n_kept)]


def _residual(ws: BatchWorkspace, y, norm_w, eps, w, p, routed: bool = False) -> None:
    """ops.residual_step row by row (decode's kernel: its fp32 product's bits are its own):
    x += y, xn = rmsnorm(x), act = quantise(xn), p = w · xn (routed into ids, weights)."""
    for b in range(ws.n_seqs):
        rows = slice(b, b + 1)
        extra = (ws.ids[rows], ws.weights[rows]) if routed else ()
        residual_step.cpu(ws.x[rows], None if y is None else y[rows], norm_w, eps, ws.xn[rows],
                          ws.act_rows[b], w, ws.no_p if p is None else p[rows], *extra)


def _gdn_steps(model: Model, mixer, gdn_states, ws: BatchWorkspace, saving=None) -> None:
    """Each row's GDN step, in order (a state's later rows see its earlier ones); `saving`
    (each row's GdnSaves or None, the rows' offsets, this layer's GDN index): the state after
    each row that a later row of the same state follows, copied into the row's saves."""
    C, Hv, dv = model.conv_dim, model.n_value_heads, model.value_dim
    for b, s in enumerate(gdn_states):
        row = ws.gdn_in[b:b + 1]
        gdn_step.cpu(row[:, :C], row[:, C:].reshape(1, Hv, dv), ws.gates_in[b:b + 1, Hv:],
                     ws.gates_in[b:b + 1, :Hv], mixer.conv1d, s.conv, mixer.A_log,
                     mixer.dt_bias, mixer.norm, model.eps, L2NORM_EPS, s.recurrent, ws.gq,
                     ws.gk, ws.gv, ws.g, ws.beta, ws.go[b:b + 1], ws.act_gdn_rows[b])
        if saving is not None and b + 1 < len(gdn_states) and gdn_states[b + 1] is s:
            saves, offsets, g = saving
            if saves[b] is not None:
                saves[b].conv[offsets[b]][g][...] = s.conv
                saves[b].recurrent[offsets[b]][g][...] = s.recurrent
