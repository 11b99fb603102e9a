"""The text model's weights: per-layer frozen dataclasses, and the map from checkpoint names.

Dimension legend (MODEL.md §2-6): V vocab, H hidden, L layers, E experts, I expert intermediate,
Is shared-expert intermediate, Hq/Hkv attention heads, D attention head dim, Hk/Hv linear key/value
heads, dk/dv their dims, C = 2·Hk·dk + Hv·dv conv channels, Kc conv taps.

A checkpoint tensor reaches a field through a `TensorPlan`: the field's name and shape, and the
checkpoint slices that fill it. The plan is built and checked (every source present, float, of
the right shape) before anything is read, so a bad checkpoint fails at once, naming the tensor.
It absorbs the layout differences: the `model.language_model.` (VLM) or `model.` (text-only)
prefix, fused 3-D experts or per-expert matrices, the [C, 1, Kc] conv weight. The MTP head
(`mtp.*`, MODEL.md §10) is planned when the checkpoint has it and config.json's
mtp_num_hidden_layers is 1 (a lone or partial `mtp.*` is left out, as transformers leaves it);
`model.visual.*` names are listed by `visual_tensor_names` for the vision tower.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from fermijit import FermijitError
from fermijit.model.config import FULL_ATTENTION, TextConfig
from fermijit.model.safetensors_io import FLOAT_DTYPES, Checkpoint


@dataclasses.dataclass(frozen=True)
class QuantTensor:
    """A matrix in GGML block format, structure of arrays (DESIGN.md, On-disk format)."""

    kind: str        # "q4_0" or "q8_0"
    qs: np.ndarray   # q4_0: uint8 [..., K/2] (byte j: element j low nibble, j+16 high); q8_0: int8 [..., K]
    d: np.ndarray    # float16 [..., K/32], one scale per 32-block

    @property
    def shape(self) -> tuple[int, ...]:
        return self.d.shape[:-1] + (self.d.shape[-1] * 32,)


@dataclasses.dataclass(frozen=True)
class BlockTensor:
    """A matrix in a GGUF block format kept as imported, bit for bit (ops/kquant.py FORMATS:
    Q4_K, Q5_K, Q6_K, Q5_0, Q5_1): every row its blocks, array of structures."""

    kind: str          # a key of ops.kquant.FORMATS
    blocks: np.ndarray  # uint8 [..., K/Q·S]: Q values per block of S bytes
    # None, or the order of the inputs the blocks' columns hold: the product reads x[..., in_perm]
    # (a GGUF's out_proj in llama.cpp's tiled value-head order: model/gguf_convert.py)
    in_perm: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        from fermijit.ops.kquant import FORMATS

        fmt = FORMATS[self.kind]
        return self.blocks.shape[:-1] + (self.blocks.shape[-1] // fmt.block_bytes
                                         * fmt.block_values,)

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes


Tensor = np.ndarray | QuantTensor | BlockTensor  # big matrices may be quantised; vectors never


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetWeights:
    in_proj_qkv: Tensor   # [C, H]  rows: q Hk·dk | k Hk·dk | v Hv·dv
    in_proj_z: Tensor     # [Hv·dv, H]
    in_proj_b: Tensor     # [Hv, H]
    in_proj_a: Tensor     # [Hv, H]
    conv1d: np.ndarray    # [C, Kc]  depthwise causal taps; tap Kc-1 multiplies the current token
    A_log: np.ndarray     # [Hv]
    dt_bias: np.ndarray   # [Hv]
    norm: np.ndarray      # [dv]  gated RMSNorm, a plain weight (not 1+w)
    out_proj: Tensor      # [H, Hv·dv]


@dataclasses.dataclass(frozen=True)
class AttentionWeights:
    q_proj: Tensor        # [Hq·2D, H]  per head h: rows 2D·h.. D query, then D gate rows
    k_proj: Tensor        # [Hkv·D, H]
    v_proj: Tensor        # [Hkv·D, H]
    o_proj: Tensor        # [H, Hq·D]
    q_norm: np.ndarray    # [D]  zero-centred: scale 1+w
    k_norm: np.ndarray    # [D]


@dataclasses.dataclass(frozen=True)
class MoeWeights:
    gate: Tensor                 # [E, H]  router
    experts_gate_up: Tensor      # [E, 2I, H]  rows: gate I | up I
    experts_down: Tensor         # [E, H, I]
    shared_gate_up: Tensor       # [2Is, H]  rows: gate Is | up Is
    shared_down: Tensor          # [H, Is]
    shared_expert_gate: Tensor   # [1, H]  scalar sigmoid gate of the shared expert


@dataclasses.dataclass(frozen=True)
class LayerWeights:
    input_layernorm: np.ndarray           # [H]  zero-centred
    mixer: GatedDeltaNetWeights | AttentionWeights
    post_attention_layernorm: np.ndarray  # [H]  zero-centred
    mlp: MoeWeights


@dataclasses.dataclass(frozen=True)
class MtpWeights:
    """The multi-token-prediction head (MODEL.md §10): its own norms, projection and one
    full-attention decoder layer; the embedding and LM head are the model's."""

    pre_fc_norm_embedding: np.ndarray  # [H]  zero-centred
    pre_fc_norm_hidden: np.ndarray     # [H]  zero-centred
    fc: Tensor                         # [H, 2H]  columns: embedding H | hidden H
    layer: LayerWeights                # a full-attention MoE decoder layer
    norm: np.ndarray                   # [H]  zero-centred, the head's own final norm


@dataclasses.dataclass(frozen=True)
class TextWeights:
    embed_tokens: Tensor             # [V, H]
    layers: tuple[LayerWeights, ...]  # L
    norm: np.ndarray                 # [H]  zero-centred
    lm_head: Tensor                  # [V, H]
    mtp: MtpWeights | None = None    # the MTP head, where the model has one


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows [row0, row0 + n) of the output (of expert `lead`, for 3-D outputs) are
    checkpoint tensor `source` indexed by `index`, reshaped to [n, cols]."""

    source: str
    lead: int | None
    row0: int
    n_rows: int
    index: tuple = ()


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    name: str                   # the field path, e.g. "layers.3.self_attn.q_proj"
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    def read(self, ckpt: Checkpoint, lead: int | None = None, rows: slice = slice(None)) -> np.ndarray:
        """fp32 copy of out[lead][rows] (out[rows] for a 1-D or 2-D tensor)."""
        n_rows = self.shape[-2] if len(self.shape) >= 2 else self.shape[0]
        r0, r1, _ = rows.indices(n_rows)
        parts = []
        for p in self.pieces:
            a, b = max(r0, p.row0), min(r1, p.row0 + p.n_rows)
            if p.lead == lead and a < b:
                sub = ckpt.float32(p.source, p.index + (slice(a - p.row0, b - p.row0),))
                parts.append(sub.reshape((b - a,) + self.shape[-1:] if len(self.shape) >= 2
                                         else (b - a,)))
        out = np.concatenate(parts) if len(parts) > 1 else parts[0]
        assert out.shape[0] == r1 - r0, (self.name, lead, rows)
        return out

    def read_all(self, ckpt: Checkpoint) -> np.ndarray:
        if len(self.shape) == 3:
            return np.stack([self.read(ckpt, e) for e in range(self.shape[0])])
        return self.read(ckpt)


MTP_PREFIX = "mtp."
MTP_LAYER = MTP_PREFIX + "layers.0."  # the head's decoder layer, named as a layer's fields


def text_weight_shapes(cfg: TextConfig, mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """Every text weight field's shape, from the config alone, in file order; with `mtp`, the
    MTP head's last (`mtp.*`)."""
    H, V = cfg.hidden_size, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens": (V, H)}
    for i, kind in enumerate(cfg.layer_types):
        shapes.update(_layer_shapes(cfg, f"layers.{i}.", kind))
    shapes["norm"] = (H,)
    shapes["lm_head"] = (V, H)
    if mtp:
        m = MTP_PREFIX
        shapes.update({m + "pre_fc_norm_embedding": (H,), m + "pre_fc_norm_hidden": (H,),
                       m + "fc": (H, 2 * H)})
        shapes.update(_layer_shapes(cfg, MTP_LAYER, FULL_ATTENTION))
        shapes[m + "norm"] = (H,)
    return shapes


def _layer_shapes(cfg: TextConfig, n: str, kind: str) -> dict[str, tuple[int, ...]]:
    """One decoder layer's fields, named from prefix `n`."""
    H = cfg.hidden_size
    E, I, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    D, Hq, Hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    C, Hv, dv = cfg.linear_conv_dim, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    shapes = {n + "input_layernorm": (H,), n + "post_attention_layernorm": (H,)}
    if kind == FULL_ATTENTION:
        a = n + "self_attn."
        shapes.update({a + "q_proj": (Hq * 2 * D, H), a + "k_proj": (Hkv * D, H),
                       a + "v_proj": (Hkv * D, H), a + "o_proj": (H, Hq * D),
                       a + "q_norm": (D,), a + "k_norm": (D,)})
    else:
        a = n + "linear_attn."
        shapes.update({a + "in_proj_qkv": (C, H), a + "in_proj_z": (Hv * dv, H),
                       a + "in_proj_b": (Hv, H), a + "in_proj_a": (Hv, H),
                       a + "conv1d": (C, cfg.linear_conv_kernel_dim), a + "A_log": (Hv,),
                       a + "dt_bias": (Hv,), a + "norm": (dv,), a + "out_proj": (H, Hv * dv)})
    m = n + "mlp."
    shapes.update({m + "gate": (E, H), m + "experts_gate_up": (E, 2 * I, H),
                   m + "experts_down": (E, H, I), m + "shared_gate_up": (2 * Is, H),
                   m + "shared_down": (H, Is), m + "shared_expert_gate": (1, H)})
    return shapes


def has_mtp(cfg: TextConfig, ckpt: Checkpoint) -> bool:
    """Whether the checkpoint holds the MTP head fermijit runs: one layer (config.json's
    mtp_num_hidden_layers 1) with its decoder layer present (tiny test files carry a lone
    `mtp.fc`, as transformers ignores the head)."""
    return (cfg.mtp_num_hidden_layers == 1 and MTP_PREFIX + "fc.weight" in ckpt
            and MTP_LAYER + "input_layernorm.weight" in ckpt)


def plan_text_weights(cfg: TextConfig, ckpt: Checkpoint) -> dict[str, TensorPlan]:
    """Every text-model tensor, in file order (embedding, layers, norm, lm_head, the MTP head's
    where `has_mtp`), checked."""
    prefix = text_prefix(ckpt)
    shapes = text_weight_shapes(cfg)
    plans: list[TensorPlan] = []
    one = _one_source(ckpt, shapes, plans)
    one("embed_tokens", prefix + "embed_tokens.weight")
    for i, kind in enumerate(cfg.layer_types):
        _layer_plans(cfg, ckpt, shapes, f"layers.{i}.", f"{prefix}layers.{i}.", kind, one, plans)
    one("norm", prefix + "norm.weight")
    if "lm_head.weight" in ckpt or not cfg.tie_word_embeddings:
        one("lm_head", "lm_head.weight")
    else:
        one("lm_head", prefix + "embed_tokens.weight")
    out = {plan.name: plan for plan in plans}
    return out | plan_mtp_weights(cfg, ckpt) if has_mtp(cfg, ckpt) else out


def plan_mtp_weights(cfg: TextConfig, ckpt: Checkpoint) -> dict[str, TensorPlan]:
    """The MTP head's tensors (`mtp.*`, MODEL.md §10), in file order, checked."""
    shapes = {n: s for n, s in text_weight_shapes(cfg, mtp=True).items()
              if n.startswith(MTP_PREFIX)}
    plans: list[TensorPlan] = []
    one = _one_source(ckpt, shapes, plans)
    for field in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc"):
        one(MTP_PREFIX + field, MTP_PREFIX + field + ".weight")
    _layer_plans(cfg, ckpt, shapes, MTP_LAYER, MTP_LAYER, FULL_ATTENTION, one, plans)
    one(MTP_PREFIX + "norm", MTP_PREFIX + "norm.weight")
    return {plan.name: plan for plan in plans}


def _one_source(ckpt: Checkpoint, shapes, plans: list):
    """one(name, source, stored=None): field `name` is checkpoint tensor `source` (checked;
    `stored` its on-disk shape where it differs), its plan appended to `plans`."""
    def one(name: str, source: str, stored: tuple[int, ...] | None = None):
        shape = shapes[name]
        _check(ckpt, source, stored or shape)
        plans.append(TensorPlan(name, shape, (Piece(source, None, 0, shape[0]),)))

    return one


def _layer_plans(cfg: TextConfig, ckpt: Checkpoint, shapes, n: str, p: str, kind: str, one,
                 plans: list) -> None:
    """Field prefix `n`'s decoder layer from checkpoint prefix `p`, appended to `plans` in file
    order (the one-source tensors through `one`)."""
    H = cfg.hidden_size
    one(n + "input_layernorm", p + "input_layernorm.weight")
    one(n + "post_attention_layernorm", p + "post_attention_layernorm.weight")
    if kind == FULL_ATTENTION:
        a, s = n + "self_attn.", p + "self_attn."
        for field in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            one(a + field, s + field + ".weight")
    else:
        a, s = n + "linear_attn.", p + "linear_attn."
        for field in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
            one(a + field, s + field + ".weight")
        C, Kc = shapes[a + "conv1d"]
        one(a + "conv1d", s + "conv1d.weight", stored=(C, 1, Kc))
        one(a + "A_log", s + "A_log")
        one(a + "dt_bias", s + "dt_bias")
        one(a + "norm", s + "norm.weight")
        one(a + "out_proj", s + "out_proj.weight")
    E, I, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    m, s = n + "mlp.", p + "mlp."
    one(m + "gate", s + "gate.weight")
    plans.extend(_expert_plans(ckpt, m, s, E, I, H))
    _check(ckpt, s + "shared_expert.gate_proj.weight", (Is, H))
    _check(ckpt, s + "shared_expert.up_proj.weight", (Is, H))
    plans.append(TensorPlan(m + "shared_gate_up", (2 * Is, H), (
        Piece(s + "shared_expert.gate_proj.weight", None, 0, Is),
        Piece(s + "shared_expert.up_proj.weight", None, Is, Is))))
    one(m + "shared_down", s + "shared_expert.down_proj.weight")
    one(m + "shared_expert_gate", s + "shared_expert_gate.weight")


def _expert_plans(ckpt: Checkpoint, m: str, s: str, E: int, I: int, H: int) -> list[TensorPlan]:
    """The routed experts as [E, 2I, H] and [E, H, I], from either on-disk layout (MODEL.md §3)."""
    fused_gate_up, fused_down = s + "experts.gate_up_proj", s + "experts.down_proj"
    if fused_gate_up in ckpt or f"{s}experts.0.gate_proj.weight" not in ckpt:
        _check(ckpt, fused_gate_up, (E, 2 * I, H))
        _check(ckpt, fused_down, (E, H, I))
        gate_up = [Piece(fused_gate_up, e, 0, 2 * I, (e,)) for e in range(E)]
        down = [Piece(fused_down, e, 0, H, (e,)) for e in range(E)]
    else:
        gate_up, down = [], []
        for e in range(E):
            x = f"{s}experts.{e}."
            _check(ckpt, x + "gate_proj.weight", (I, H))
            _check(ckpt, x + "up_proj.weight", (I, H))
            _check(ckpt, x + "down_proj.weight", (H, I))
            gate_up += [Piece(x + "gate_proj.weight", e, 0, I), Piece(x + "up_proj.weight", e, I, I)]
            down.append(Piece(x + "down_proj.weight", e, 0, H))
    return [TensorPlan(m + "experts_gate_up", (E, 2 * I, H), tuple(gate_up)),
            TensorPlan(m + "experts_down", (E, H, I), tuple(down))]


def text_prefix(ckpt: Checkpoint) -> str:
    from fermijit.model.manifest import check_finished

    for prefix in ("model.language_model.", "model."):
        if prefix + "embed_tokens.weight" in ckpt:
            return prefix
    check_finished(ckpt.directory, ckpt.files)
    raise FermijitError(f"{ckpt.directory}: missing tensor model.language_model.embed_tokens.weight "
                        f"(nor model.embed_tokens.weight)")


def _check(ckpt: Checkpoint, name: str, shape: tuple[int, ...]) -> None:
    if name not in ckpt:
        raise FermijitError(f"{ckpt.directory}: missing tensor {name}")
    info = ckpt.info(name)
    if info.dtype not in FLOAT_DTYPES:
        raise FermijitError(f"{ckpt.path_of(name)}: tensor {name} has dtype {info.dtype}, "
                            f"expected one of {', '.join(FLOAT_DTYPES)}")
    if info.shape != shape:
        raise FermijitError(f"{ckpt.path_of(name)}: tensor {name} has shape {list(info.shape)}, "
                            f"expected {list(shape)}")


def visual_tensor_names(ckpt: Checkpoint) -> list[str]:
    """The vision tower's tensors (MODEL.md §7), left for the vision issue."""
    return sorted(name for name in ckpt.names() if name.startswith("model.visual."))


def assemble(cfg: TextConfig, tensors: Mapping[str, Tensor]) -> TextWeights:
    """The dataclasses from field-path names (those of `plan_text_weights`); the MTP head where
    its fields are there."""
    def fields(cls, base: str):
        return cls(**{f.name: tensors[base + f.name] for f in dataclasses.fields(cls)})

    def layer(n: str, kind: str) -> LayerWeights:
        mixer = (fields(AttentionWeights, n + "self_attn.") if kind == FULL_ATTENTION
                 else fields(GatedDeltaNetWeights, n + "linear_attn."))
        return LayerWeights(input_layernorm=tensors[n + "input_layernorm"], mixer=mixer,
                            post_attention_layernorm=tensors[n + "post_attention_layernorm"],
                            mlp=fields(MoeWeights, n + "mlp."))

    layers = tuple(layer(f"layers.{i}.", kind) for i, kind in enumerate(cfg.layer_types))
    mtp = None
    if MTP_PREFIX + "fc" in tensors:
        m = MTP_PREFIX
        mtp = MtpWeights(tensors[m + "pre_fc_norm_embedding"], tensors[m + "pre_fc_norm_hidden"],
                         tensors[m + "fc"], layer(MTP_LAYER, FULL_ATTENTION), tensors[m + "norm"])
    return TextWeights(embed_tokens=tensors["embed_tokens"], layers=layers,
                       norm=tensors["norm"], lm_head=tensors["lm_head"], mtp=mtp)


def load_text_weights(cfg: TextConfig, ckpt: Checkpoint, dtype=np.float32,
                      show_progress: bool = False) -> TextWeights:
    """All text weights as `dtype` arrays in memory: for tiny models and reference runs only
    (the real model is 140 GB in fp32; it goes through the converter). Progress on stderr."""
    import sys

    from tqdm import tqdm

    plans = plan_text_weights(cfg, ckpt)
    # delay: the bar appears only if the load takes longer than a second.
    items = tqdm(plans.items(), desc="load", unit="tensor", file=sys.stderr, delay=1.0,
                 disable=not show_progress)
    arrays = {}
    for name, plan in items:
        arrays[name] = plan.read_all(ckpt).astype(dtype, copy=False)
        if not np.isfinite(arrays[name]).all():  # as convert refuses them (issue 30 item 7)
            raise FermijitError(f"{name} holds NaN or infinite values; refusing to run it")
    return assemble(cfg, arrays)
