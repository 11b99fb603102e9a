"""The HF `config.json` of Qwen3.6-35B-A3B (MODEL.md §2) as frozen dataclasses with HF field names.

Two shapes of file are accepted: the composite `qwen3_5_moe` (text_config, vision_config and the
vision token ids at the top, as published) and the text-only `qwen3_5_moe_text`. A field we do
not know is an error naming it, so a config from another architecture (say qwen3_next's
`norm_topk_prob`) cannot be half-read. Optional fields take the transformers 5.24 defaults.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from pathlib import Path

from fermijit import FermijitError
from fermijit.model.files import read_json, short

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"

# Written by transformers' PreTrainedConfig (any version) but meaningless for inference here.
_BOOKKEEPING = frozenset({"architectures", "dtype", "torch_dtype", "transformers_version",
                          "_name_or_path"})


@dataclasses.dataclass(frozen=True)
class RopeParameters:
    """`rope_parameters`; only the plain ("default") rotary embedding is implemented."""

    rope_theta: float = 10000.0  # transformers' fallback; the real model says 1e7 (MODEL.md §2)
    partial_rotary_factor: float = 0.25
    rope_type: str = "default"
    # Text tokens have T=H=W positions, so MRoPE is 1-D RoPE for text (MODEL.md §5.4); the
    # section only matters for images. (11, 11, 10) is the modeling code's default when absent.
    mrope_section: tuple[int, ...] = (11, 11, 10)
    mrope_interleaved: bool = True


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """`text_config` (model_type qwen3_5_moe_text). Defaults: Qwen3_5MoeTextConfig's."""

    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters = RopeParameters()
    attention_bias: bool = False
    attention_dropout: float = 0.0
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 8
    num_experts: int = 256
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    layer_types: tuple[str, ...] = ()  # filled from full_attention_interval when absent
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # In the published file, not read by transformers' modeling code (MODEL.md §2).
    attn_output_gate: bool = True  # the code always gates
    full_attention_interval: int = 4
    mamba_ssm_dtype: str = "float32"
    mtp_num_hidden_layers: int = 0
    mtp_use_dedicated_embeddings: bool = False
    mlp_only_layers: tuple[int, ...] = ()  # every layer is MoE; anything else is rejected

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope_parameters.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """`vision_config` (qwen3_5_moe_vision), kept for the vision tower (MODEL.md §7)."""

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584  # transformers' default; the real model says 2048
    num_position_embeddings: int = 2304
    initializer_range: float = 0.02
    deepstack_visual_indexes: tuple[int, ...] = ()
    rope_theta: float = 10000.0  # from `rope_parameters` (axial 2-D RoPE)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The whole `config.json`. `vision_config` is None for a text-only (`qwen3_5_moe_text`) file."""

    model_type: str
    text_config: TextConfig
    vision_config: VisionConfig | None = None
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    tie_word_embeddings: bool = False


def load_config(path: str | Path) -> ModelConfig:
    """Read `config.json` (a file, or the directory holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise FermijitError(f"no config file: {path}")
    return parse_config(read_json(path), where=str(path))


def parse_config(raw: dict, where: str = "config.json") -> ModelConfig:
    if not isinstance(raw, dict):
        raise FermijitError(f"{where}: expected a JSON object")
    model_type = raw.get("model_type")
    if model_type == "qwen3_5_moe_text":
        text = _parse_text(raw, where)
        return ModelConfig(model_type=model_type, text_config=text,
                           tie_word_embeddings=text.tie_word_embeddings)
    if model_type != "qwen3_5_moe":
        if model_type is None:
            raise FermijitError(f"{where}: missing required field 'model_type'")
        raise FermijitError(f"{where}: unsupported model_type {short(model_type)} "
                            f"(supported: qwen3_5_moe, qwen3_5_moe_text)")
    top = {k: v for k, v in raw.items() if k not in _BOOKKEEPING}
    if "text_config" not in top:
        raise FermijitError(f"{where}: missing required field 'text_config'")
    text = _parse_text(top.pop("text_config"), f"{where}: text_config")
    vision_raw = top.pop("vision_config", None)
    vision = VisionConfig() if vision_raw is None else _parse_vision(vision_raw,
                                                                     f"{where}: vision_config")
    return build(ModelConfig, top, where, text_config=text, vision_config=vision)


def _parse_text(raw, where: str) -> TextConfig:
    if not isinstance(raw, dict):
        raise FermijitError(f"{where}: expected a JSON object")
    fields = {k: v for k, v in raw.items() if k not in _BOOKKEEPING}
    if fields.pop("model_type", "qwen3_5_moe_text") != "qwen3_5_moe_text":
        raise FermijitError(f"{where}: unsupported model_type {short(raw['model_type'])} "
                            f"(expected qwen3_5_moe_text)")
    # Legacy top-level rope keys fill in what rope_parameters lacks (transformers' setdefault).
    legacy = {k: fields.pop(k) for k in ("rope_theta", "partial_rotary_factor") if k in fields}
    rope_raw = fields.pop("rope_parameters", None)
    rope_raw = {} if rope_raw is None else rope_raw
    if not isinstance(rope_raw, dict):
        raise FermijitError(f"{where}: rope_parameters must be an object")
    rope = build(RopeParameters, {**legacy, **rope_raw}, f"{where}: rope_parameters")
    cfg = build(TextConfig, fields, where, rope_parameters=rope)
    _check_bounds(cfg, where)  # before anything is built from the numbers (1e9 layers: a hang)
    if "layer_types" not in fields:
        n = cfg.full_attention_interval
        types_ = tuple(FULL_ATTENTION if (i + 1) % n == 0 else LINEAR_ATTENTION
                       for i in range(cfg.num_hidden_layers))
        cfg = dataclasses.replace(cfg, layer_types=types_)
    _validate_text(cfg, where)
    return cfg


def _parse_vision(raw, where: str) -> VisionConfig:
    if not isinstance(raw, dict):
        raise FermijitError(f"{where}: expected a JSON object")
    fields = {k: v for k, v in raw.items() if k not in _BOOKKEEPING}
    # The published file says "qwen3_5_moe" here; transformers rewrites it (MODEL.md §2).
    if fields.pop("model_type", "qwen3_5_moe_vision") not in ("qwen3_5_moe_vision", "qwen3_5_moe"):
        raise FermijitError(f"{where}: unsupported model_type {short(raw['model_type'])}")
    rope = fields.pop("rope_parameters", None) or {}
    is_axial = isinstance(rope, dict) and rope.get("rope_type", "axial") == "axial"
    if not is_axial or set(rope) - {"rope_type", "rope_theta"}:
        raise FermijitError(f"{where}: unsupported rope_parameters {short(rope)}")
    if "rope_theta" in rope:
        fields["rope_theta"] = rope["rope_theta"]
    return build(VisionConfig, fields, where)


_POSITIVE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
             "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
             "linear_num_key_heads", "linear_num_value_heads", "moe_intermediate_size",
             "shared_expert_intermediate_size", "num_experts_per_tok", "num_experts",
             "full_attention_interval")


# Far above the real model (40 layers, 256 experts, a 248320 vocabulary, 262144 positions), low
# enough that nothing sized by them (a tuple per layer, a dict per tensor) can hang a load.
MAX_LAYERS = 1024
MAX_DIMENSION = 1 << 24


def _check_bounds(c: TextConfig, where: str) -> None:
    if c.num_hidden_layers > MAX_LAYERS:
        raise FermijitError(f"{where}: num_hidden_layers {c.num_hidden_layers} is beyond "
                            f"{MAX_LAYERS}")
    for name in _POSITIVE:
        value = getattr(c, name)
        if not value > 0:
            raise FermijitError(f"{where}: {name} must be positive, got {value}")
        if isinstance(value, int) and value > MAX_DIMENSION:
            raise FermijitError(f"{where}: {name} {value} is beyond {MAX_DIMENSION}")


def _validate_text(c: TextConfig, where: str) -> None:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise FermijitError(f"{where}: {what}")

    need(len(c.layer_types) == c.num_hidden_layers,
         f"layer_types has {len(c.layer_types)} entries for {c.num_hidden_layers} layers")
    bad = [t for t in c.layer_types if t not in (LINEAR_ATTENTION, FULL_ATTENTION)]
    need(not bad, f"unsupported layer type {bad[0]!r}" if bad else "")
    need(c.hidden_act == "silu", f"unsupported hidden_act {c.hidden_act!r} (only silu)")
    need(not c.attention_bias, "attention_bias true is not supported (the model has none)")
    need(c.attn_output_gate, "attn_output_gate false is not supported (the code always gates)")
    need(not c.mlp_only_layers, "mlp_only_layers must be empty: every layer is MoE")
    need(c.num_attention_heads % c.num_key_value_heads == 0,
         "num_attention_heads must be a multiple of num_key_value_heads")
    need(c.linear_num_value_heads % c.linear_num_key_heads == 0,
         "linear_num_value_heads must be a multiple of linear_num_key_heads")
    need(c.num_experts_per_tok <= c.num_experts, "num_experts_per_tok exceeds num_experts")
    need(c.mtp_num_hidden_layers in (0, 1),  # the head runs one layer (model/mtp.py)
         f"mtp_num_hidden_layers {c.mtp_num_hidden_layers} is not supported (0 or 1)")
    rope = c.rope_parameters
    need(rope.rope_type == "default",
         f"unsupported rope_type {rope.rope_type!r} (only default)")
    need(0 < rope.partial_rotary_factor <= 1 and c.rotary_dim % 2 == 0,
         f"partial_rotary_factor {rope.partial_rotary_factor} gives an odd rotary dim")
    need(rope.rope_theta > 0, "rope_theta must be positive")


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict:
    """typing.get_type_hints(cls), once per class (fermijit.json's ~700 tensor entries each asked
    for it again: 0.06 s of every full-size load, issue 28 item 4)."""
    return typing.get_type_hints(cls)


def build(cls, fields: dict, where: str, **fixed):
    """`cls(**fields, **fixed)`, with each JSON value checked against the field's type: the one
    typed reader of config.json and fermijit.json. Unknown and missing fields are errors."""
    if not isinstance(fields, dict):
        raise FermijitError(f"{where}: expected an object, got {short(fields)}")
    hints = _hints(cls)
    kwargs = dict(fixed)
    for name, value in fields.items():
        if name not in hints or name in fixed:
            raise FermijitError(f"{where}: unknown field {repr(name)[:80]}")
        kwargs[name] = _coerce(value, hints[name], f"{where}: {name}")
    for f in dataclasses.fields(cls):
        if (f.name not in kwargs and f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING):
            raise FermijitError(f"{where}: missing required field {f.name!r}")
    return cls(**kwargs)



def _coerce(value, hint, where: str):
    """A JSON value as the Python type `hint`: int, float (finite), bool, str, a Literal of
    strings, tuples, dict[str, ...], a dataclass (an object), optionals."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for option in options:
        origin = typing.get_origin(option)
        if option is object:  # any JSON value (the JSON reader has checked it)
            return value
        elif option is type(None):
            if value is None:
                return None
        elif dataclasses.is_dataclass(option):
            if isinstance(value, dict):
                return build(option, value, where)
        elif origin is typing.Literal:
            if value in typing.get_args(option) and isinstance(value, str):
                return value
        elif origin is dict:
            if isinstance(value, dict):
                item = typing.get_args(option)[1]
                return {k: _coerce(v, item, f"{where}: {k}") for k, v in value.items()}
        elif origin is tuple:
            if isinstance(value, list):
                item = typing.get_args(option)[0]
                return tuple(_coerce(v, item, where) for v in value)
        elif option is bool:
            if isinstance(value, bool):
                return value
        elif option is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        elif option is float:
            if (isinstance(value, (int, float)) and not isinstance(value, bool)
                    and math.isfinite(value)):
                return float(value)
        elif option is str:
            if isinstance(value, str):
                return value
    raise FermijitError(f"{where}: expected {_describe(hint)}, got {short(value)}")


def _describe(hint) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(typing.get_args(hint))
    if dataclasses.is_dataclass(hint):
        return "an object"
    text = str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")
    return text.replace("float", "finite float")
