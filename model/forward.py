"""The Qwen3.6 text model on the CPU (MODEL.md §4-6), composed from ops/: prefill and decode.

One forward serves both: T tokens after `state.position` through every layer,
    h = x + mixer(rmsnorm(x, input_norm), state)        (GDN or gated attention)
    x = h + moe(rmsnorm(h, post_norm))
then the final norm and the LM head. Prefill runs it over blocks of the prompt (T up to
PREFILL_BLOCK: batched W4A8 GEMMs, ops' multi-token forms, per-expert GEMMs in the MoE); decode
runs it with T = 1 (GEMVs, one GDN step, attention over the KV cache, the MoE reading only the
selected experts and the shared one). Every intermediate lives in a `Workspace` made once per T,
so a decode token allocates nothing but a few small op scratch arrays.

Weights are either the fermijit format (Q4_0 big matrices, a Q8_0/Q4_0 LM head, memory-mapped:
model/convert.py) or an HF checkpoint in fp32, for reference runs: the same forward, with numpy
matmuls for fp32 matrices and a numpy MoE for fp32 experts.

Dimension legend: as model/weights.py; T tokens in this pass.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses

import numpy as np

from fermijit import FermijitError
from fermijit.host import blas, numa
from fermijit.jit import omp, sequence
from fermijit.jit.cpu import kernel
from fermijit.model.config import FULL_ATTENTION, ModelConfig, TextConfig
from fermijit.model import block_moe
from fermijit.model.block_moe import BlockExperts
from fermijit.model.state import (DEFAULT_KV, GdnState, KvCache, KvKind, State, new_state,
                                   state_nbytes)
from fermijit.model.weights import (AttentionWeights, BlockTensor, GatedDeltaNetWeights,
                                    QuantTensor, TextWeights)
from fermijit.ops import (attention, attention_step, conv1d, embedding, fp32_rows, gated_delta,
                          gdn_step, kquant, kquant_matvec, l2norm, matvec, moe, residual_step,
                          rmsnorm, rope, router)

# Tokens per prefill pass: the GEMMs are batched over this many tokens while the workspace stays
# bounded: 103 MiB for the real model at 512 (1.1 MiB at T = 1, most of it the logits).
PREFILL_BLOCK = 512
L2NORM_EPS = 1e-6  # MODEL.md §6.4: inside the root, added to the sum of squares


def pass_size(position: int, n_left: int, align: int | None = None,
              limit: int | None = None) -> int:
    """Tokens of a sequence's next prefill pass, `n_left` tokens to go after `position`: at
    most `limit` (default PREFILL_BLOCK), ending at the next multiple of `align` when that comes
    sooner (the snapshot positions: a span), and never leaving one token of a span behind; 0 when
    `limit` leaves no such pass.

    Why: every row of a pass of two or more tokens has the same bits however the prompt is cut
    into such passes (the GEMMs' tiles never mix tokens, attention's key ranges follow the
    query's position, the delta rule is a token loop: measured equal on the default model, 700
    tokens cut 300|400, 2|498|200, 64|64|512|60), but a pass of one token runs decode's kernels,
    whose sums are rounded in another order (1e-6 on the logits, and after 8-bit flips far more).
    So one-token passes happen only where a span is one token long, whoever cuts the passes:
    alone, batched with other sequences (Model.prefill_batch) or in a server's chunks."""
    limit = PREFILL_BLOCK if limit is None else limit
    span = n_left if align is None else min(n_left, align - position % align)
    if span <= limit:
        return span
    n = limit if span - limit != 1 else limit - 1
    return n if n >= 2 else 0


@dataclasses.dataclass(frozen=True)
class Segment:
    """One sequence's rows of a pass over several (Model.prefill_batch), after `start` positions
    of its own state."""

    rows: slice
    start: int


@dataclasses.dataclass(frozen=True)
class DenseExperts:
    """The MoE experts of an unquantised checkpoint, in ops.moe.MoeWeights' layout, fp32."""

    gate_up: np.ndarray         # [E, 2I, H]  rows: gate I | up I
    down: np.ndarray            # [E, H, I]
    shared_gate_up: np.ndarray  # [1, 2Is, H]
    shared_down: np.ndarray     # [1, H, Is]
    shared_gate: np.ndarray     # [H]


@dataclasses.dataclass(frozen=True)
class Layer:
    input_norm: np.ndarray                          # [H]  zero-centred
    mixer: GatedDeltaNetWeights | AttentionWeights  # Q4_0 or fp32 projections
    post_norm: np.ndarray                           # [H]  zero-centred
    router: np.ndarray                              # [E, H] fp32
    experts: moe.MoeWeights | DenseExperts | BlockExperts
    # Decode reads the mixer's input projections in one launch where they lie back to back in
    # memory (a converted file stores them so): GDN [qkv; z] [C + Hv·dv, H], attention
    # [q; k; v] [Hq·2D + 2·Hkv·D, H] (Q4_0, or blocks of one kind); None otherwise. GDN's
    # [b; a] [2Hv, H] fp32 always.
    joined_in: matvec.Q4Matrix | BlockTensor | None = None
    gates_in: np.ndarray | None = None


def _host(a):
    """A memmap view as a plain ndarray view (no copy), as the Numba kernels want."""
    if isinstance(a, QuantTensor):
        return QuantTensor(a.kind, np.asarray(a.qs), np.asarray(a.d))
    if isinstance(a, BlockTensor):
        return BlockTensor(a.kind, np.asarray(a.blocks), a.in_perm)
    return np.asarray(a)


def _matrix(a):
    """A projection as `linear` takes it: Q4_0 checked once (matvec.Q4Matrix), so a decode
    token's hundreds of GEMVs skip the per-call weight checks; others as _host gives them."""
    a = _host(a)
    if isinstance(a, QuantTensor) and a.kind == "q4_0":
        return matvec.Q4Matrix.of(a.qs, a.d)
    return a


def _experts(mlp) -> moe.MoeWeights | DenseExperts | BlockExperts:
    """The MoE weights as ops.moe wants them (Q4_0), or as model/block_moe.py does (GGUF
    blocks kept as imported, Q8_0); the shared expert as an expert tensor of one ([1, ...]
    views, no copy)."""
    shared_gate = _host(mlp.shared_expert_gate)[0]                       # [H]
    if isinstance(mlp.experts_gate_up, (QuantTensor, BlockTensor)):
        parts = [_host(mlp.experts_gate_up), _host(mlp.experts_down)]
        shared = [_host(mlp.shared_gate_up), _host(mlp.shared_down)]
        if any(isinstance(q, BlockTensor) or q.kind != "q4_0" for q in parts + shared):
            return BlockExperts(*parts, *shared, shared_gate)
        return moe.MoeWeights(parts[0].qs, parts[0].d, parts[1].qs, parts[1].d,
                              shared[0].qs[None], shared[0].d[None], shared[1].qs[None],
                              shared[1].d[None], shared_gate)
    return DenseExperts(_host(mlp.experts_gate_up), _host(mlp.experts_down),
                        _host(mlp.shared_gate_up)[None], _host(mlp.shared_down)[None], shared_gate)


def _back_to_back(arrays: list[np.ndarray]) -> np.ndarray | None:
    """One view over the rows of `arrays` when they lie back to back in memory, else None."""
    first = arrays[0]
    addr = first.ctypes.data
    for a in arrays:
        if (a.ctypes.data != addr or a.dtype != first.dtype or a.shape[1:] != first.shape[1:]
                or not a.flags.c_contiguous):
            return None
        addr += a.nbytes
    rows = sum(a.shape[0] for a in arrays)
    return np.lib.stride_tricks.as_strided(first, (rows, *first.shape[1:]), first.strides,
                                           writeable=False)


def _joined(mats) -> matvec.Q4Matrix | BlockTensor | None:
    """The Q4_0 matrices `mats` (reading the same input), or the block matrices of one kind in
    their own column order, as one, without a copy, or None."""
    if all(isinstance(m, BlockTensor) and m.kind == mats[0].kind and m.in_perm is None
           for m in mats):
        blocks = _back_to_back([m.blocks for m in mats])
        return None if blocks is None else BlockTensor(mats[0].kind, blocks)
    if not all(isinstance(m, matvec.Q4Matrix) for m in mats):
        return None
    qs, d_bits = _back_to_back([m.qs for m in mats]), _back_to_back([m.d_bits for m in mats])
    return None if qs is None or d_bits is None else matvec.Q4Matrix(qs, d_bits)


def _layer(w) -> Layer:
    mixer = type(w.mixer)(**{f.name: _matrix(getattr(w.mixer, f.name))
                             for f in dataclasses.fields(w.mixer)})
    if isinstance(mixer, GatedDeltaNetWeights):
        joined_in = _joined([mixer.in_proj_qkv, mixer.in_proj_z])
        gates_in = np.concatenate([mixer.in_proj_b, mixer.in_proj_a])   # 2 x [Hv, H]: small
        gates_in.flags.writeable = False  # as the mapped weights: one kernel signature for both
    else:
        joined_in, gates_in = _joined([mixer.q_proj, mixer.k_proj, mixer.v_proj]), None
    return Layer(_host(w.input_layernorm), mixer, _host(w.post_attention_layernorm),
                 _host(w.mlp.gate), _experts(w.mlp), joined_in, gates_in)


def linear(x, w, out, act=None, *, like_gemv: bool = False):
    """out [T, R] = x [T, K] · wᵀ. Q4_0: W4A8 GEMM/GEMV on `act` (x quantised once for all the
    matrices reading it) or x; Q8_0 (the LM head option, some GGUF imports): `act` or x quantised
    here; fp32: numpy. `like_gemv`: Q4_0 rows of several tokens each bit for bit the GEMV's
    (matvec.product)."""
    if isinstance(w, matvec.Q4Matrix):
        return matvec.product(w, matvec.quantize_act(x) if act is None else act, out,
                              like_gemv=like_gemv)
    if isinstance(w, BlockTensor):  # its own activation blocks (ops/kquant.py), x quantised here
        if w.in_perm is not None:  # its columns in another order (BlockTensor.in_perm)
            x = np.take(x, w.in_perm, axis=-1)
        return kquant_matvec.cpu(kquant.FORMATS[w.kind], w.blocks, x, out=out)
    if not isinstance(w, QuantTensor):
        return np.matmul(x, w.T, out=out)
    if w.kind == "q8_0":
        return matvec.q8_cpu(w.qs, w.d, x if act is None else act, out=out)
    return matvec.cpu(w.qs, w.d, x if act is None else act, out=out, like_gemv=like_gemv)


def linear_step(x, w, out, act) -> tuple:
    """`linear(x, w, out, act)` as a decode plan's step: (label, callable, args), the product
    checked once here (matvec.launch) where its kernel can be called directly."""
    if isinstance(w, matvec.Q4Matrix):
        return ("matvec.product", *matvec.launch(w, act, out))
    if isinstance(w, QuantTensor) and w.kind == "q8_0":
        return ("matvec.q8_cpu", *matvec.q8_launch(w.qs, w.d, act, out))
    return ("linear", linear, (x, w, out, act))


class _BlockActs:
    """A decode plan's activations for the block kinds' products (kquant_matvec.quantize_for):
    each input buffer quantised once per kind after it is written (a step of its own), for every
    product that reads it until it is written again."""

    def __init__(self):
        self.buffers: dict = {}  # (input's address and shape, kind, perm) -> (x, act)
        self.fresh: set = set()  # the keys quantised since their input was last written

    @staticmethod
    def _where(x: np.ndarray) -> tuple:
        return x.__array_interface__["data"][0], x.shape

    def written(self, x: np.ndarray) -> None:
        """x was (will be) overwritten by the step just planned."""
        self.fresh = {key for key in self.fresh if key[0] != self._where(x)}

    def steps(self, x: np.ndarray, w: BlockTensor) -> tuple[list, object]:
        """(the steps that quantise x as w's product takes it, if not done since x was written,
        the activations)."""
        fmt = kquant.FORMATS[w.kind]
        key = (self._where(x), kquant_matvec.is_k_quant(fmt), None if w.in_perm is None
               else w.in_perm.__array_interface__["data"][0])
        if key not in self.buffers:
            xp = x if w.in_perm is None else np.empty_like(x)
            self.buffers[key] = xp, kquant_matvec.quantize_for(fmt, xp)
        xp, act = self.buffers[key]
        if key in self.fresh:
            return [], act
        self.fresh.add(key)
        steps = [] if w.in_perm is None else [("np.take", np.take, (x, w.in_perm, 1, xp))]
        return steps + [("kquant.quantize", *kquant_matvec.quantize_launch(fmt, xp, act))], act


def product_steps(x, w, out, act, acts: _BlockActs) -> list:
    """`linear_step` for every kind: a block matrix's product on its own activations (`acts`)."""
    if not isinstance(w, BlockTensor):
        return [linear_step(x, w, out, act)]
    steps, block_act = acts.steps(x, w)
    return steps + [("kquant.product", *kquant_matvec.launch(
        kquant.FORMATS[w.kind], w.blocks, block_act, out))]


# Consecutive compiled steps of a decode plan (a layer's: the plan marks them) run as one
# dispatch (jit/sequence.py): the same kernels' code, the same bits. False: each its own call
# (the ops' own profile rows).
JOIN_STEPS = True


def join_steps(steps: list) -> list:
    """A plan's steps with each layer's run of consecutive kernels one step (`JOIN_STEPS`),
    labelled with its calls by op, e.g. `joined 6: residual_step 2, matvec.product 2, ...` (the
    profile's rows: one a kind of layer, their calls summed)."""
    if not JOIN_STEPS:
        return sequence.without_breaks(steps)

    def name(labels):
        counts = collections.Counter(label.removesuffix(".cpu") for label in labels)
        return f"joined {len(labels)}: " + ", ".join(f"{op} {n}" for op, n in counts.items())

    return sequence.join(steps, name)


def run_steps(steps) -> None:
    """A decode plan's calls in order (a function of its own: fermijit/bench/profile.py times each
    step under its label)."""
    for _, fn, args in steps:
        fn(*args)


@dataclasses.dataclass
class DecodePlan:
    """Every call of a decode token, with its arguments, made once for a state's arrays
    (`Model._decode_steps`): a token then costs a Python loop over ~6 calls a layer, not the ops'
    argument assembly and checks (~50-100 us a layer, ~3 ms of a full-size token at every thread
    count: 7 % of a 16-thread token); with `join_steps`, each layer's kernels are one dispatch (and
    the final norm's with the LM head's): a token's time outside the parallel regions, 8
    full-size layers, 2 threads, 1.11 -> 0.53 ms with the whole token one dispatch (tokens of the
    two plans interleaved in one process, load ~4)."""

    arrays: tuple        # the state's arrays it was made for: a state with others needs a new plan
    observer: object     # Model.moe_observer at the time (called between the router and the MoE)
    steps: list          # (label, callable, args), joined as JOIN_STEPS says (join_steps)
    joined: bool = dataclasses.field(init=False)  # JOIN_STEPS then: made again when it changes

    def __post_init__(self):
        self.joined = JOIN_STEPS
        self.steps = join_steps(self.steps)

    def fits(self, state: State, observer) -> bool:
        return self.fits_arrays(_state_arrays(state), observer)

    def fits_arrays(self, arrays: tuple, observer) -> bool:
        return (observer is self.observer and self.joined == JOIN_STEPS
                and len(arrays) == len(self.arrays)
                and all(a is b for a, b in zip(arrays, self.arrays)))


def _state_arrays(state: State, settle: bool = True) -> tuple:
    """What a plan over `state` holds (its layers' arrays, a GDN layer's pending row's record),
    the GDN layers settled first (model/state.py GdnState) unless the plan applies a pending row
    itself (`settle` False: the verify step's, model/batch.py)."""
    if settle:
        for layer in state.layers:
            if isinstance(layer, GdnState):
                layer.settle()
    return tuple(a for layer in state.layers for a in vars(layer).values())


def _split_heads_rows(qg, q, gate, first, last):
    """q, gate [T, H, D] <- the halves of each head of qg [T, H, 2D], tokens [first, last)."""
    d = q.shape[2]
    for t in range(first, last):
        for h in range(q.shape[1]):
            src, dst_q, dst_gate = qg[t, h], q[t, h], gate[t, h]
            for i in range(d):
                dst_q[i] = src[i]
                dst_gate[i] = src[d + i]


def _split_heads_body(qg, q, gate):
    fork((qg, q, gate))


_split_heads_one = kernel(_split_heads_rows)
# A prefill pass's tokens over the threads: two numpy copies of [T, H, D] on one thread were
# ~1.6 ms an attention layer of 512 tokens (full-size heads), most of the forward's glue.
_split_heads = omp.forking_kernel(_split_heads_body,
                                  fork=omp.rows_share(_split_heads_one, "split-heads"))


def split_heads(qg, q, gate) -> None:
    """q, gate [T, H, D] <- each head's query | gate halves of qg [T, H, 2D] (fp32, C-contiguous:
    the workspace's), copied."""
    if qg.shape[0] >= omp.ROWS_MIN:
        _split_heads()(qg, q, gate)
    else:
        _split_heads_one(qg, q, gate, 0, qg.shape[0])


def silu(x):
    return x / (np.float32(1) + np.exp(-x))


def dense_moe(x, ids, weights, w: DenseExperts, out):
    """ops.moe's block with fp32 experts, as numpy matmuls (the unquantised reference path)."""
    def swiglu(xs, gate_up, down):                                      # down · (silu(g) ⊙ u)
        g, u = np.split(xs @ gate_up.T, 2, axis=-1)
        return (silu(g) * u) @ down.T

    gate = np.float32(1) / (np.float32(1) + np.exp(-(x @ w.shared_gate)))    # [T]
    out[...] = gate[:, None] * swiglu(x, w.shared_gate_up[0], w.shared_down[0])
    for e in np.unique(ids):
        t, k = np.nonzero(ids == e)                                      # a token picks e once
        out[t] += weights[t, k, None] * swiglu(x[t], w.gate_up[e], w.down[e])
    return out


class Workspace:
    """Every intermediate of a pass over T tokens, made once (decode keeps one with T = 1)."""

    def __init__(self, model: "Model", n_tokens: int):
        T = n_tokens
        empty = matvec.aligned_empty  # fp32, on a cache line (matvec.LINE)
        H, Hq, Hkv, D = model.hidden, model.n_heads, model.n_kv_heads, model.head_dim
        Hk, Hv, dk, dv = model.n_key_heads, model.n_value_heads, model.key_dim, model.value_dim
        self.offsets = np.arange(T, dtype=np.int64)
        C, Cq = model.conv_dim, Hq * 2 * D
        self.positions = np.empty(T, np.int64)
        # A prompt with images (model/multimodal.py): the image tokens' rows and embeddings
        # replacing theirs, and the [3, T] MRoPE positions; None for text.
        self.embeds: tuple[np.ndarray, np.ndarray] | None = None
        self.mrope: np.ndarray | None = None
        self.tokens = np.empty(T, np.int32)
        self.x = empty((T, H))                   # the residual stream
        self.xn = empty((T, H))                  # its norm: a sublayer's input
        self.y = empty((T, H))                   # a sublayer's output
        self.act = None                          # xn quantised for the Q4_0 kernels (Q8Act)
        self.act_attn = None                     # the attention output, quantised
        self.act_gdn = None                      # the GDN output, quantised
        # A mixer's projections of one token land in one buffer, each a view of it (contiguous,
        # as T = 1), so that a joined matrix fills them in one launch.
        self.attn_in = empty((1, Cq + 2 * Hkv * D)) if T == 1 else None
        self.gdn_in = empty((1, C + Hv * dv)) if T == 1 else None
        self.gates_in = empty((1, 2 * Hv)) if T == 1 else None
        # attention
        self.qg = empty((T, Cq)) if T > 1 else self.attn_in[:, :Cq]  # query D | gate D
        self.q = empty((T, Hq, D))
        self.gate = empty((T, Hq, D))
        self.k, self.v = (empty((T, Hkv, D)) if T > 1 else
                          self.attn_in[:, Cq + i * Hkv * D:Cq + (i + 1) * Hkv * D].reshape(T, Hkv, D)
                          for i in range(2))
        self.o = empty((T, Hq, D))
        # gated deltanet
        self.mixed = empty((T, C)) if T > 1 else self.gdn_in[:, :C]  # q | k | v
        self.z = (empty((T, Hv * dv)) if T > 1 else self.gdn_in[:, C:]).reshape(T, Hv, dv)
        # b | a of every token, one product of the joined gate rows (decode: gates_in's views)
        self.ba = empty((T, 2 * Hv)) if T > 1 else self.gates_in
        self.b, self.a = self.ba[:, :Hv], self.ba[:, Hv:]
        self.gq = empty((T, Hk, dk))
        self.gk = empty((T, Hk, dk))
        self.gv = empty((T, Hv, dv))
        self.g = empty((T, Hv))
        self.beta = empty((T, Hv))
        self.go = empty((T, Hv, dv))
        # moe
        self.router_logits = empty((T, model.n_experts))
        self.ids = np.empty((T, model.top_k), np.int32)
        self.weights = empty((T, model.top_k))
        experts = model.layers[0].experts
        # Decode's buffers, and a prefill pass's (made by its first layer, reused by the rest).
        self.moe_scratch = (moe.Scratch.make(experts, model.top_k)
                            if isinstance(experts, moe.MoeWeights) else None)
        self.logits = empty((1, model.vocab_size)) if T == 1 else None
        self.plan: DecodePlan | None = None  # decode's calls, made by its first token
        self.block_scratch = None  # the fused block MoE's (block_moe.DecodeScratch), by the plan
        if T == 1 and isinstance(experts, (moe.MoeWeights, BlockExperts)):
            self._fused_decode_buffers(model)

    def _fused_decode_buffers(self, model: "Model") -> None:
        """What Model._decode_fused adds: every Q8Act made now, attention's split scratch."""
        f, H = np.float32, model.hidden
        quantized = lambda n: matvec.quantize_act(np.zeros((1, n), f))  # noqa: E731
        self.act = quantized(H)
        self.act_attn = quantized(self.o.size)
        self.act_gdn = quantized(self.go.size)
        self.no_product = np.empty((0, H), f)
        self.no_product.flags.writeable = False
        self.no_p = np.empty((1, 0), f)


class Model:
    """The text model: the config's numbers, per-layer weights; the state is passed in and out."""

    source = None  # the fermijit model directory it was memory-mapped from (load_model), if any:
    # cheap to load again, which the warm-up's helper processes do (fermijit/warm.py)

    def __init__(self, cfg: TextConfig, weights: TextWeights):
        self.hidden, self.vocab_size = cfg.hidden_size, cfg.vocab_size
        self.eps = cfg.rms_norm_eps
        self.n_heads, self.n_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.rotary_dim = cfg.head_dim, cfg.rotary_dim
        self.theta = cfg.rope_parameters.rope_theta
        self.mrope_section = cfg.rope_parameters.mrope_section
        self.n_key_heads, self.n_value_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.key_dim, self.value_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.conv_dim, self.conv_taps = cfg.linear_conv_dim, cfg.linear_conv_kernel_dim
        self.n_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.max_context = cfg.max_position_embeddings
        self.is_attention = tuple(kind == FULL_ATTENTION for kind in cfg.layer_types)
        self.embed = _host(weights.embed_tokens)                       # [V, H] f16 or f32
        self.layers = tuple(_layer(w) for w in weights.layers)
        self.norm = _host(weights.norm)
        self.lm_head = _matrix(weights.lm_head)
        # The MTP head (model/mtp.py), for speculative decoding; None where the model has none.
        self.mtp = None
        if weights.mtp is not None:
            from fermijit.model import mtp
            self.mtp = mtp.head(weights.mtp)
        self.is_quantized = isinstance(self.layers[0].experts, (moe.MoeWeights, BlockExperts))
        # What new states' KV caches hold (--kv-cache; issue 31 item 1: Q8_0 by default).
        self.kv_kind: KvKind = DEFAULT_KV
        # Decode a token as a few fused kernels a layer (_decode_fused) when the weights are
        # quantised (Q4_0, or GGUF block kinds); otherwise (and for tests, set False) the ops
        # one by one, as prefill.
        self.fused_decode = self.is_quantized
        self._decode_ws: Workspace | None = None
        self._prefill_ws: dict[int, Workspace] = {}  # by pass size: _prefill_workspace
        # Calibration (model/reap.py): None, or called as observer(layer, xn, ids, weights) with
        # each MoE's input and routing; one attribute test per layer otherwise.
        self.moe_observer = None

    # --- state ----------------------------------------------------------------------------------

    def new_state(self, context: int, positions: int | None = None, mtp: bool = False,
                  gdn=None) -> State:
        """Zeros, the KV caches (of kind `kv_kind`) allocated to `context` positions (at most
        the model's), taking memory as they are used; the memory of `positions` of them
        (default: all) checked now (model/state.py); with `mtp`, the MTP layer's cache last and
        no hidden state waiting (model/mtp.py); `gdn()` a GDN layer's zeroed state where it
        gives one (model/state.py new_state)."""
        if not 1 <= context <= self.max_context:
            raise FermijitError(f"context must be between 1 and {self.max_context} "
                                f"(max_position_embeddings), got {context}")
        if self.kv_kind is KvKind.Q8_0 and self.head_dim % 32 and any(self.is_attention):
            raise FermijitError(f"the model's head dim {self.head_dim} is not whole 32-blocks: "
                                f"its KV cache cannot be q8_0 (use --kv-cache f32)")
        if mtp and self.mtp is None:
            raise FermijitError("this model has no MTP head (mtp.* weights)")
        state = new_state(self.is_attention + ((True,) if mtp else ()), context,
                          (self.n_kv_heads, self.head_dim), (self.conv_dim, self.conv_taps - 1),
                          (self.n_value_heads, self.key_dim, self.value_dim), self.kv_kind,
                          positions, gdn)
        if mtp:
            state.hidden = np.empty((0, self.hidden), np.float32)
        return state

    def state_nbytes(self, positions: int, mtp: bool = False) -> int:
        """Memory a state of this model takes holding `positions` positions (`mtp`: a state
        with the MTP layer's cache too, `new_state`'s)."""
        return state_nbytes(self.is_attention + ((True,) if mtp else ()), positions,
                            (self.n_kv_heads, self.head_dim),
                            (self.conv_dim, self.conv_taps - 1),
                            (self.n_value_heads, self.key_dim, self.value_dim), self.kv_kind)

    def check_state(self, state: State) -> None:
        """FermijitError unless `state` has this model's layers and shapes and KV kind (a
        restored one)."""
        with_mtp = state.hidden is not None
        ref = self.new_state(1, mtp=with_mtp)
        if with_mtp and (state.hidden.dtype != np.float32 or state.hidden.ndim != 2
                         or state.hidden.shape[1] != self.hidden
                         or not 0 <= state.hidden.shape[0] <= state.position):
            raise FermijitError(f"state hidden is {state.hidden.dtype} "
                                f"{list(state.hidden.shape)}, the model needs float32 "
                                f"[<= {state.position}, {self.hidden}]")
        if len(state.layers) != len(ref.layers):
            raise FermijitError(f"state has {len(state.layers)} layers, the model "
                                f"{len(ref.layers)}")
        if state.kv_kind not in (None, self.kv_kind):
            raise FermijitError(f"state has a {state.kv_kind.value} KV cache, the model runs "
                                f"{self.kv_kind.value} (--kv-cache)")
        for i, (s, r) in enumerate(zip(state.layers, ref.layers)):
            if type(s) is not type(r):
                raise FermijitError(f"state layer {i} is a {type(s).__name__}, the model's a "
                                    f"{type(r).__name__}")
            if isinstance(r, KvCache):
                pairs = zip(("k", "v") if r.kind is KvKind.F32 else
                            ("k codes", "k scales", "v codes", "v scales"), s.arrays, r.arrays)
            else:
                pairs = zip(("conv", "recurrent"), (s.conv, s.recurrent),
                            (r.conv, r.recurrent))
            for name, a, b in pairs:
                want = b.shape
                if isinstance(r, KvCache):
                    want = (want[0], state.context, want[2])               # any context
                if a.dtype != b.dtype or a.shape != want:
                    raise FermijitError(f"state layer {i} {name} is {a.dtype} "
                                        f"{list(a.shape)}, the model needs {b.dtype} "
                                        f"{list(want)}")

    # --- the two entry points -------------------------------------------------------------------

    def prefill(self, tokens, state: State, all_logits: bool = False,
                on_block=None, align: int | None = None) -> np.ndarray:
        """Logits [V] of the last of `tokens` [T] (all of them, [T, V], with `all_logits`), which
        follow the `state.position` tokens seen; updates `state`. `on_block(n)` is called after
        each pass of n tokens (progress for long prompts). With `align`, passes also end where
        `state.position` is a multiple of it, so that `on_block` sees the state there (the
        snapshot cache's positions). Passes are cut by `pass_size`."""
        tokens = np.asarray(tokens, dtype=np.int32)
        if tokens.ndim != 1 or tokens.size == 0:
            raise FermijitError(f"prefill needs a non-empty 1-D token array, got shape "
                                f"{list(tokens.shape)}")
        if align is not None and align < 1:
            raise FermijitError(f"prefill: align must be at least 1, got {align}")
        self._check_room(state, tokens.size)
        logits = []
        t0 = 0
        while t0 < tokens.size:
            n = pass_size(state.position, tokens.size - t0, align)
            block = tokens[t0:t0 + n]
            t0 += n
            ws = self._prefill_workspace(block.size)
            ws.tokens[:] = block
            self.forward(ws.tokens, state, ws)
            if state.hidden is not None:                    # the MTP layer's rows (model/mtp.py)
                from fermijit.model import mtp
                mtp.after_block(self, state, block, ws.x)
            if on_block is not None:
                on_block(block.size)
            if all_logits:
                logits.append(self.logits(ws.x, np.empty((block.size, self.vocab_size),
                                                         np.float32)))
        if all_logits:
            return np.concatenate(logits)
        return self.logits(ws.x[-1:], np.empty((1, self.vocab_size), np.float32))[0]

    def prefill_batch(self, tokens_list, states: list[State], on_block=None,
                      align: int | None = None, max_rows: int | None = None) -> list[np.ndarray]:
        """`prefill` of several sequences together: the logits [V] after each of `tokens_list[b]`
        [T_b], which follow `states[b]` (each updated). Each pass takes the next pass
        (`pass_size`) of as many sequences as fit `max_rows` rows (default PREFILL_BLOCK; the
        sequences with the fewest tokens left first) and runs them as one forward: what reads
        weights (projections, router, the MoE's grouped GEMMs) over all their rows, what reads a
        sequence's own state (conv1d, the delta rule, attention over its KV cache, positions) per
        sequence. So every sequence's logits and state are `prefill`'s of it alone, bit for bit
        (tests/model/test_prefill_batch.py); a one-token pass runs alone, as decode's kernels.
        `on_block(b, n)` follows each pass that fed n tokens of sequence b (`align`: as
        `prefill`'s)."""
        tokens_list = [np.asarray(t, dtype=np.int32) for t in tokens_list]
        if len(tokens_list) != len(states) or not states:
            raise FermijitError(f"prefill_batch: {len(tokens_list)} prompts for {len(states)} "
                                f"states (need one each, at least one)")
        if len({id(s) for s in states}) != len(states):
            raise FermijitError("prefill_batch: a state appears twice")
        for tokens, state in zip(tokens_list, states):
            if tokens.ndim != 1 or tokens.size == 0:
                raise FermijitError(f"prefill needs a non-empty 1-D token array, got shape "
                                    f"{list(tokens.shape)}")
            self._check_room(state, tokens.size)
            self._check_token(tokens)
        if align is not None and align < 1:
            raise FermijitError(f"prefill: align must be at least 1, got {align}")
        max_rows = PREFILL_BLOCK if max_rows is None else max_rows
        if max_rows < 3:  # room for a pass of two tokens whatever is left (pass_size)
            raise FermijitError(f"prefill_batch: max_rows must be at least 3, got {max_rows}")
        done = [0] * len(states)
        logits: list[np.ndarray | None] = [None] * len(states)

        def fed(b: int, n: int, x) -> None:
            """n tokens of sequence b have run, x [n, H] their final residuals."""
            if states[b].hidden is not None:  # the MTP layer's rows (model/mtp.py)
                from fermijit.model import mtp
                mtp.after_block(self, states[b], tokens_list[b][done[b]:done[b] + n], x)
            x_last = x[-1:]
            done[b] += n
            if on_block is not None:
                on_block(b, n)
            if done[b] == tokens_list[b].size:
                logits[b] = self.logits(x_last, np.empty((1, self.vocab_size), np.float32))[0]

        while True:
            left = sorted((tokens_list[b].size - done[b], b) for b in range(len(states))
                          if done[b] < tokens_list[b].size)
            if not left:
                return logits
            pieces, room = [], max_rows
            for n_left, b in left:
                n = pass_size(states[b].position, n_left, align, room)
                if n == 1:  # decode's kernels: alone, as `prefill` runs it
                    ws = self._prefill_workspace(1)
                    ws.tokens[:] = tokens_list[b][done[b]:done[b] + 1]
                    self.forward(ws.tokens, states[b], ws)
                    fed(b, 1, ws.x)
                elif n:
                    pieces.append((b, n))
                    room -= n
            if not pieces:
                continue
            ws = self._prefill_workspace(sum(n for _, n in pieces))
            segments, row = [], 0
            for b, n in pieces:
                ws.tokens[row:row + n] = tokens_list[b][done[b]:done[b] + n]
                segments.append(Segment(slice(row, row + n), states[b].position))
                row += n
            with blas.single_threaded() if self.is_quantized else contextlib.nullcontext():
                self._forward(ws.tokens, [states[b] for b, _ in pieces], segments, ws)
            for (b, n), seg in zip(pieces, segments):
                fed(b, n, ws.x[seg.rows])

    def _prefill_workspace(self, n_tokens: int) -> Workspace:
        """A pass's Workspace, kept for the passes and calls after: fresh buffers (its own and
        its MoE scratch's) cost a page fault per 4 KiB first written, 8 ms of a 512-token
        prefill of the default model (94 -> 86 ms, 1 thread). One per size, for the two largest
        sizes seen (the whole passes, and the longest last pass)."""
        ws = self._prefill_ws.get(n_tokens)
        if ws is None:
            ws = self._prefill_ws[n_tokens] = Workspace(self, n_tokens)
            for size in sorted(self._prefill_ws)[:-2]:
                del self._prefill_ws[size]
        return ws

    def decode(self, token: int, state: State) -> np.ndarray:
        """Logits [V] after `token`; a view of a buffer the next call overwrites."""
        self._check_room(state, 1)
        if not 0 <= token < self.vocab_size:
            raise FermijitError(f"token ids must be in [0, {self.vocab_size}), got {token}")
        if self._decode_ws is None:
            self._decode_ws = Workspace(self, 1)
        ws = self._decode_ws
        ws.tokens[0] = token
        if self.fused_decode:
            return self._decode_fused(state, ws)
        self.forward(ws.tokens, state, ws)
        if state.hidden is not None:  # waits for the MTP head (model/mtp.py)
            state.hidden = np.concatenate([state.hidden, rmsnorm.cpu(ws.x, self.norm, self.eps)])
        return self.logits(ws.x, ws.logits)[0]

    def _decode_fused(self, state: State, ws: Workspace) -> np.ndarray:
        """`forward` and `logits` for one token of a quantised model (ws.tokens), as a plan of
        ~6 kernel calls a layer made once (`_decode_steps`, every buffer made once by
        Workspace), joined into one dispatch (`join_steps`)."""
        if omp.in_forked_child:
            omp.check_process()
        ws.positions[0] = state.position + state.rope_delta  # delta: after images
        if ws.plan is None or not ws.plan.fits(state, self.moe_observer):
            ws.plan = DecodePlan(_state_arrays(state), self.moe_observer,
                                 self._decode_steps(state, ws))
        run_steps(ws.plan.steps)
        state.position += 1
        if state.hidden is not None:  # waits for the MTP head (model/mtp.py)
            state.hidden = np.concatenate([state.hidden, ws.xn])
        return ws.logits[0]

    def _decode_steps(self, state: State, ws: Workspace) -> list:
        """A decode token's calls: the embedding, then the residual add, norm, quantisation and
        fp32 gates or router of each sublayer's input in one call (ops.residual_step), the
        mixers' steps between their projections in one call each (ops.gdn_step,
        ops.attention_step), the MoE in one (ops.moe, or block_moe's fused launch). Python and
        dispatch were 11 % of a full-size token op by op. A block matrix (a GGUF's K-quants,
        `convert --quant q4_k_m`) reads its input quantised once more, as its kind wants
        (_BlockActs)."""
        steps = [("embedding.cpu", embedding.cpu, (ws.tokens, self.embed, ws.x))]
        eps, y = self.eps, None                                     # y: the sublayer output
        acts = _BlockActs()
        attention_scratch: dict = {}                                # one set for every layer

        def product(x, w, out, act):
            return product_steps(x, w, out, act, acts)

        def residual(*args):
            acts.written(ws.xn)
            return ("residual_step.cpu", *residual_step.launch(*args))

        for w, s in zip(self.layers, state.layers):
            steps.append(sequence.BREAK)                            # a joined step a layer
            mixer = w.mixer
            if isinstance(s, KvCache):
                steps.append(residual(ws.x, y, w.input_norm, eps, ws.xn, ws.act, ws.no_product,
                                      ws.no_p))
                if w.joined_in is not None:                         # q | k | v
                    steps += product(ws.xn, w.joined_in, ws.attn_in, ws.act)
                else:                                               # views of attn_in
                    steps += (product(ws.xn, mixer.q_proj, ws.qg, ws.act)
                              + product(ws.xn, mixer.k_proj, ws.k.reshape(1, -1), ws.act)
                              + product(ws.xn, mixer.v_proj, ws.v.reshape(1, -1), ws.act))
                steps += attention_step.launch(
                    ws.attn_in, mixer.q_norm, mixer.k_norm, eps, ws.positions, self.rotary_dim,
                    self.theta, s.k, s.v, ws.q, ws.gate, ws.o, ws.act_attn, attention_scratch)
                acts.written(ws.o.reshape(1, -1))
                steps += product(ws.o.reshape(1, -1), mixer.o_proj, ws.y, ws.act_attn)
            elif isinstance(w.joined_in, matvec.Q4Matrix) and w.gates_in is not None:
                # b | a in the fork of the joined projection qkv | z: one launch, not two
                steps.append(residual(ws.x, y, w.input_norm, eps, ws.xn, ws.act, ws.no_product,
                                      ws.no_p))
                steps.append(("matvec.product", *matvec.launch_with_rows(
                    w.joined_in, ws.act, ws.gdn_in, ws.xn, w.gates_in, ws.gates_in)))
                steps += self._gdn_steps(mixer, s, ws, acts, product)
            else:
                steps.append(residual(ws.x, y, w.input_norm, eps, ws.xn, ws.act, w.gates_in,
                                      ws.gates_in))                 # b | a
                if w.joined_in is not None:                         # qkv | z
                    steps += product(ws.xn, w.joined_in, ws.gdn_in, ws.act)
                else:                                               # views of gdn_in
                    steps += (product(ws.xn, mixer.in_proj_qkv, ws.mixed, ws.act)
                              + product(ws.xn, mixer.in_proj_z, ws.z.reshape(1, -1), ws.act))
                steps += self._gdn_steps(mixer, s, ws, acts, product)
            y = ws.y
            steps.append(residual(ws.x, y, w.post_norm, eps, ws.xn, ws.act, w.router,
                                  ws.router_logits, ws.ids, ws.weights))
            if self.moe_observer is not None:
                steps.append(("moe_observer", self.moe_observer, (w, ws.xn, ws.ids, ws.weights)))
            steps += self._moe_steps(w.experts, ws, acts)
        steps.append(sequence.BREAK)
        steps.append(residual(ws.x, y, self.norm, eps, ws.xn, ws.act, ws.no_product, ws.no_p))
        steps += product(ws.xn, self.lm_head, ws.logits, ws.act)
        return steps

    def _gdn_steps(self, mixer, s, ws: Workspace, acts: _BlockActs, product) -> list:
        """The decode plan's GDN mixer after its in-projections: its step, then out_proj."""
        steps = [("gdn_step.cpu", *gdn_step.launch(
            ws.mixed, ws.z, ws.a, ws.b, mixer.conv1d, s.conv, mixer.A_log, mixer.dt_bias,
            mixer.norm, self.eps, L2NORM_EPS, s.recurrent, ws.gq, ws.gk, ws.gv, ws.g, ws.beta,
            ws.go, ws.act_gdn))]
        acts.written(ws.go.reshape(1, -1))
        return steps + product(ws.go.reshape(1, -1), mixer.out_proj, ws.y, ws.act_gdn)

    def _moe_steps(self, experts, ws: Workspace, acts: _BlockActs) -> list:
        """The decode plan's MoE of ws.xn into ws.y: ops.moe's fused Q4_0 kernel, block_moe's
        fused K-quant one, or block_moe.run."""
        if isinstance(experts, moe.MoeWeights):
            return [("moe.decode", *moe.decode_launch(ws.xn, ws.act, ws.ids, ws.weights,
                                                      experts, ws.y, ws.moe_scratch))]
        if block_moe.fused_formats(experts) is None:
            return [("block_moe.run", block_moe.run, (ws.xn, ws.ids, ws.weights, experts, ws.y))]
        if ws.block_scratch is None:
            ws.block_scratch = block_moe.DecodeScratch.make(experts, self.top_k)
        steps, act = acts.steps(ws.xn, experts.gate_up)
        return steps + [("block_moe.decode", *block_moe.decode_launch(
            ws.xn, act, ws.ids, ws.weights, experts, ws.y, ws.block_scratch))]

    def row_split_arrays(self) -> list[np.ndarray]:
        """The weight arrays decode splits by rows the same way every token (thread t of n: rows
        [t·R/n, (t+1)·R/n)): the GEMVs' matrices (a joined one as launched), the fp32 router and
        gates, the LM head; for `--numa rows` (fermijit/host/numa.py). Not the experts: their split
        follows the token's routing."""
        out = []

        def add(w):
            if isinstance(w, matvec.Q4Matrix):
                out.extend((w.qs, w.d_bits))
            elif isinstance(w, QuantTensor):
                out.extend((w.qs, w.d))
            elif isinstance(w, np.ndarray) and w.ndim == 2:
                out.append(w)

        for layer in self.layers:
            mixer = layer.mixer
            ins = (("in_proj_qkv", "in_proj_z") if isinstance(mixer, GatedDeltaNetWeights)
                   else ("q_proj", "k_proj", "v_proj"))
            if layer.joined_in is not None:
                add(layer.joined_in)
            for f in dataclasses.fields(mixer):  # the projections (conv1d and norms: not rows)
                w = getattr(mixer, f.name)
                if isinstance(w, (matvec.Q4Matrix, QuantTensor)) and not (
                        layer.joined_in is not None and f.name in ins):
                    add(w)
            add(layer.router)
            if layer.gates_in is not None:
                add(layer.gates_in)
        add(self.lm_head)
        return out

    def _check_room(self, state: State, n_tokens: int) -> None:
        state.check_room(n_tokens)

    # --- the forward (MODEL.md §4) --------------------------------------------------------------

    def forward(self, tokens, state: State, ws: Workspace) -> None:
        """ws.x [T, H] <- the last hidden state of `tokens` [T] int32; state advanced by T.
        With Q4_0 weights numpy's BLAS (the few fp32 products) stays at one thread meanwhile, out
        of the kernels' way (fermijit/host/blas.py: a 2-thread prefill 2-3x faster on 2 cores); with
        fp32 weights every product is numpy's, so its threads are the work."""
        self._check_token(tokens)
        with blas.single_threaded() if self.is_quantized else contextlib.nullcontext():
            self._forward(tokens, [state], [Segment(slice(0, tokens.size), state.position)], ws)

    def _forward(self, tokens, states: list[State], segments: list[Segment],
                 ws: Workspace) -> None:
        """`forward` of the sequences `states`, each its `segments` rows of `tokens`."""
        embedding.cpu(tokens, self.embed, out=ws.x)                    # not scaled
        if ws.embeds is not None:                                      # image tokens
            ws.x[ws.embeds[0]] = ws.embeds[1]
        for state, seg in zip(states, segments):                       # delta: after images
            n = seg.rows.stop - seg.rows.start
            np.add(ws.offsets[:n], seg.start + state.rope_delta, out=ws.positions[seg.rows])
        # Each residual add is done by the norm after it (rmsnorm.residual_cpu: x += y first).
        y = None                                                       # the last layer's moe(...)
        for i, w in enumerate(self.layers):
            layer = [state.layers[i] for state in states]
            rmsnorm.residual_cpu(ws.x, y, w.input_norm, self.eps, out=ws.xn)
            if isinstance(layer[0], KvCache):
                self.attention(w.mixer, w.joined_in, layer, segments, ws)
            else:
                self.gated_deltanet(w.mixer, w.joined_in, w.gates_in, layer, segments, ws)
            rmsnorm.residual_cpu(ws.x, ws.y, w.post_norm, self.eps, out=ws.xn)  # h = x + mixer
            self.moe(w, ws)
            y = ws.y                                                   # x = h + moe(norm(h))
        if y is not None:
            ws.x += y
        for state, seg in zip(states, segments):
            state.position += seg.rows.stop - seg.rows.start

    def _check_token(self, tokens) -> None:
        if tokens.min() < 0 or tokens.max() >= self.vocab_size:
            raise FermijitError(f"token ids must be in [0, {self.vocab_size}), got "
                                f"[{tokens.min()}, {tokens.max()}]")

    def logits(self, x, out) -> np.ndarray:
        """out [T, V] = lm_head · rmsnorm(x) for x [T, H]."""
        xn = rmsnorm.cpu(x, self.norm, self.eps)
        return linear(xn, self.lm_head, out)

    def _quantized_input(self, x, act):
        return matvec.quantize_act(x, out=act) if self.is_quantized else None

    def attention(self, w: AttentionWeights, joined, caches: list[KvCache],
                  segments: list[Segment], ws: Workspace) -> None:
        """Gated GQA attention (MODEL.md §5): ws.xn -> ws.y, keys and values into the caches
        (segment b's rows into caches[b])."""
        T, D = ws.tokens.size, self.head_dim
        ws.act = act = self._quantized_input(ws.xn, ws.act)
        if joined is not None and ws.attn_in is not None:
            linear(ws.xn, joined, ws.attn_in, act)                   # q | k | v in one launch
        else:
            linear(ws.xn, w.q_proj, ws.qg, act)                      # per head: query | gate
            linear(ws.xn, w.k_proj, ws.k.reshape(T, -1), act)
            linear(ws.xn, w.v_proj, ws.v.reshape(T, -1), act)
        qg = ws.qg.reshape(T, self.n_heads, 2 * D)
        split_heads(qg, ws.q, ws.gate)
        rmsnorm.cpu(ws.q, w.q_norm, self.eps, out=ws.q)              # per head, before RoPE
        rmsnorm.cpu(ws.k, w.k_norm, self.eps, out=ws.k)
        if ws.mrope is None:
            rope.cpu(ws.q, ws.positions, self.rotary_dim, self.theta, out=ws.q)
            rope.cpu(ws.k, ws.positions, self.rotary_dim, self.theta, out=ws.k)
        else:
            for x in (ws.q, ws.k):
                rope.mrope_cpu(x, ws.mrope, self.rotary_dim, self.theta, self.mrope_section,
                               out=x)
        for cache, seg in zip(caches, segments):                      # o ⊙ σ(gate), per sequence
            r = seg.rows
            cache.write(seg.start, ws.k[r], ws.v[r])                   # [Hkv, S, D] rows
            attention.cpu(ws.q[r], cache.k, cache.v, ws.gate[r], seg.start, out=ws.o[r])
        o = ws.o.reshape(T, -1)
        ws.act_attn = self._quantized_input(o, ws.act_attn)
        linear(o, w.o_proj, ws.y, ws.act_attn)

    def gated_deltanet(self, w: GatedDeltaNetWeights, joined, gates_in, states: list,
                       segments: list[Segment], ws: Workspace) -> None:
        """Gated DeltaNet (MODEL.md §6): ws.xn -> ws.y; the conv and recurrent states updated
        (segment b's rows through states[b])."""
        T, dk = ws.tokens.size, self.key_dim
        ws.act = act = self._quantized_input(ws.xn, ws.act)
        if joined is not None and ws.gdn_in is not None:
            linear(ws.xn, joined, ws.gdn_in, act)                    # qkv | z in one launch
        else:
            linear(ws.xn, w.in_proj_qkv, ws.mixed, act)              # [T, C]
            linear(ws.xn, w.in_proj_z, ws.z.reshape(T, -1), act)
        # The gates b | a [T, 2Hv] in one fp32 product: decode's bits (two products of 8 rows
        # each read xn twice: the default model's 512-token prefill ~0.5 % slower, 1 thread)
        fp32_rows.cpu(ws.xn, gates_in, out=ws.ba)
        if ws.gdn_in is not None and self.is_quantized:
            # Decode: every step from the conv to the quantised output in one call (ops/gdn_step)
            if ws.act_gdn is None:
                ws.act_gdn = matvec.quantize_act(ws.go.reshape(1, -1))
            s, = states
            gdn_step.cpu(ws.mixed, ws.z, ws.a, ws.b, w.conv1d, s.conv, w.A_log, w.dt_bias,
                         w.norm, self.eps, L2NORM_EPS, s.recurrent, ws.gq, ws.gk, ws.gv, ws.g,
                         ws.beta, ws.go, ws.act_gdn)
            linear(ws.go.reshape(T, -1), w.out_proj, ws.y, ws.act_gdn)
            return
        for s, seg in zip(states, segments):                         # causal conv + SiLU
            conv1d.cpu(ws.mixed[seg.rows], w.conv1d, s.conv, out=ws.mixed[seg.rows])
        # q / |q| / sqrt(dk), k / |k|, v: out of the conv's rows in one pass
        l2norm.split_cpu(ws.mixed, L2NORM_EPS, 1 / np.sqrt(dk), ws.gq, ws.gk, ws.gv)
        gated_delta.gates_cpu(ws.a, ws.b, w.A_log, w.dt_bias, out=(ws.g, ws.beta))
        for s, seg in zip(states, segments):
            r = seg.rows
            gated_delta.cpu(ws.gq[r], ws.gk[r], ws.gv[r], ws.g[r], ws.beta[r], s.recurrent,
                            out=ws.go[r])
        rmsnorm.gated_cpu(ws.go, ws.z, w.norm, self.eps, out=ws.go)  # norm, then silu(z) gate
        o = ws.go.reshape(T, -1)
        ws.act_gdn = self._quantized_input(o, ws.act_gdn)
        linear(o, w.out_proj, ws.y, ws.act_gdn)

    def moe(self, w: Layer, ws: Workspace) -> None:
        """Routed top-k SwiGLU experts plus the gated shared expert (MODEL.md §4):
        ws.xn -> ws.y."""
        fp32_rows.cpu(ws.xn, w.router, out=ws.router_logits)          # [T, E]: decode's bits
        router.cpu(ws.router_logits, self.top_k, out=(ws.ids, ws.weights))
        if self.moe_observer is not None:
            self.moe_observer(w, ws.xn, ws.ids, ws.weights)
        if isinstance(w.experts, moe.MoeWeights):
            moe.cpu(ws.xn, ws.ids, ws.weights, w.experts, out=ws.y, scratch=ws.moe_scratch)
        elif isinstance(w.experts, BlockExperts):
            block_moe.run(ws.xn, ws.ids, ws.weights, w.experts, ws.y)
        else:
            dense_moe(ws.xn, ws.ids, ws.weights, w.experts, ws.y)


def load_model(directory, show_progress: bool = False,
               kv: KvKind = DEFAULT_KV) -> tuple[ModelConfig, Model]:
    """A fermijit model directory (memory-mapped, 4-bit), or an HF checkpoint directory as it is
    (read into fp32 in memory: for reference runs of small models); its states' KV caches of
    kind `kv`."""
    import os
    from pathlib import Path

    from fermijit.model import convert
    from fermijit.model.config import load_config
    from fermijit.model.safetensors_io import Checkpoint
    from fermijit.model.weights import load_text_weights, text_weight_shapes

    directory = Path(directory)
    if not directory.is_dir():
        raise FermijitError(f"no such model directory: {directory}")
    source = None
    if convert.is_fermijit_model(directory):
        cfg, weights, _ = convert.load_converted(directory)
        source = directory
    else:
        cfg = load_config(directory)
        fp32_nbytes = 4 * sum(int(np.prod(s)) for s in text_weight_shapes(cfg.text_config).values())
        ram_nbytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if fp32_nbytes > ram_nbytes:
            raise FermijitError(f"{directory} is an HF checkpoint, run unquantised: its fp32 "
                                f"weights take {fp32_nbytes / 2**30:.1f} GiB, more than this "
                                f"machine's {ram_nbytes / 2**30:.1f} GiB of RAM; convert it "
                                f"first (python -m fermijit convert)")
        weights = load_text_weights(cfg.text_config, Checkpoint(directory), np.float32,
                                    show_progress=show_progress)
    model = Model(cfg.text_config, weights)
    model.source = source
    model.kv_kind = kv
    if source is not None and numa.selected() == "rows":
        from fermijit.jit import cpu, omp

        numa.place_rows(model.row_split_arrays(), numa.team_nodes(cpu.configure_threads(None)))
        omp.set_dynamic(False)  # each thread its static run of rows, the run placed on its node
    return cfg, model
