"""HF checkpoint -> fermijit model directory (DESIGN.md, On-disk format), and its loader.

The output directory holds config.json (verbatim), the tokenizer and generation files, one
`model.safetensors` and `fermijit.json` (format version, quantisation per tensor, source
fingerprint, REAP record). Tensors are named by weight-field path (model/weights.py), e.g.
`layers.3.mlp.experts_gate_up`. A quantised tensor is two: `<name>.qs` and `<name>.d`, GGML block
layout, structure of arrays, with a layer's experts contiguous ([E, rows, ...]).

Quantised: the big matrices (Q4_0) and the lm_head (Q8_0 by default: it is the matrix most
sensitive to error). The embedding is fp16: exact for bf16 sources in the normal range, one row
is read per token so its size costs no speed, and its error would enter the residual stream
undiluted (in Q4_0, 8.6% RMS per row, it alone moved the tiny model's logits by 54% of their
max). Kept fp32: norms, conv taps, A_log, dt_bias, and the small matrices whose outputs are
decisions (router [E, H]) or decays (in_proj_a/b [Hv, H], shared_expert_gate [1, H]).

Memory: tensors stream through in row chunks of at most `chunk_bytes` of fp32, read from the
memory-mapped source and written in place into the preallocated output; no tensor is ever
whole in memory (a layer's experts are 2 GiB in fp32).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from fermijit import FermijitError, __version__
from fermijit.model.config import ModelConfig, load_config
from fermijit.model.safetensors_io import (INDEX_NAME, Checkpoint, SafetensorsFile,
                                           SafetensorsWriter)
from fermijit.model.weights import (QuantTensor, TensorPlan, TextWeights, assemble,
                                    plan_text_weights, text_weight_shapes)

FORMAT_VERSION = 1
MANIFEST = "fermijit.json"
WEIGHTS = "model.safetensors"
COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
                "video_preprocessor_config.json",
                # licence files travel with the weights they cover
                "LICENSE", "LICENSE.txt", "NOTICE.txt", "copyright")
# Weight fields stored as Q4_0 (the last component of the field path).
Q4_0_FIELDS = frozenset({"in_proj_qkv", "in_proj_z", "out_proj", "q_proj",
                         "k_proj", "v_proj", "o_proj", "experts_gate_up", "experts_down",
                         "shared_gate_up", "shared_down"})
LM_HEAD_CHOICES = ("q8_0", "q4_0")
BLOCK = 32
CHUNK_BYTES = 64 << 20  # fp32 bytes per streamed piece: ~3x this is the converter's working set


def quantisation(name: str, lm_head: str) -> str:
    """"q4_0", "q8_0", "f16" or "f32" for a weight field path."""
    if name == "lm_head":
        return lm_head
    if name == "embed_tokens":
        return "f16"
    return "q4_0" if name.rsplit(".", 1)[-1] in Q4_0_FIELDS else "f32"


def stored_specs(name: str, shape: tuple[int, ...], quant: str) -> list[tuple[str, str, tuple]]:
    """The safetensors entries of one weight: `<name>.qs`, `<name>.d` or plain F32 `<name>`."""
    if quant in ("f32", "f16"):
        return [(name, quant.upper(), shape)]
    lead, k = shape[:-1], shape[-1]
    if k % BLOCK:
        raise FermijitError(f"cannot quantise {name} {list(shape)}: its inner dimension is not a "
                            f"multiple of {BLOCK}")
    qs = (name + ".qs", "U8", lead + (k // 2,)) if quant == "q4_0" else (name + ".qs", "I8", shape)
    return [qs, (name + ".d", "F16", lead + (k // BLOCK,))]


def source_fingerprint(src: Path, ckpt: Checkpoint) -> str:
    """sha256 of config.json, the index, and each weight file's name, size and header: cheap
    (the data is 67 GB) yet it changes with any re-export, re-shard or change of dtype/shape."""
    h = hashlib.sha256((src / "config.json").read_bytes())
    if (src / INDEX_NAME).is_file():
        h.update((src / INDEX_NAME).read_bytes())
    for f in ckpt.files:
        h.update(f"{f.path.name}:{f.path.stat().st_size}".encode())
        with open(f.path, "rb") as fh:
            h.update(fh.read(f.data_start))
    return h.hexdigest()


def convert(src: str | Path, dst: str | Path, lm_head: str = "q8_0", show_progress: bool = True,
            chunk_bytes: int = CHUNK_BYTES) -> dict:
    """Convert; returns the manifest written to `dst/fermijit.json`."""
    src, dst = Path(src), Path(dst)
    if lm_head not in LM_HEAD_CHOICES:
        raise FermijitError(f"--lm-head must be one of {', '.join(LM_HEAD_CHOICES)}")
    if not src.is_dir():
        raise FermijitError(f"no such model directory: {src}")
    cfg = load_config(src)
    ckpt = Checkpoint(src)
    plans = plan_text_weights(cfg.text_config, ckpt)  # every tensor checked before any write
    quants = {name: quantisation(name, lm_head) for name in plans}
    check_output_dir(dst)

    def copy_files(out: Path) -> None:
        for file in COPIED_FILES:
            if (src / file).is_file():
                shutil.copyfile(src / file, out / file)

    return write_model(
        dst, {name: plan.shape for name, plan in plans.items()}, lm_head,
        lambda name, out: _stream(plans[name], quants[name], ckpt, out, chunk_bytes),
        source={"path": str(src.resolve()), "fingerprint": source_fingerprint(src, ckpt),
                "files": [f.path.name for f in ckpt.files]},
        other_files=copy_files, desc="convert", show_progress=show_progress)


def check_output_dir(dst: Path) -> None:
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FermijitError(f"output directory {dst} exists and is not empty")


def write_model(dst: Path, shapes: dict[str, tuple[int, ...]], lm_head: str, fill,
                source: dict, other_files, desc: str, show_progress: bool = True) -> dict:
    """The one writer of a model directory (`convert` and `model/synth.py`): the weights file, in
    which `fill(name, writer)` stores tensor `name` (quantised as `quantisation` says), yielding
    the elements done per piece; then `other_files(dst)` (config, tokenizer...); the manifest
    last, as it marks the directory complete. Returns the manifest."""
    from tqdm import tqdm

    quants = {name: quantisation(name, lm_head) for name in shapes}
    specs = {name: stored_specs(name, shape, quants[name]) for name, shape in shapes.items()}
    dst.mkdir(parents=True, exist_ok=True)
    # .qs first: each is a multiple of 16 bytes, so every one starts 16-byte aligned; then the
    # other 4-byte-multiple tensors (F32), so the F32 ones stay 4-byte aligned.
    flat = [s for name in shapes for s in specs[name]]
    order = sorted(flat, key=lambda s: (0 if s[0].endswith(".qs") else 1 if s[1] == "F32" else 2))
    partial = dst / (WEIGHTS + ".partial")
    total = sum(int(np.prod(shape)) for shape in shapes.values())
    with SafetensorsWriter(partial, order, {"format": "fermijit"}) as out, \
            tqdm(total=total, unit="param", unit_scale=True, desc=desc, file=sys.stderr,
                 disable=not show_progress) as bar:
        for name in shapes:
            for n_done in fill(name, out):
                bar.update(n_done)
    os.replace(partial, dst / WEIGHTS)
    other_files(dst)
    manifest = {
        "format_version": FORMAT_VERSION,
        "converter": f"fermijit {__version__}",
        "source": source,
        "weights": WEIGHTS,
        "tensors": {name: {"shape": list(shape), "quant": quants[name]}
                    for name, shape in shapes.items()},
        "reap": None,  # no experts pruned
    }
    (dst / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")  # last: marks it complete
    return manifest


def describe(manifest: dict) -> str:
    """One line for the CLI: what was written."""
    kinds = [t["quant"] for t in manifest["tensors"].values()]
    counts = ", ".join(f"{kinds.count(k)} {k}" for k in ("q4_0", "q8_0", "f16", "f32")
                       if k in kinds)
    return f"{len(kinds)} tensors ({counts}), lm_head {manifest['tensors']['lm_head']['quant']}"


def _stream(plan: TensorPlan, quant: str, ckpt: Checkpoint, out: SafetensorsWriter,
            chunk_bytes: int):
    """Read, quantise and write `plan` in row chunks; yields the elements done per chunk."""
    from fermijit.ops import quant as q

    rows, cols = (plan.shape[-2], plan.shape[-1]) if len(plan.shape) >= 2 else (plan.shape[0], 1)
    leads = range(plan.shape[0]) if len(plan.shape) == 3 else [None]
    step = max(1, chunk_bytes // (4 * cols))
    for e, lead in enumerate(leads):
        for r0 in range(0, rows, step):
            x = plan.read(ckpt, lead, slice(r0, r0 + step))        # fp32 [n, cols] (or [n])
            first_row = e * rows + r0
            if quant == "f32":
                out.write(plan.name, x, start=first_row * cols)
            elif quant == "f16":
                if np.abs(x).max(initial=0) > np.finfo(np.float16).max:
                    raise FermijitError(f"{plan.name}: values beyond the fp16 range")
                out.write(plan.name, x.astype(np.float16), start=first_row * cols)
            else:
                qs, d = q.quantize_q4_0_cpu(x) if quant == "q4_0" else q.quantize_q8_0(x)
                out.write(plan.name + ".qs", qs, start=first_row * qs.shape[-1])
                out.write(plan.name + ".d", d, start=first_row * d.shape[-1])
            yield x.size


def is_fermijit_model(directory: str | Path) -> bool:
    return (Path(directory) / MANIFEST).is_file()


def load_converted(directory: str | Path) -> tuple[ModelConfig, TextWeights, dict]:
    """A converted model: (config, weights as memmap views, manifest). Nothing is copied."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise FermijitError(f"{directory}: not a fermijit model (no {MANIFEST}; convert it first)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        version, tensors = manifest["format_version"], manifest["tensors"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        raise FermijitError(f"{path}: unreadable manifest") from None
    if version != FORMAT_VERSION:
        raise FermijitError(f"{path}: format version {version}, this fermijit reads "
                            f"{FORMAT_VERSION}; convert the model again")
    cfg = load_config(directory)
    expected = text_weight_shapes(cfg.text_config)
    for name, shape in expected.items():
        if name not in tensors:
            raise FermijitError(f"{path}: missing tensor {name}")
        if tuple(tensors[name]["shape"]) != shape:
            raise FermijitError(f"{path}: tensor {name} has shape {tensors[name]['shape']}, "
                                f"config.json implies {list(shape)}")
    weights_file = SafetensorsFile(directory / manifest.get("weights", WEIGHTS))
    arrays = {}
    for name, entry in tensors.items():
        for stored, dtype, shape in stored_specs(name, tuple(entry["shape"]), entry["quant"]):
            info = weights_file.tensors.get(stored)
            if info is None:
                raise FermijitError(f"{weights_file.path}: missing tensor {stored}")
            if info.dtype != dtype or info.shape != shape:
                raise FermijitError(f"{weights_file.path}: tensor {stored} is {info.dtype} "
                                    f"{list(info.shape)}, expected {dtype} {list(shape)}")
        if entry["quant"] in ("f32", "f16"):
            arrays[name] = weights_file.raw(name)
        else:
            arrays[name] = QuantTensor(entry["quant"], weights_file.raw(name + ".qs"),
                                       weights_file.raw(name + ".d"))
    try:
        weights = assemble(cfg.text_config, arrays)
    except KeyError as e:
        raise FermijitError(f"{path}: no tensor {e.args[0]} for this config") from None
    return cfg, weights, manifest
