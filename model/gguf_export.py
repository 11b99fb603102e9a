"""A fermijit model written as GGUF (arch `qwen35moe`) with llama.cpp's own `gguf` package, for
llama.cpp to run the same weights: the side by side of `bench llama-cpp`.

Every tensor is stored as llama.cpp's converter stores it, model/gguf_io.py's plan run the other
way (`gguf_io.field_plan`): names, gate_up split into gate and up, the value heads regrouped,
norms stored as 1 + w, A_log as -exp(A_log), conv1d [C, Kc]. Q4_0 and Q8_0 matrices keep their
bytes: fermijit's structure of arrays (qs, d) becomes GGML's blocks (fp16 d, then the quants),
so both engines read the same bytes per token (the Q8_0 LM head included; fp32 router and GDN
gates stay fp32, the embedding fp16). Reading the file back (`convert x.gguf`) gives the
quantised tensors bit for bit and the float ones within an ulp of the shifted norms and A_log
(tests/model/test_gguf_export.py).

The tokenizer goes as llama.cpp's `gpt2` type: the vocabulary by id, the added tokens typed
CONTROL (special) or USER_DEFINED, the BPE merges, pre-tokenizer `qwen35`.

Tensors are written one at a time (a few hundred MB at most in memory) after the header.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import numpy as np

from fermijit import FermijitError
from fermijit.model import convert
from fermijit.model.config import FULL_ATTENTION, TextConfig
from fermijit.model.gguf_io import ARCH, Field, field_plan
from fermijit.model.weights import BlockTensor, QuantTensor
from fermijit.ops import kquant

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4  # gguf.TokenType
FILE_TYPE_Q4_0 = 2                       # llama_ftype MOSTLY_Q4_0


def export(model_dir: str | Path, dst: str | Path, show_progress: bool = False) -> dict:
    """Write the fermijit model at `model_dir` as a GGUF file `dst`; returns
    {"path", "bytes", "seconds", "tensors"}. Written beside `dst` and renamed when whole: a
    failure (a full disk, SIGTERM) leaves no file that looks like a GGUF, and an older `dst`
    as it was."""
    start = time.perf_counter()
    dst = Path(dst)
    cfg, arrays, _ = convert.converted_arrays(model_dir)
    _refuse_own_file(Path(model_dir), dst)
    partial = dst.with_name(dst.name + convert.PARTIAL_SUFFIX)
    try:
        with convert.terminate_as_exception("export"):
            n_tensors = _write(cfg.text_config, arrays, Path(model_dir), partial, show_progress)
        os.replace(partial, dst)
    except BaseException as e:
        failure = convert.write_failure("export", e, dst) if isinstance(e, OSError) else None
        with contextlib.suppress(OSError):  # none made (EROFS, not ENOENT, on a read-only disk)
            partial.unlink()
        if failure is not None:
            raise failure from None
        raise
    return {"path": str(dst), "bytes": dst.stat().st_size,
            "seconds": time.perf_counter() - start, "tensors": n_tensors}


def _refuse_own_file(model_dir: Path, dst: Path) -> None:
    """`dst` must not be one of the model's files: writing it truncated the weights that the
    export then read (the model lost)."""
    if dst.exists() and any(f.is_file() and dst.samefile(f) for f in model_dir.iterdir()):
        raise FermijitError(f"{dst} is a file of the model {model_dir}: export writes a new "
                            f"GGUF file, name another")


def _write(text: TextConfig, arrays, model_dir: Path, path: Path, show_progress: bool) -> int:
    """The GGUF file at `path`; returns its tensor count."""
    from gguf import GGMLQuantizationType, GGUFWriter

    plan = field_plan(text)
    writer = GGUFWriter(path, ARCH)
    _metadata(writer, text)
    _tokenizer(writer, model_dir, text)
    # Every tensor's info first (the header lists them all), then the data in the same order.
    pieces = [(name, field) for name, field in plan.items()]
    infos = []
    for name, field in pieces:
        for gguf_name, data, kind in _tensors(field, arrays[name], only_shape=True):
            raw = _raw_type(kind, GGMLQuantizationType)
            writer.add_tensor_info(gguf_name, data.shape, data.dtype, data.nbytes, raw_dtype=raw)
            infos.append(gguf_name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    done = 0
    try:
        for name, field in pieces:
            for _, data, _ in _tensors(field, arrays[name]):
                writer.write_tensor_data(data)
                done += 1
            if show_progress:
                print(f"\rgguf export: {done}/{len(infos)} tensors", end="", flush=True)
    finally:
        writer.close()
    if show_progress:
        print()
    return len(infos)


def _raw_type(kind: str, types):
    return {"q4_0": types.Q4_0, "q8_0": types.Q8_0, "q4_k": types.Q4_K, "q5_k": types.Q5_K,
            "q6_k": types.Q6_K, "q5_0": types.Q5_0, "q5_1": types.Q5_1}.get(kind)


def _metadata(w, c: TextConfig) -> None:
    """The `qwen35moe.*` keys llama.cpp's converter writes (gguf_io.text_config reads them)."""
    sections = list(c.rope_parameters.mrope_section)
    counts = {"block_count": c.num_hidden_layers, "context_length": c.max_position_embeddings,
              "embedding_length": c.hidden_size, "attention.head_count": c.num_attention_heads,
              "attention.head_count_kv": c.num_key_value_heads, "expert_count": c.num_experts,
              "expert_used_count": c.num_experts_per_tok, "attention.key_length": c.head_dim,
              "attention.value_length": c.head_dim,
              "expert_feed_forward_length": c.moe_intermediate_size,
              "expert_shared_feed_forward_length": c.shared_expert_intermediate_size,
              "ssm.conv_kernel": c.linear_conv_kernel_dim, "ssm.state_size": c.linear_key_head_dim,
              "ssm.group_count": c.linear_num_key_heads,
              "ssm.time_step_rank": c.linear_num_value_heads,
              "ssm.inner_size": c.linear_value_dim,
              "full_attention_interval": c.full_attention_interval,
              "rope.dimension_count": c.rotary_dim}
    w.add_name("fermijit export")
    for key, value in counts.items():
        w.add_uint32(f"{ARCH}.{key}", value)
    w.add_float32(f"{ARCH}.rope.freq_base", float(c.rope_parameters.rope_theta))
    w.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", float(c.rms_norm_eps))
    w.add_array(f"{ARCH}.rope.dimension_sections", sections + [0] * (4 - len(sections)))
    w.add_array(f"{ARCH}.attention.recurrent_layers",
                [kind != FULL_ATTENTION for kind in c.layer_types])
    w.add_file_type(FILE_TYPE_Q4_0)
    w.add_quantization_version(2)


def _tokenizer(w, model_dir: Path, c: TextConfig) -> None:
    """tokenizer.json (a byte-level BPE) as llama.cpp's `gpt2` vocabulary."""
    path = model_dir / "tokenizer.json"
    try:
        tok = json.loads(path.read_text(encoding="utf-8"))
        vocab, merges = tok["model"]["vocab"], tok["model"].get("merges", [])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise FermijitError(f"{path}: not a BPE tokenizer.json ({e})") from None
    tokens = [f"[PAD{i}]" for i in range(c.vocab_size)]
    types = [USER_DEFINED] * c.vocab_size  # padding ids no merge makes (llama.cpp's [PAD<i>])
    for text, i in vocab.items():
        if 0 <= i < c.vocab_size:
            tokens[i], types[i] = text, NORMAL
    for added in tok.get("added_tokens", []):
        i = added["id"]
        if 0 <= i < c.vocab_size:
            tokens[i] = added["content"]
            types[i] = CONTROL if added.get("special") else USER_DEFINED
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(tokens)
    w.add_token_types(types)
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    # llama.cpp refuses a `gpt2` vocabulary without merges and the gguf package writes no empty
    # array: synth's byte-level tokenizer (none) gets one of two byte tokens whose product is no
    # token, which changes no tokenisation (llama.cpp falls back to the bytes).
    w.add_token_merges(merges or [f"{tokens[0]} {tokens[1]}"])
    for setter, value in ((w.add_bos_token_id, c.bos_token_id), (w.add_pad_token_id, c.pad_token_id),
                          (w.add_eos_token_id, c.eos_token_id if not isinstance(
                              c.eos_token_id, tuple) else c.eos_token_id[0])):
        if value is not None:
            setter(int(value))
    config = model_dir / "tokenizer_config.json"
    if config.exists():
        template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, str):
            w.add_chat_template(template)


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size)
    return inv


def _tensors(field: Field, value, only_shape: bool = False):
    """(GGUF name, data, kind: "q4_0", "q8_0", a GGUF block kind, "" for floats) of each source
    tensor of `field` from its fermijit
    `value`: llama.cpp's layout (gguf_io's transforms run backwards). Quantised data are uint8
    rows of GGML blocks. `only_shape`: zero-stride stand-ins of the right shape and dtype."""
    kind = value.kind if isinstance(value, (QuantTensor, BlockTensor)) else ""
    tiled = isinstance(value, BlockTensor) and value.in_perm is not None
    if isinstance(value, BlockTensor):                      # GGML's blocks already
        data = value.blocks
        if only_shape:
            data = np.broadcast_to(np.zeros((), np.uint8), data.shape)
        if field.col_perm is not None and not tiled \
                and field.col_head % kquant.FORMATS[kind].block_values:
            raise FermijitError(f"gguf export: {field.name} in {kind.upper()}: its heads of "
                                f"{field.col_head} columns are not whole blocks, so they cannot "
                                f"be put in llama.cpp's order without requantising")
    elif kind:
        data = _blocks(value, only_shape)                   # [..., rows, nb * block bytes]
    else:
        data = np.asarray(value)
        if only_shape:
            data = np.broadcast_to(np.zeros((), data.dtype), data.shape)
    axis = 0 if data.ndim == 1 else data.ndim - 2           # rows (elements for vectors)
    if not only_shape:
        if field.col_perm is not None and not tiled:        # column heads (out_proj), whole blocks
            # (blocks kept in llama.cpp's tiled order at import, in_perm, go back as they are)
            n = data.shape[:-1]
            heads = data.reshape(*n, field.col_perm.size, -1)
            data = np.ascontiguousarray(heads[..., _inverse(field.col_perm), :]).reshape(
                *n, -1)
        if field.rows is not None:
            data = np.take(data, _inverse(field.rows), axis=axis)
        if field.kind == "minus_1":
            data = (data + np.float32(1)).astype(data.dtype)
        elif field.kind == "log_neg":
            data = (-np.exp(data.astype(np.float32))).astype(data.dtype)
    n_src = len(field.sources)
    if data.shape[axis] % n_src:
        raise FermijitError(f"gguf export: {field.name} has {data.shape[axis]} rows, not "
                            f"{n_src} equal parts")
    for name, part in zip(field.sources, np.split(data, n_src, axis=axis)):
        yield name, (part if only_shape else np.ascontiguousarray(part)), kind


def _blocks(q: QuantTensor, only_shape: bool) -> np.ndarray:
    """GGML blocks [..., nb * (2 + quant bytes)] from fermijit's qs [..., nb * q] and d."""
    nb = q.d.shape[-1]
    per = q.qs.shape[-1] // nb                               # 16 (Q4_0) or 32 (Q8_0) bytes
    shape = (*q.d.shape[:-1], nb * (2 + per))
    if only_shape:
        return np.broadcast_to(np.zeros((), np.uint8), shape)
    out = np.empty((*q.d.shape, 2 + per), np.uint8)
    out[..., :2] = np.asarray(q.d).view(np.uint8).reshape(*q.d.shape, 2)
    out[..., 2:] = np.asarray(q.qs).view(np.uint8).reshape(*q.d.shape, per)
    return out.reshape(shape)
