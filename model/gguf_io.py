"""GGUF (llama.cpp's format, arch `qwen35moe`) read: metadata to config.json, tensors to fermijit's
weight fields (model/gguf_convert.py writes them as a fermijit model).

llama.cpp's converter (convert_hf_to_gguf.py and conversion/qwen.py, Qwen3_5MoeTextModel) changes
the HF tensors in these ways, each undone here:
- names: `blk.{i}.attn_qkv` for linear_attn.in_proj_qkv, `ssm_out` for out_proj, ... (`SOURCES`);
- the routed experts' gate_up [E, 2I, H] split into ffn_gate_exps and ffn_up_exps, the shared
  expert's gate and up kept apart: concatenated again along rows;
- A_log stored as ssm_a = -exp(A_log): A_log = log(-ssm_a) (within an ulp: exp/log round);
- the zero-centred RMSNorm weights (input, post-attention, final, q_norm, k_norm) stored as 1 + w:
  w = stored - 1 (within an ulp of 1; the gated norm of the linear attention is a plain weight
  and is not shifted);
- conv1d [C, 1, Kc] squeezed to [C, Kc] (the same bytes);
- with fewer key than value heads (Hk < Hv), the value heads reordered from grouped by key head
  (k0v0 k0v1 .. k1v0 ..) to tiled (k0v0 k1v0 .. k0v1 ..): the v rows of in_proj_qkv and of the
  conv, the rows of in_proj_z, in_proj_a/b, A_log and dt_bias, the columns of out_proj. Undone
  by the inverse permutation, exactly (on quantised blocks too: a head's dv columns are whole
  32-blocks);
- the attention q_proj (query and gate rows interleaved per head) is stored as it is;
- the MTP head (`nextn_predict_layers` 1) is block `blk.{L}` after the L layers: a full-attention
  layer's tensors plus `nextn.eh_proj` (mtp.fc), `nextn.enorm` / `nextn.hnorm` (the pre-fc norms
  of the embedding and the hidden state) and `nextn.shared_head_norm` (mtp.norm; llama.cpp falls
  back to output_norm without it, and so does this), its norms 1 + w as the layers'.

Quantised tensors: Q4_0 and Q8_0 blocks (18 and 34 bytes: fp16 d, then the quants) are split
bit for bit into fermijit's qs/d arrays where the field is a quantised matrix; K-quants and Q5_0/Q5_1 (ops/kquant.py FORMATS) are kept
as their blocks, bit for bit, where fermijit has kernels for them (model/gguf_convert.py
`storage`); where the field is kept in fp32 they are dequantised (exact). Float tensors are
quantised as `convert` does an HF checkpoint. Everything else (IQ*, Q4_1, ...) is
dequantised by the gguf package and requantised as `convert` would, with one warning naming how
many tensors and bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np

from fermijit import FermijitError
from fermijit.model import convert as fj
from fermijit.model.config import FULL_ATTENTION, LINEAR_ATTENTION, TextConfig, parse_config
from fermijit.model.weights import MTP_PREFIX, text_weight_shapes

ARCH = "qwen35moe"
MAGIC = b"GGUF"
# The fields whose GGUF tensors hold 1 + w (conversion/qwen.py Qwen3NextModel.modify_tensors).
SHIFTED_NORMS = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm")
# A field's GGUF sources, concatenated along rows, by the field's last name component.
SOURCES = {
    "input_layernorm": ("attn_norm.weight",),
    "post_attention_layernorm": ("post_attention_norm.weight",),
    "q_proj": ("attn_q.weight",), "k_proj": ("attn_k.weight",), "v_proj": ("attn_v.weight",),
    "o_proj": ("attn_output.weight",), "q_norm": ("attn_q_norm.weight",),
    "k_norm": ("attn_k_norm.weight",), "in_proj_qkv": ("attn_qkv.weight",),
    "in_proj_z": ("attn_gate.weight",), "in_proj_b": ("ssm_beta.weight",),
    "in_proj_a": ("ssm_alpha.weight",), "conv1d": ("ssm_conv1d.weight",), "A_log": ("ssm_a",),
    "dt_bias": ("ssm_dt.bias",), "norm": ("ssm_norm.weight",), "out_proj": ("ssm_out.weight",),
    "gate": ("ffn_gate_inp.weight",),
    "experts_gate_up": ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
    "experts_down": ("ffn_down_exps.weight",),
    "shared_gate_up": ("ffn_gate_shexp.weight", "ffn_up_shexp.weight"),
    "shared_down": ("ffn_down_shexp.weight",), "shared_expert_gate": ("ffn_gate_inp_shexp.weight",),
}
# The MTP head's own fields (mtp.<field>), in its block; each a zero-centred norm but fc.
MTP_SOURCES = {"fc": "nextn.eh_proj.weight", "pre_fc_norm_embedding": "nextn.enorm.weight",
               "pre_fc_norm_hidden": "nextn.hnorm.weight", "norm": "nextn.shared_head_norm.weight"}


class GgufFile:
    """A GGUF file read by the gguf package, checked: magic, version, arch, every tensor inside
    the file. `value(key)` reads metadata; `tensors` maps names to the package's ReaderTensor."""

    def __init__(self, path: str | Path):
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise FermijitError(f"no such GGUF file: {self.path}")
        with open(self.path, "rb") as f:
            if f.read(4) != MAGIC:
                raise FermijitError(f"{self.path}: not a GGUF file (bad magic)")
        try:
            self.reader = GGUFReader(self.path)
        except Exception as e:  # the package raises ValueError, IndexError, struct errors...
            raise FermijitError(f"{self.path}: unreadable GGUF, truncated or corrupt "
                                f"({_one_line(e)})") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        size = self.path.stat().st_size
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
                raise FermijitError(f"{self.path}: tensor {t.name} lies outside the file "
                                    f"(truncated or corrupt)")
        self._check_layout()
        arch = self.value("general.architecture")
        if arch != ARCH:
            raise FermijitError(f"{self.path}: unsupported architecture {arch!r} (fermijit reads "
                                f"{ARCH}: Qwen3.5/3.6 MoE)")

    def _check_layout(self) -> None:
        """The tensors' data as llama.cpp's loader (gguf.cpp gguf_init_from_file_impl) wants
        it: in the order of their infos, each at the offset where the previous one ended
        padded to general.alignment (a power of two). So no two names share bytes, and every
        offset is aligned (without this check, two tensors on the same bytes converted and ran,
        rc 0)."""
        alignment = int(self.reader.alignment)
        if alignment < 1 or alignment & (alignment - 1):
            raise FermijitError(f"{self.path}: general.alignment {alignment} is not a power of 2")
        expected = 0
        for t in self.reader.tensors:
            offset = int(t.data_offset) - int(self.reader.data_offset)
            if offset != expected:
                raise FermijitError(f"{self.path}: tensor {t.name} has offset {offset}, "
                                    f"expected {expected} (the tensors in order, each padded "
                                    f"to {alignment} bytes, as llama.cpp's loader requires)")
            expected += -(-int(t.n_bytes) // alignment) * alignment

    def value(self, key: str, default=...):
        field = self.reader.fields.get(key)
        if field is None:
            if default is ...:
                raise FermijitError(f"{self.path}: missing metadata {key}")
            return default
        return field.contents()

    def arch(self, key: str, default=...):
        return self.value(f"{ARCH}.{key}", default)

    def fingerprint(self) -> str:
        """sha256 of the size and everything before the tensor data (metadata, tensor table)."""
        h = hashlib.sha256(str(self.path.stat().st_size).encode())
        with open(self.path, "rb") as f:
            h.update(f.read(self.reader.data_offset))
        return h.hexdigest()


def _one_line(e: Exception) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


def _f32(value) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-06, not 9.99e-07),
    the number its HF config.json said."""
    return float(str(np.float32(value)))


def text_config(g: GgufFile) -> dict:
    """The HF `text_config` (qwen3_5_moe_text) the metadata describes."""
    def count(key: str) -> int:
        value = g.arch(key)
        if not isinstance(value, int):
            raise FermijitError(f"{g.path}: {ARCH}.{key} must be one integer, got {value!r}")
        return value

    n_mtp = g.arch("nextn_predict_layers", 0)
    n_layers = count("block_count") - n_mtp  # MTP blocks come last
    head_dim, n_value_heads = count("attention.key_length"), count("ssm.time_step_rank")
    recurrent = g.arch("attention.recurrent_layers", None)
    interval = count("full_attention_interval")
    if recurrent is None:
        recurrent = [(i + 1) % interval != 0 for i in range(n_layers)]
    sections = list(g.arch("rope.dimension_sections", [11, 11, 10, 0]))[:3]
    if "token_embd.weight" not in g.tensors:
        raise FermijitError(f"{g.path}: missing tensor token_embd.weight")
    return {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": int(g.tensors["token_embd.weight"].shape[-1]),
        "hidden_size": count("embedding_length"),
        "num_hidden_layers": n_layers,
        "layer_types": [LINEAR_ATTENTION if r else FULL_ATTENTION for r in recurrent[:n_layers]],
        "full_attention_interval": interval,
        "num_attention_heads": count("attention.head_count"),
        "num_key_value_heads": count("attention.head_count_kv"),
        "head_dim": head_dim,
        "linear_num_key_heads": count("ssm.group_count"),
        "linear_num_value_heads": n_value_heads,
        "linear_key_head_dim": count("ssm.state_size"),
        "linear_value_head_dim": count("ssm.inner_size") // n_value_heads,
        "linear_conv_kernel_dim": count("ssm.conv_kernel"),
        "num_experts": count("expert_count"),
        "num_experts_per_tok": count("expert_used_count"),
        "moe_intermediate_size": count("expert_feed_forward_length"),
        "shared_expert_intermediate_size": count("expert_shared_feed_forward_length"),
        "rms_norm_eps": _f32(g.arch("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": count("context_length"),
        "rope_parameters": {"rope_type": "default", "rope_theta": _f32(g.arch("rope.freq_base")),
                            "partial_rotary_factor": count("rope.dimension_count") / head_dim,
                            "mrope_section": sections, "mrope_interleaved": True},
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "mtp_num_hidden_layers": n_mtp,
        "bos_token_id": g.value("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": g.value("tokenizer.ggml.eos_token_id", None),
        "pad_token_id": g.value("tokenizer.ggml.padding_token_id", None),
    }


def read_config(g: GgufFile):
    """(the config.json dict, the parsed ModelConfig)."""
    raw = {"architectures": ["Qwen3_5MoeForCausalLM"], **text_config(g)}
    return raw, parse_config(raw, where=f"{g.path} (metadata)")


# --- tensors ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Field:
    """A fermijit weight field and how to read it from the GGUF: `sources` concatenated along
    rows, source row `rows[i]` giving row i (None: in order), columns in heads of `col_head`
    permuted by `col_perm` (out_proj), and `kind` of value transform ("", "log_neg", "minus_1")."""

    name: str
    shape: tuple[int, ...]
    sources: tuple[str, ...]
    rows: np.ndarray | None = None
    col_perm: np.ndarray | None = None
    col_head: int = 0
    kind: str = ""

    def tensors(self, g: GgufFile) -> list:
        return [g.tensors[s] for s in self.sources]


def grouped_from_tiled(n_key_heads: int, n_value_heads: int, head: int) -> np.ndarray:
    """Index i of grouped (HF) order holds index perm[i] of llama.cpp's tiled order."""
    r = n_value_heads // n_key_heads
    return np.arange(n_value_heads * head).reshape(r, n_key_heads, head).transpose(1, 0, 2).ravel()


def plan_fields(cfg: TextConfig, g: GgufFile) -> dict[str, Field]:
    """Every text weight field, in file order, its sources checked (present, right shape)."""
    fields = field_plan(cfg, g.tensors)
    for field in fields.values():
        _check_sources(g, field)
    return fields


def field_plan(cfg: TextConfig, names=None) -> dict[str, Field]:
    """Every text weight field, in file order, and how llama.cpp's converter stores it, for a
    file holding the tensors `names`: an LM head of its own where it has `output.weight`, the
    MTP head where it has the nextn block. `names` None: model/gguf_export.py's plan (run the
    other way: an LM head, no MTP head)."""
    has_output = names is None or "output.weight" in names
    Hk, Hv, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    reorder = Hk != Hv
    v_rows = grouped_from_tiled(Hk, Hv, dv) if reorder else None
    head_rows = grouped_from_tiled(Hk, Hv, 1) if reorder else None
    qk = 2 * cfg.linear_key_dim
    mtp_block = f"blk.{cfg.num_hidden_layers}."
    mtp = (names is not None and cfg.mtp_num_hidden_layers == 1
           and mtp_block + MTP_SOURCES["fc"] in names)
    fields = {}
    for name, shape in text_weight_shapes(cfg, mtp).items():
        parts = name.split(".")
        last = parts[-1]
        rows, col_perm, kind = None, None, ""
        if name.startswith(MTP_PREFIX) and last in MTP_SOURCES and parts[1] != "layers":
            source = mtp_block + MTP_SOURCES[last]
            if last == "norm" and source not in names:
                source = "output_norm.weight"
            sources, kind = (source,), ("" if last == "fc" else "minus_1")
        elif name.startswith(MTP_PREFIX):     # mtp.layers.0.<field>: the block after the layers
            sources = tuple(mtp_block + s for s in SOURCES[last])
            kind = "minus_1" if last in SHIFTED_NORMS else ""
        elif name == "embed_tokens":
            sources = ("token_embd.weight",)
        elif name == "lm_head":
            sources = ("output.weight" if has_output else "token_embd.weight",)
        elif name == "norm":
            sources, kind = ("output_norm.weight",), "minus_1"
        else:
            sources = tuple(f"blk.{parts[1]}.{s}" for s in SOURCES[last])
            kind = ("minus_1" if last in SHIFTED_NORMS else "log_neg" if last == "A_log" else "")
            if reorder and last in ("in_proj_qkv", "conv1d"):
                rows = np.concatenate([np.arange(qk), qk + v_rows])
            elif reorder and last == "in_proj_z":
                rows = v_rows
            elif reorder and last in ("in_proj_a", "in_proj_b", "A_log", "dt_bias"):
                rows = head_rows
            elif reorder and last == "out_proj":
                col_perm = head_rows
        fields[name] = Field(name, shape, sources, rows, col_perm, dv, kind)
    return fields


def _shape(t, ndim: int) -> tuple[int, ...]:
    """A tensor's shape in numpy order (GGUF lists dims innermost first), with the unit dims
    GGUF writers drop (llama-quantize writes ffn_gate_inp_shexp [1, H] as [H]) put back."""
    shape = tuple(int(n) for n in reversed(t.shape))
    return (1,) * (ndim - len(shape)) + shape


def _array(t, ndim: int) -> np.ndarray:
    """A tensor's data (elements, or bytes of block rows) with those unit dims put back."""
    data = t.data
    return data.reshape((1,) * (ndim - data.ndim) + data.shape) if data.ndim < ndim else data


def _check_sources(g: GgufFile, field: Field) -> None:
    n_rows = 0
    for s in field.sources:
        t = g.tensors.get(s)
        if t is None:
            raise FermijitError(f"{g.path}: missing tensor {s}")
        shape = _shape(t, len(field.shape))
        lead, inner = field.shape[:-2], field.shape[-1:]
        if len(field.shape) == 1:
            ok = shape == field.shape
        else:
            ok = len(shape) == len(field.shape) and shape[:-2] == lead and shape[-1:] == inner
        if not ok:
            raise FermijitError(f"{g.path}: tensor {s} has shape {list(shape)}, expected "
                                f"{list(field.shape)} (or a row slice of it) for {field.name}")
        n_rows += shape[0] if len(field.shape) == 1 else shape[-2]
    if n_rows != (field.shape[0] if len(field.shape) == 1 else field.shape[-2]):
        raise FermijitError(f"{g.path}: the tensors of {field.name} have {n_rows} rows, expected "
                            f"{field.shape[-2] if len(field.shape) > 1 else field.shape[0]}")


def _source_runs(field: Field, g: GgufFile, r0: int, r1: int):
    """(tensor, its row indices) pieces that give field rows [r0, r1), in order."""
    tensors = field.tensors(g)
    sizes = [_shape(t, len(field.shape))[-2 if len(field.shape) > 1 else 0] for t in tensors]
    offsets = np.cumsum([0] + sizes)
    idx = field.rows[r0:r1] if field.rows is not None else np.arange(r0, min(r1, offsets[-1]))
    which = np.searchsorted(offsets, idx, side="right") - 1
    cuts = np.flatnonzero(np.diff(which)) + 1
    for run_idx, run_src in zip(np.split(idx, cuts), np.split(which, cuts)):
        if run_idx.size:
            k = int(run_src[0])
            yield tensors[k], run_idx - offsets[k]


def _raw(t, ndim: int, lead: int | None, rows: np.ndarray) -> np.ndarray:
    """Rows of a tensor's stored data (elements, or bytes of blocks), of expert `lead`."""
    data = _array(t, ndim) if lead is None else _array(t, ndim)[lead]
    contiguous = rows.size and rows[-1] - rows[0] == rows.size - 1 and np.all(np.diff(rows) == 1)
    return np.array(data[rows[0]:rows[-1] + 1] if contiguous else data[rows])


def read_float(field: Field, g: GgufFile, lead: int | None, rows: slice) -> np.ndarray:
    """fp32 rows of the field in fermijit's layout, every llama.cpp transform undone."""
    from gguf import quants

    n_rows = field.shape[-2] if len(field.shape) > 1 else field.shape[0]
    r0, r1, _ = rows.indices(n_rows)
    ndim = len(field.shape)
    parts = [quants.dequantize(_raw(t, ndim, lead, idx), t.tensor_type).astype(np.float32,
                                                                                copy=False)
             for t, idx in _source_runs(field, g, r0, r1)]
    x = np.concatenate(parts) if len(parts) > 1 else parts[0]
    if field.col_perm is not None:
        x = x.reshape(x.shape[0], -1, field.col_head)[:, field.col_perm].reshape(x.shape[0], -1)
    if field.kind == "minus_1":
        x = x - np.float32(1)
    elif field.kind == "log_neg":
        x = np.log(-x)
    return np.ascontiguousarray(x.reshape((r1 - r0,) + field.shape[len(field.shape) - 1:]
                                          if len(field.shape) > 1 else (r1 - r0,)))


def read_blocks(field: Field, g: GgufFile, lead: int | None, rows: slice, kind: str):
    """(qs, d) of rows of a Q4_0 or Q8_0 field, split bit for bit from GGUF's blocks."""
    n_rows = field.shape[-2]
    r0, r1, _ = rows.indices(n_rows)
    raw = [_raw(t, len(field.shape), lead, idx) for t, idx in _source_runs(field, g, r0, r1)]
    raw = np.concatenate(raw) if len(raw) > 1 else raw[0]
    n, nb = raw.shape[0], field.shape[-1] // fj.BLOCK
    blocks = raw.reshape(n, nb, -1)                       # [n, blocks, 18 or 34]
    if field.col_perm is not None:
        per_head = field.col_head // fj.BLOCK
        blocks = blocks.reshape(n, -1, per_head, blocks.shape[-1])[:, field.col_perm]
        blocks = blocks.reshape(n, nb, -1)
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16).reshape(n, nb)
    if not np.isfinite(d).all():  # imported bit for bit: nothing else would look at them
        raise FermijitError(f"{g.path}: tensor {', '.join(field.sources)} holds NaN or "
                            f"infinite block scales")
    qs = np.ascontiguousarray(blocks[..., 2:]).reshape(n, -1)
    return (qs if kind == "q4_0" else qs.view(np.int8)), d


def read_raw_blocks(field: Field, g: GgufFile, lead: int | None, rows: slice, kind: str,
                    keep_columns: bool = False):
    """uint8 [n, K/Q·S]: rows of a field in a GGUF block kind (ops/kquant.py FORMATS), its
    blocks as stored: columns permuted in whole blocks (`col_head` must be whole blocks), or
    with `keep_columns` left in the GGUF's order."""
    from fermijit.ops.kquant import FORMATS, scales_f16

    fmt = FORMATS[kind]
    r0, r1, _ = rows.indices(field.shape[-2])
    raw = [_raw(t, len(field.shape), lead, idx) for t, idx in _source_runs(field, g, r0, r1)]
    raw = np.concatenate(raw) if len(raw) > 1 else raw[0]
    n, nb = raw.shape[0], field.shape[-1] // fmt.block_values
    blocks = raw.reshape(n, nb, fmt.block_bytes)
    if field.col_perm is not None and not keep_columns:
        if field.col_head % fmt.block_values:
            raise FermijitError(f"{g.path}: {field.name}: heads of {field.col_head} columns are "
                                f"not whole {kind} blocks")
        per_head = field.col_head // fmt.block_values
        blocks = blocks.reshape(n, -1, per_head, fmt.block_bytes)[:, field.col_perm]
    blocks = np.ascontiguousarray(blocks).reshape(n, nb * fmt.block_bytes)
    if not np.isfinite(scales_f16(fmt, blocks)).all():
        raise FermijitError(f"{g.path}: tensor {', '.join(field.sources)} holds NaN or "
                            f"infinite block scales")
    return blocks
