"""Batched decode (issue 14 item 3): one forward step of B sequences, each one token after its
own `State` (KV caches, GDN conv and recurrent state, position), for a server decoding several
requests at once.

What reads weights is batched over the B rows, so the weights stream from memory once a step, not
B times: the dense projections as one W4A8 GEMM over B rows (matvec.product), the MoE's experts
as one grouped GEMM per projection over the (sequence, expert) slots sorted by expert
(ops.moe.batched). What reads a sequence's own state runs per sequence: the attention over its KV
cache, the GDN step on its conv and recurrent state.

Row b of the logits is bit for bit `Model.decode(tokens[b], states[b])`
(tests/model/test_batch.py): the GEMM tile accumulates each (row, token) exactly as the GEMV tile
does (ops/matvec.py `_make_tile`, one accumulator per pair, the same block order); the fp32
matmuls whose BLAS kernel may change with the row count (router, GDN gates) run row by row; the
row-wise ops (norms, RoPE, quantisation, SwiGLU) are the same bodies. So a request's tokens at
temperature 0 do not depend on what else is in the batch.

Dimension legend: as model/forward.py; B sequences in the batch.
"""

from __future__ import annotations

import numpy as np

from fermijit import FermijitError
from fermijit.model.forward import L2NORM_EPS, Layer, Model, linear
from fermijit.model.state import KvCache, State
from fermijit.model.weights import AttentionWeights, GatedDeltaNetWeights
from fermijit.ops import attention, embedding, gdn_step, matvec, moe, rmsnorm, rope, router


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
        self.act = None                          # xn quantised (Q8Act)
        self.act_attn = None
        # attention: q (query D | gate D per head) | k | v, as decode's joined projection
        self.attn_in = np.empty((B, Cq + 2 * Hkv * D), f)
        self.q = np.empty((B, Hq, D), f)
        self.gate = np.empty((B, Hq, D), f)
        self.k = np.empty((B, Hkv, D), f)
        self.v = np.empty((B, Hkv, D), f)
        self.o = np.empty((B, Hq, D), f)
        # gated deltanet: qkv | z, then b | a; one sequence's step scratch (gdn_step)
        self.gdn_in = np.empty((B, C + Hv * dv), f)
        self.gates_in = np.empty((B, 2 * Hv), f)
        self.gq = np.empty((1, Hk, dk), f)
        self.gk = np.empty((1, Hk, dk), f)
        self.gv = np.empty((1, Hv, dv), f)
        self.g = np.empty((1, Hv), f)
        self.beta = np.empty((1, Hv), f)
        self.go = np.empty((B, Hv, dv), f)
        self.act_gdn = matvec.quantize_act(self.go.reshape(B, -1))  # the layout; filled per row
        self.act_gdn_rows = [matvec.Q8Act(self.act_gdn.xq[b:b + 1], self.act_gdn.dx[b:b + 1],
                                          self.act_gdn.xsum8[b:b + 1], self.act_gdn.vec)
                             for b in range(B)]
        # moe
        self.router_logits = np.empty((B, model.n_experts), f)
        self.ids = np.empty((B, model.top_k), np.int32)
        self.weights = np.empty((B, model.top_k), f)
        self.logits = np.empty((B, model.vocab_size), f)


def decode_batch(model: Model, tokens, states: list[State],
                 ws: BatchWorkspace | None = None) -> np.ndarray:
    """Logits [B, V] after tokens[b] for each sequence b (`states[b]` advanced by one); row b is
    `model.decode(tokens[b], states[b])` bit for bit. `ws` (a BatchWorkspace of B) avoids
    allocating one per step; the result is a view of it."""
    tokens = np.asarray(tokens, np.int32)
    B = len(states)
    if tokens.shape != (B,) or B == 0:
        raise FermijitError(f"decode_batch: {tokens.size} tokens for {B} states (need one each, "
                            f"at least one)")
    if not model.is_quantized or any(w.joined_in is None for w in model.layers):
        raise FermijitError("decode_batch needs a 4-bit fermijit model with joined input "
                            "projections (convert the model again)")
    if len({id(s) for s in states}) != B:
        raise FermijitError("decode_batch: a state appears twice")
    for s in states:
        model._check_room(s, 1)
    if tokens.min() < 0 or tokens.max() >= model.vocab_size:
        raise FermijitError(f"token ids must be in [0, {model.vocab_size}), got "
                            f"[{tokens.min()}, {tokens.max()}]")
    if ws is None or ws.n_seqs != B:
        ws = BatchWorkspace(model, B)
    ws.tokens[:] = tokens
    ws.positions[:] = [s.position for s in states]
    embedding.cpu(ws.tokens, model.embed, out=ws.x)
    for i, w in enumerate(model.layers):
        layer_states = [s.layers[i] for s in states]
        rmsnorm.cpu(ws.x, w.input_norm, model.eps, out=ws.xn)
        ws.act = matvec.quantize_act(ws.xn, out=ws.act)
        if model.is_attention[i]:
            _attention(model, w.mixer, w.joined_in, layer_states, ws)
        else:
            _gated_deltanet(model, w.mixer, w, layer_states, ws)
        ws.x += ws.y                                                   # h = x + mixer(norm(x))
        rmsnorm.cpu(ws.x, w.post_norm, model.eps, out=ws.xn)
        _moe(model, w, ws)
        ws.x += ws.y                                                   # x = h + moe(norm(h))
    for s in states:
        s.position += 1
    return model.logits(ws.x, ws.logits)


def _attention(model: Model, w: AttentionWeights, joined, caches: list[KvCache],
               ws: BatchWorkspace) -> None:
    """Model.attention for B sequences: projections and the row-wise norms and RoPE (each row at
    its own position) batched, the cache write and attention per sequence."""
    B, Hq, D = ws.n_seqs, model.n_heads, model.head_dim
    Cq, HkvD = Hq * 2 * D, model.n_kv_heads * D
    linear(ws.xn, joined, ws.attn_in, ws.act)                          # q | k | v
    qg = ws.attn_in[:, :Cq].reshape(B, Hq, 2 * D)
    np.copyto(ws.q, qg[..., :D])
    np.copyto(ws.gate, qg[..., D:])
    np.copyto(ws.k, ws.attn_in[:, Cq:Cq + HkvD].reshape(ws.k.shape))
    np.copyto(ws.v, ws.attn_in[:, Cq + HkvD:].reshape(ws.v.shape))
    rmsnorm.cpu(ws.q, w.q_norm, model.eps, out=ws.q)
    rmsnorm.cpu(ws.k, w.k_norm, model.eps, out=ws.k)
    rope.cpu(ws.q, ws.positions, model.rotary_dim, model.theta, out=ws.q)
    rope.cpu(ws.k, ws.positions, model.rotary_dim, model.theta, out=ws.k)
    for b, cache in enumerate(caches):
        start = int(ws.positions[b])
        cache.k[:, start] = ws.k[b]                                    # [Hkv, S, D]
        cache.v[:, start] = ws.v[b]
        attention.cpu(ws.q[b:b + 1], cache.k, cache.v, ws.gate[b:b + 1], start,
                      out=ws.o[b:b + 1])
    o = ws.o.reshape(B, -1)
    ws.act_attn = matvec.quantize_act(o, out=ws.act_attn)
    linear(o, w.o_proj, ws.y, ws.act_attn)


def _gated_deltanet(model: Model, w: GatedDeltaNetWeights, layer: Layer, gdn_states,
                    ws: BatchWorkspace) -> None:
    """Model.gated_deltanet for B sequences: the projections batched, one gdn_step each."""
    B, C = ws.n_seqs, model.conv_dim
    Hv, dv = model.n_value_heads, model.value_dim
    linear(ws.xn, layer.joined_in, ws.gdn_in, ws.act)                  # qkv | z
    for b in range(B):  # fp32 [2Hv, H]: row by row, the BLAS call decode makes
        np.matmul(ws.xn[b:b + 1], layer.gates_in.T, out=ws.gates_in[b:b + 1])
    for b, s in enumerate(gdn_states):
        row = ws.gdn_in[b:b + 1]
        gdn_step.cpu(row[:, :C], row[:, C:].reshape(1, Hv, dv), ws.gates_in[b:b + 1, Hv:],
                     ws.gates_in[b:b + 1, :Hv], w.conv1d, s.conv, w.A_log, w.dt_bias, w.norm,
                     model.eps, L2NORM_EPS, s.recurrent, ws.gq, ws.gk, ws.gv, ws.g, ws.beta,
                     ws.go[b:b + 1], ws.act_gdn_rows[b])
    linear(ws.go.reshape(B, -1), w.out_proj, ws.y, ws.act_gdn)


def _moe(model: Model, w: Layer, ws: BatchWorkspace) -> None:
    for b in range(ws.n_seqs):  # fp32 [E, H]: row by row, the BLAS call decode makes
        np.matmul(ws.xn[b:b + 1], w.router.T, out=ws.router_logits[b:b + 1])
    router.cpu(ws.router_logits, model.top_k, out=(ws.ids, ws.weights))
    if model.moe_observer is not None:
        model.moe_observer(w, ws.xn, ws.ids, ws.weights)
    moe.batched(ws.xn, ws.ids, ws.weights, w.experts, out=ws.y)
