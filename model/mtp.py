"""The multi-token-prediction head (MODEL.md §10) on the CPU: one more full-attention MoE decoder
layer that, from the model's final normed hidden state at position q and the embedding of token
q+1, predicts token q+2:

    e = rmsnorm(embed(x[q+1]), pre_fc_norm_embedding)        h = rmsnorm(hidden[q], pre_fc_norm_hidden)
    x = fc · [e; h]                                           (embedding first)
    x = x + attention(rmsnorm(x, input_norm))                 (its own KV cache, RoPE position q)
    x = x + moe(rmsnorm(x, post_norm))
    out = rmsnorm(x, norm);  logits = lm_head · out           (the model's LM head)

as vLLM's qwen3_5_mtp / qwen3_next_mtp and llama.cpp's qwen35moe MTP graph define it. Its row q
pairs hidden state q with token q+1, so it lags the model by one position: a state run with the
head (Model.new_state(..., mtp=True)) keeps the layer's cache as its last layer, rows [0, q0),
and in `state.hidden` the hidden states of positions [q0, position) not consumed yet (one at
rest: row position - 1 waits for the next token). `consume` computes the waiting rows once their
next tokens are known; `chain` drafts further from the head's own output (the previous row's
`out` as the hidden state, as both references chain a one-layer head), writing rows past the
model's position that the next `consume` overwrites.

The layer runs through the model's own prefill ops (Model.attention and Model.moe on a
Workspace of the rows), so the REAP observer sees its MoE too. Dimension legend: as
model/forward.py; T rows.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fermijit import FermijitError
from fermijit.model.state import KvCache, State
from fermijit.ops import embedding, rmsnorm


@dataclasses.dataclass(frozen=True)
class Head:
    """The head's weights as the forward takes them (forward.Layer for its decoder layer)."""

    pre_fc_norm_embedding: np.ndarray  # [H]  zero-centred
    pre_fc_norm_hidden: np.ndarray     # [H]  zero-centred
    fc: object                         # [H, 2H]  Q4Matrix or fp32
    layer: object                      # forward.Layer, full attention
    norm: np.ndarray                   # [H]  zero-centred


def head(weights) -> Head:
    """weights.MtpWeights as the forward takes them."""
    from fermijit.model.forward import _host, _layer, _matrix

    return Head(_host(weights.pre_fc_norm_embedding), _host(weights.pre_fc_norm_hidden),
                _matrix(weights.fc), _layer(weights.layer), _host(weights.norm))


def has_head(model, state: State) -> bool:
    """Whether `state` carries the MTP layer (its cache last, `hidden` set)."""
    return state.hidden is not None and len(state.layers) == len(model.layers) + 1


def cache(model, state: State) -> KvCache:
    if not has_head(model, state):
        raise FermijitError("this state was made without the MTP layer "
                            "(Model.new_state(..., mtp=True))")
    return state.layers[len(model.layers)]


class Workspace:
    """A pass of T rows: the model's forward.Workspace and the [T, 2H] input of fc."""

    def __init__(self, model, n_rows: int):
        from fermijit.model.forward import Workspace as ForwardWorkspace

        self.ws = ForwardWorkspace(model, n_rows)
        self.cat = np.empty((n_rows, 2 * model.hidden), np.float32)   # e | h, normed
        self.logits = np.empty((1, model.vocab_size), np.float32)


KEPT_ROWS = 16  # workspaces of up to this many rows are kept (a step's: 1 to N+1 rows)


def _workspace(model, n_rows: int) -> Workspace:
    """One per row count, kept on the model: every size up to KEPT_ROWS, and the two last of
    more (prefill passes, whose last one is shorter)."""
    spaces = model.__dict__.setdefault("_mtp_ws", {})
    ws = spaces.get(n_rows)
    if ws is None:
        ws = spaces[n_rows] = Workspace(model, n_rows)
        large = [n for n in spaces if n > KEPT_ROWS and n != n_rows]
        for n in large[:-1]:
            del spaces[n]
    return ws


def forward_rows(model, kv: KvCache, start: int, tokens, hidden, with_logits: bool = True,
                 vocab: int | None = None,
                 like_decode: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """The head over rows [start, start + T): tokens [T] (token q+1 of row q), hidden [T, H]
    (hidden state q, or the head's own output when chaining); writes their keys and values into
    `kv`, which holds rows [0, start). Returns (out [T, H], the normed output; logits of the
    last row, or None: [V], or the first `vocab` ids' [vocab] (a draft vocabulary: see
    `lm_head_rows`)). Both are views of buffers the next call of as many rows overwrites.
    `like_decode`: a draft's few rows through decode's kernels where the model takes them
    (`DecodeRows`), else prefill's ops."""
    from fermijit.model.forward import Segment, linear

    m = model.mtp
    tokens = np.asarray(tokens, np.int32)
    T, H, eps = tokens.size, model.hidden, model.eps
    model._check_token(tokens)
    if np.shape(hidden) != (T, H):
        raise FermijitError(f"mtp: hidden has shape {list(np.shape(hidden))}, expected [{T}, {H}]")
    if start + T > kv.k.shape[1]:
        raise FermijitError(f"mtp: rows up to {start + T} exceed the context of {kv.k.shape[1]}")
    if like_decode and T <= DECODE_ROWS_MAX and _takes_decode_rows(model):
        rows = model.__dict__.setdefault("_mtp_decode_rows", {})
        plan = rows.get(T) or rows.setdefault(T, DecodeRows(model, T))
        return plan.run(kv, start, tokens, hidden, with_logits, vocab)
    w = _workspace(model, T)
    ws = w.ws
    # hidden first: chaining passes the last call's output, a view of this workspace's xn
    rmsnorm.cpu(np.ascontiguousarray(hidden, np.float32), m.pre_fc_norm_hidden, eps, out=ws.y)
    ws.tokens[:] = tokens
    embedding.cpu(ws.tokens, model.embed, out=ws.x)
    rmsnorm.cpu(ws.x, m.pre_fc_norm_embedding, eps, out=ws.xn)
    np.concatenate([ws.xn, ws.y], axis=1, out=w.cat)
    linear(w.cat, m.fc, ws.x)                                            # x = fc · [e; h]
    np.add(ws.offsets, start, out=ws.positions)
    layer = m.layer
    rmsnorm.residual_cpu(ws.x, None, layer.input_norm, eps, out=ws.xn)
    model.attention(layer.mixer, layer.joined_in, [kv], [Segment(slice(0, T), start)],
                    ws)                                                  # ws.y
    rmsnorm.residual_cpu(ws.x, ws.y, layer.post_norm, eps, out=ws.xn)   # x += attention
    model.moe(layer, ws)
    ws.x += ws.y
    rmsnorm.cpu(ws.x, m.norm, eps, out=ws.xn)
    if not with_logits:
        return ws.xn, None
    n = model.vocab_size if vocab is None else vocab
    linear(ws.xn[-1:], lm_head_rows(model, n), w.logits[:, :n])
    return ws.xn, w.logits[0, :n]


DECODE_ROWS_MAX = 4  # a draft's head rows: the accepted tokens of a step and the next one


def _takes_decode_rows(model) -> bool:
    """Whether the head's rows can run through decode's kernels (DecodeRows): a 4-bit model
    that batched decode takes, its head Q4_0 with joined q | k | v, no REAP observer watching
    (it counts prefill's MoE calls)."""
    from fermijit.model import batch
    from fermijit.ops import matvec

    m = model.mtp
    return (model.moe_observer is None and batch.can_batch(model)
            and isinstance(m.fc, matvec.Q4Matrix) and m.layer.joined_in is not None)


class DecodeRows:
    """The head over T rows as decode runs a token (model/batch.py's per-row fused steps and
    like-GEMV products, a plan of calls made once per KV cache), not prefill's ops
    (Model.attention, Model.moe on a Workspace), whose one-row calls are not decode's fused
    kernels; its logits read the LM head as any decode token does. The rows' numbers differ
    from prefill's by rounding only (another order of sums): the drafts are the head's either
    way, and the model's verify decides every token."""

    def __init__(self, model, n_rows: int):
        from fermijit.jit.cpu import decode_isa
        from fermijit.model.batch import BatchWorkspace
        from fermijit.ops import matvec

        f, H = np.float32, model.hidden
        self.model, self.n_rows = model, n_rows
        self.ws = BatchWorkspace(model, n_rows)
        self.hidden = np.empty((n_rows, H), f)
        self.e = np.empty((n_rows, H), f)
        self.h = np.empty((n_rows, H), f)
        self.cat = np.empty((n_rows, 2 * H), f)                       # e | h, normed
        self.act_cat = matvec.quantize_act(self.cat, decode_isa())
        self.logits = np.empty((1, model.vocab_size), f)
        self.kv: tuple | None = None   # the cache arrays the steps were made for
        self.steps: list = []

    def run(self, kv: KvCache, start: int, tokens, hidden, with_logits: bool,
            vocab: int | None) -> tuple[np.ndarray, np.ndarray | None]:
        from fermijit.model.forward import linear, run_steps

        ws, model = self.ws, self.model
        if self.kv is None or self.kv[0] is not kv.k or self.kv[1] is not kv.v:
            self.kv, self.steps = (kv.k, kv.v), self._steps(kv)
        self.hidden[...] = hidden  # first: chaining passes a view of ws.xn
        ws.tokens[:] = tokens
        np.add(np.arange(self.n_rows), start, out=ws.positions)
        run_steps(self.steps)
        if not with_logits:
            return ws.xn, None
        n = model.vocab_size if vocab is None else vocab
        linear(ws.xn[-1:], lm_head_rows(model, n), self.logits[:, :n])
        return ws.xn, self.logits[0, :n]

    def _steps(self, kv: KvCache) -> list:
        from fermijit.model import batch
        from fermijit.ops import matvec

        model, ws, m = self.model, self.ws, self.model.mtp
        layer, mixer, eps = m.layer, m.layer.mixer, model.eps

        def product(act, w, out):
            return ("matvec.product", *matvec.launch(w, act, out, like_gemv=True))

        def residual(y, norm_w, w, p, routed=False):
            return [batch.residual_rows_step(ws, y, norm_w, eps, w, p, routed)]

        steps = [("rmsnorm.cpu", rmsnorm.cpu, (self.hidden, m.pre_fc_norm_hidden, eps, self.h)),
                 ("embedding.cpu", embedding.cpu, (ws.tokens, model.embed, ws.x)),
                 ("rmsnorm.cpu", rmsnorm.cpu, (ws.x, m.pre_fc_norm_embedding, eps, self.e)),
                 ("concatenate", np.concatenate, ((self.e, self.h), 1, self.cat)),
                 ("matvec.quantize_act", matvec.quantize_act, (self.cat, None, self.act_cat)),
                 product(self.act_cat, m.fc, ws.x)]                   # x = fc · [e; h]
        steps += residual(None, layer.input_norm, ws.no_product, None)
        steps.append(product(ws.act, layer.joined_in, ws.attn_in))    # q | k | v
        steps += batch.attention_rows_steps(model, mixer, kv, ws)
        steps.append(product(ws.act_attn, mixer.o_proj, ws.y))
        steps += residual(ws.y, layer.post_norm, layer.router, ws.router_logits, routed=True)
        steps += batch.moe_rows_steps(ws, layer.experts)
        steps += [("add", np.add, (ws.x, ws.y, ws.x)),                 # x += moe
                  ("rmsnorm.cpu", rmsnorm.cpu, (ws.x, m.norm, eps, ws.xn))]
        return steps


def lm_head_rows(model, n: int):
    """The LM head's first n rows (views): a draft vocabulary. Byte-level BPE numbers its tokens
    in merge order, so the first ids are the most frequent ones (the default model's first 4096
    of 8192 ids are 91% of its held-out text's tokens), and the draft's LM head, as large as the
    model's (0.54 GB a token of the real model's ~1.7), reads n / V of it. A draft outside them
    is simply never made; the model's verify decides every token either way."""
    from fermijit.model.weights import QuantTensor
    from fermijit.ops import matvec

    head = model.lm_head
    if not 0 < n <= model.vocab_size:
        raise FermijitError(f"--draft-vocab must be between 1 and {model.vocab_size}, got {n}")
    if n == model.vocab_size:
        return head
    if isinstance(head, matvec.Q4Matrix):
        return matvec.Q4Matrix(head.qs[:n], head.d_bits[:n])
    if isinstance(head, QuantTensor):
        return QuantTensor(head.kind, head.qs[:n], head.d[:n])
    return head[:n]


def consume(model, state: State, tokens, with_logits: bool = True, vocab: int | None = None,
            like_decode: bool = False):
    """The rows of the first len(tokens) waiting hidden states, `tokens` their next tokens
    (token q+1 of waiting position q): (out [T, H], logits [V] of the last row or None), as
    forward_rows. The waiting states not consumed stay in `state.hidden`."""
    kv = cache(model, state)
    tokens = np.asarray(tokens, np.int32)
    n_waiting = state.hidden.shape[0]
    if not 0 < tokens.size <= n_waiting:
        raise FermijitError(f"mtp: {tokens.size} tokens for {n_waiting} waiting hidden states")
    start = state.position - n_waiting
    out = forward_rows(model, kv, start, tokens, state.hidden[:tokens.size], with_logits, vocab,
                       like_decode)
    state.hidden = state.hidden[tokens.size:]
    return out


def chain(model, state: State, row: int, token: int, hidden,
          vocab: int | None = None, like_decode: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """A further draft: row `row` (past the rows consumed) from `token` and the head's own
    output `hidden` [H] of the row before. Returns (out [1, H], logits), as forward_rows."""
    kv = cache(model, state)
    return forward_rows(model, kv, row, [token], np.asarray(hidden, np.float32)[None],
                        vocab=vocab, like_decode=like_decode)


def after_block(model, state: State, block, x, end: int | None = None) -> None:
    """Prefill's share: the model has just run `block` (tokens [T]), ending at position `end`
    (default the state's), with final residual x [T, H]; their normed hidden states wait, and
    every waiting row whose next token is now known (all but the last) is computed. At rest one
    row waits, so the rows' next tokens are the block's own (all of them after the first block,
    all but the first in it)."""
    end = state.position if end is None else end
    waiting = np.concatenate([state.hidden, rmsnorm.cpu(np.ascontiguousarray(x, np.float32),
                                                        model.norm, model.eps)])
    n = waiting.shape[0] - 1
    if n > block.size:
        raise FermijitError(f"mtp: {state.hidden.shape[0]} hidden states waiting before a "
                            f"prefill (1 at rest)")
    if n:
        forward_rows(model, cache(model, state), end - waiting.shape[0], block[block.size - n:],
                     waiting[:n], with_logits=False)
    state.hidden = waiting[n:].copy()
