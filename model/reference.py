"""The Qwen3.6 text model in float64 numpy, written from MODEL.md §4-6: the spec of the engine.

Short and obvious, not fast: the GDN recurrence runs token by token, attention recomputes full
score matrices. Any number of tokens goes through `forward` with an explicit `State`, so a prompt
is one call and a decode step is another with one token; both return logits for every token.
Quantised weights (`QuantTensor`, and GGUF blocks kept as imported, `BlockTensor`) are
dequantised, so the same code is the reference of the 4-bit model; with `quantize_activations`
their products also quantise the activations per 32-block (`W4A8`, `quantize_q8`: spelled out
here, not imported from the kernels' module, so a rounding bug there cannot hide in its own
spec), or per 256-block for the K-quants (`BlockA8`: ops/kquant.py's numpy Q8_K, llama.cpp's
rounding), which makes it the spec of the quantised path to fp32 rounding.
With `quantize_kv` the queries, keys and values are rounded the same way before attention (an
8-bit Q8_0 KV cache; ops/kv_quant.py).

Dimension legend: as model/weights.py; T tokens in this call, S cached positions.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fermijit.model.config import FULL_ATTENTION, TextConfig
from fermijit.model.weights import (AttentionWeights, BlockTensor, GatedDeltaNetWeights,
                                    MoeWeights, QuantTensor, TextWeights)
from fermijit.ops import kquant, quant

L2NORM_EPS = 1e-6  # inside the root, added to the sum of squares (MODEL.md §6.4)


@dataclasses.dataclass
class KvCache:
    k: np.ndarray  # [S, Hkv, D]  post-norm, post-RoPE
    v: np.ndarray  # [S, Hkv, D]


@dataclasses.dataclass
class GdnState:
    conv: np.ndarray       # [Kc-1, C]  the last pre-conv inputs, oldest first
    recurrent: np.ndarray  # [Hv, dk, dv]


@dataclasses.dataclass
class State:
    position: int                         # tokens seen so far
    layers: list[KvCache | GdnState]      # one per layer


@dataclasses.dataclass(frozen=True)
class W4A8(QuantTensor):
    """A quantised weight whose products quantise their input to Q8_0, as ops.matvec does."""


@dataclasses.dataclass(frozen=True)
class BlockA8(BlockTensor):
    """GGUF blocks whose products quantise their input as the format's dot wants (Q8_K for the
    K-quants, Q8_0 for Q5_0/Q5_1), as ops/kquant_matvec.py does."""


def as_w4a8(tree):
    """Weights (a dataclass tree) with every QuantTensor a W4A8 (BlockTensor a BlockA8);
    nothing is copied."""
    if isinstance(tree, QuantTensor):
        return W4A8(tree.kind, tree.qs, tree.d)
    if isinstance(tree, BlockTensor):
        return BlockA8(tree.kind, tree.blocks, tree.in_perm)
    if isinstance(tree, tuple):
        return tuple(as_w4a8(t) for t in tree)
    if dataclasses.is_dataclass(tree):
        return dataclasses.replace(tree, **{f.name: as_w4a8(getattr(tree, f.name))
                                            for f in dataclasses.fields(tree)})
    return tree


def expert(w, e):
    """Expert `e` of a stacked [E, ...] weight, quantised or not."""
    if isinstance(w, QuantTensor):
        return dataclasses.replace(w, qs=w.qs[e], d=w.d[e])
    if isinstance(w, BlockTensor):
        return dataclasses.replace(w, blocks=w.blocks[e])
    return w[e]


def dense(w) -> np.ndarray:
    """A weight as float64 (dequantised if it is quantised)."""
    if isinstance(w, QuantTensor):
        deq = quant.dequantize_q4_0 if w.kind == "q4_0" else quant.dequantize_q8_0
        return deq(np.asarray(w.qs), np.asarray(w.d)).astype(np.float64)
    if isinstance(w, BlockTensor):
        deq = kquant.dequantize(kquant.FORMATS[w.kind], np.asarray(w.blocks)).astype(np.float64)
        # columns in input order: the blocks' column j multiplies input in_perm[j]
        return deq if w.in_perm is None else deq[..., np.argsort(w.in_perm)]
    return np.asarray(w, dtype=np.float64)


ACT_BLOCK = 32  # activations share one scale per 32 consecutive values of a token (DESIGN.md)


def quantize_q8(x):
    """x [..., K] as the W4A8 products see it: per 32-block, scale d = max|x| / 127 and
    q = x / d rounded half away from zero, returned dequantised (q · d, float64).

    fp32 arithmetic, dividing by multiplying with the fp32 reciprocal of d, as the kernels do:
    anything else moves some values across a rounding boundary (one int8 off by one), a real
    error at the tolerance the W4A8 tests hold (tests/model/test_forward.py)."""
    xb = np.asarray(x, np.float32).reshape(*np.shape(x)[:-1], -1, ACT_BLOCK)
    d = np.abs(xb).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    v = xb * inv
    q = np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))       # half away from zero
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(np.shape(x))


def linear(x, w):
    """x [..., in] · wᵀ, w [out, in]. W4A8: the weights times the activations as quantised to
    8 bits: the kernels' exact integer block sums, scaled, are this same sum in float64."""
    if isinstance(w, W4A8):
        x = quantize_q8(x)
    if isinstance(w, BlockA8):  # the activations as the kernel rounds them: in its column order
        xs = x if w.in_perm is None else np.take(x, w.in_perm, axis=-1)
        xs = quantize_q8(xs) if kquant.FORMATS[w.kind].block_values != kquant.QK_K else \
            quantize_q8_k(xs)
        x = xs if w.in_perm is None else xs[..., np.argsort(w.in_perm)]
    return x @ dense(w).T


def quantize_q8_k(x):
    """x [..., K] as a K-quant product sees it: llama.cpp's Q8_K (ops/kquant.py), dequantised."""
    x2 = np.asarray(x, np.float32).reshape(-1, np.shape(x)[-1])
    q, d, _ = kquant.quantize_q8_k(x2)
    deq = q.astype(np.float64) * np.repeat(d.astype(np.float64), kquant.QK_K, axis=1)
    return deq.reshape(np.shape(x))


def silu(x):
    return x / (1 + np.exp(-x))


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def softplus(x):
    return np.logaddexp(0, x)


def rmsnorm(x, w, eps):
    """Zero-centred RMSNorm over the last axis: the scale is 1 + w (MODEL.md §4)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1 + dense(w))


def gated_rmsnorm(o, z, w, eps):
    """GDN output norm: plain weight w, normalise first, then gate by silu(z) (MODEL.md §4)."""
    return dense(w) * (o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + eps)) * silu(z)


def rope(x, positions, rotary_dim, theta):
    """Rotate-half RoPE on the first `rotary_dim` dims of each head; x [T, heads, D].
    Text tokens have T=H=W positions, so interleaved MRoPE is plain 1-D RoPE (MODEL.md §5.4)."""
    half = rotary_dim // 2
    inv = theta ** (-np.arange(half, dtype=np.float64) * 2 / rotary_dim)   # [half]
    angle = positions[:, None, None] * inv                               # [T, 1, half]
    a, b, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    cos, sin = np.cos(angle), np.sin(angle)
    return np.concatenate([a * cos - b * sin, b * cos + a * sin, rest], axis=-1)


def attention(x, w: AttentionWeights, cache: KvCache, positions, n_heads, n_kv_heads, head_dim,
              rotary_dim, theta, eps, quantize_kv=False):
    """Gated GQA attention over the cache plus these tokens (MODEL.md §5); x [T, H]. With
    `quantize_kv`, q, k and v rounded to Q8_0 per head (the cache stores k, v so rounded)."""
    T, D = x.shape[0], head_dim
    qg = linear(x, w.q_proj).reshape(T, n_heads, 2 * D)          # per head: query | gate
    q, gate = qg[..., :D], qg[..., D:].reshape(T, n_heads * D)
    k = linear(x, w.k_proj).reshape(T, n_kv_heads, D)
    v = linear(x, w.v_proj).reshape(T, n_kv_heads, D)
    q = rope(rmsnorm(q, w.q_norm, eps), positions, rotary_dim, theta)
    k = rope(rmsnorm(k, w.k_norm, eps), positions, rotary_dim, theta)
    if quantize_kv:
        q, k, v = quantize_q8(q), quantize_q8(k), quantize_q8(v)
    cache.k, cache.v = np.concatenate([cache.k, k]), np.concatenate([cache.v, v])
    S = cache.k.shape[0]
    kv = np.repeat(np.arange(n_kv_heads), n_heads // n_kv_heads)   # q head h reads kv head h//g
    scores = np.einsum("thd,shd->hts", q, cache.k[:, kv]) / np.sqrt(D)   # [Hq, T, S]
    is_future = np.arange(S)[None, :] > positions[:, None]               # [T, S]
    scores = np.where(is_future, -np.inf, scores)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    o = np.einsum("hts,shd->thd", p, cache.v[:, kv]).reshape(T, n_heads * D)
    return linear(o * sigmoid(gate), w.o_proj)


def gated_deltanet(x, w: GatedDeltaNetWeights, state: GdnState, n_key_heads, key_head_dim,
                   value_head_dim, eps):
    """Gated DeltaNet, recurrent form (MODEL.md §6); x [T, H]."""
    T, dk, dv = x.shape[0], key_head_dim, value_head_dim
    Hk, Hv = n_key_heads, dense(w.A_log).shape[0]
    mixed = linear(x, w.in_proj_qkv)                                 # [T, C]
    z = linear(x, w.in_proj_z).reshape(T, Hv, dv)
    b, a = linear(x, w.in_proj_b), linear(x, w.in_proj_a)            # [T, Hv]
    # Causal depthwise conv: the last tap multiplies the current token.
    conv_w = dense(w.conv1d)                                         # [C, Kc]
    Kc = conv_w.shape[1]
    window = np.concatenate([state.conv, mixed])                      # [Kc-1+T, C]
    c = silu(sum(conv_w[:, j] * window[j:j + T] for j in range(Kc)))
    state.conv = window[T:]
    q = c[:, :Hk * dk].reshape(T, Hk, dk)
    k = c[:, Hk * dk:2 * Hk * dk].reshape(T, Hk, dk)
    v = c[:, 2 * Hk * dk:].reshape(T, Hv, dv)
    q = q / np.sqrt(np.sum(q * q, axis=-1, keepdims=True) + L2NORM_EPS) / np.sqrt(dk)
    k = k / np.sqrt(np.sum(k * k, axis=-1, keepdims=True) + L2NORM_EPS)
    q, k = np.repeat(q, Hv // Hk, axis=1), np.repeat(k, Hv // Hk, axis=1)  # v head h: key h//g
    beta = sigmoid(b)
    alpha = np.exp(-np.exp(dense(w.A_log)) * softplus(a + dense(w.dt_bias)))  # decay in (0, 1)
    S = state.recurrent                                              # [Hv, dk, dv]
    o = np.empty((T, Hv, dv))
    for t in range(T):
        S = alpha[t, :, None, None] * S
        r = np.einsum("hkv,hk->hv", S, k[t])                          # what S predicts for k
        S = S + np.einsum("hk,hv->hkv", k[t], beta[t, :, None] * (v[t] - r))
        o[t] = np.einsum("hkv,hk->hv", S, q[t])
    state.recurrent = S
    return linear(gated_rmsnorm(o, z, w.norm, eps).reshape(T, Hv * dv), w.out_proj)


def moe(x, w: MoeWeights, top_k):
    """Top-k routed SwiGLU experts, renormalised, plus the sigmoid-gated shared expert (§4)."""
    logits = linear(x, w.gate)                                       # [T, E]
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        chosen = np.argsort(-p[t], kind="stable")[:top_k]
        weights = p[t, chosen] / p[t, chosen].sum()
        for e, we in zip(chosen, weights):
            out[t] += we * swiglu(x[t], expert(w.experts_gate_up, e), expert(w.experts_down, e))
    shared = swiglu(x, w.shared_gate_up, w.shared_down)
    return out + sigmoid(linear(x, w.shared_expert_gate)) * shared


def swiglu(x, gate_up, down):
    """down · (silu(g) ⊙ u) with [g; u] = gate_up · x; gate_up [2I, H], down [H, I]."""
    g, u = np.split(linear(x, gate_up), 2, axis=-1)
    return linear(silu(g) * u, down)


class Reference:
    """The text model: holds the config's numbers and the weights; state is passed in and out."""

    def __init__(self, cfg: TextConfig, weights: TextWeights, quantize_activations: bool = False,
                 quantize_kv: bool = False):
        self.w = as_w4a8(weights) if quantize_activations else weights
        self.layer_types = cfg.layer_types
        self.eps = cfg.rms_norm_eps
        self.top_k = cfg.num_experts_per_tok
        self.attn = dict(n_heads=cfg.num_attention_heads, n_kv_heads=cfg.num_key_value_heads,
                         head_dim=cfg.head_dim, rotary_dim=cfg.rotary_dim,
                         theta=cfg.rope_parameters.rope_theta, eps=cfg.rms_norm_eps,
                         quantize_kv=quantize_kv)
        self.gdn = dict(n_key_heads=cfg.linear_num_key_heads,
                        key_head_dim=cfg.linear_key_head_dim,
                        value_head_dim=cfg.linear_value_head_dim, eps=cfg.rms_norm_eps)
        self.kv_shape = (cfg.num_key_value_heads, cfg.head_dim)
        self.gdn_shapes = ((cfg.linear_conv_kernel_dim - 1, cfg.linear_conv_dim),
                           (cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                            cfg.linear_value_head_dim))

    def new_state(self) -> State:
        layers = [KvCache(np.zeros((0,) + self.kv_shape), np.zeros((0,) + self.kv_shape))
                  if kind == FULL_ATTENTION else
                  GdnState(np.zeros(self.gdn_shapes[0]), np.zeros(self.gdn_shapes[1]))
                  for kind in self.layer_types]
        return State(position=0, layers=layers)

    def forward(self, tokens, state: State) -> np.ndarray:
        """Logits [T, V] for `tokens` [T] following the `state.position` tokens seen; updates state."""
        return linear(self.hidden(tokens, state), self.w.lm_head)

    def hidden(self, tokens, state: State) -> np.ndarray:
        """The final normed hidden states [T, H] of `tokens` (what the LM head and the MTP head
        read); updates state."""
        positions = np.arange(state.position, state.position + len(tokens))
        x = embed(self.w.embed_tokens, np.asarray(tokens))                  # [T, H]
        for w, s in zip(self.w.layers, state.layers):
            x = self.layer(x, w, s, positions)
        state.position += len(tokens)
        return rmsnorm(x, self.w.norm, self.eps)

    def layer(self, x, w, s, positions):
        """A decoder layer (MODEL.md §4): the mixer, then the MoE, each on a residual."""
        h = x + self.mixer(rmsnorm(x, w.input_layernorm, self.eps), w.mixer, s, positions)
        return h + moe(rmsnorm(h, w.post_attention_layernorm, self.eps), w.mlp, self.top_k)

    def new_mtp_cache(self) -> KvCache:
        return KvCache(np.zeros((0,) + self.kv_shape), np.zeros((0,) + self.kv_shape))

    def mtp(self, tokens, hidden, cache: KvCache):
        """The MTP head (MODEL.md §10) over rows [S, S + T), S the rows `cache` holds: row q takes
        token q+1 (`tokens` [T]) and the final normed hidden state of position q (`hidden`
        [T, H], or the head's own output of the row before when chaining). Returns (logits
        [T, V] of token q+2, the normed output [T, H]); the cache gets the rows."""
        m = self.w.mtp
        positions = np.arange(cache.k.shape[0], cache.k.shape[0] + len(tokens))
        e = rmsnorm(embed(self.w.embed_tokens, np.asarray(tokens)), m.pre_fc_norm_embedding,
                    self.eps)
        h = rmsnorm(np.asarray(hidden, np.float64), m.pre_fc_norm_hidden, self.eps)
        x = linear(np.concatenate([e, h], axis=-1), m.fc)                  # embedding first
        out = rmsnorm(self.layer(x, m.layer, cache, positions), m.norm, self.eps)
        return linear(out, self.w.lm_head), out

    def mixer(self, x, w, s, positions):
        if isinstance(w, AttentionWeights):
            return attention(x, w, s, positions, **self.attn)
        return gated_deltanet(x, w, s, **self.gdn)


def embed(table, tokens):
    """Rows of the embedding (only those rows are dequantised)."""
    if isinstance(table, QuantTensor):
        return dense(QuantTensor(table.kind, table.qs[tokens], table.d[tokens]))
    if isinstance(table, BlockTensor):
        return dense(BlockTensor(table.kind, table.blocks[tokens]))
    return dense(table[tokens])
