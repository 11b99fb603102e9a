"""A GGUF file to a fermijit model directory (model/gguf_io.py reads it; convert.py's writer writes
it), and the cache that lets `generate` and `eval` take `--model FILE.gguf`.

Why convert into a cache rather than load the GGUF directly: GGUF's Q4_0 is an array of 18-byte
blocks, fermijit's kernels read structure-of-arrays qs/d; a direct load would repack every matrix
in memory on every start (the real model's experts are ~18 GB, beyond the RAM fermijit targets)
and dequantise-and-requantise K-quants each time (minutes). Converted once, later runs
memory-map the result at no cost, as any converted model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from fermijit import FermijitError
from fermijit.model import convert as fj
from fermijit.model.manifest import Source
from fermijit.model.gguf_io import (Field, GgufFile, plan_fields, read_blocks,
                                    read_config, read_float, read_raw_blocks)
from fermijit.ops import kquant, kquant_matvec


# The GGUF block kinds kept as their blocks (ops/kquant.py FORMATS), by GGML type id, and where:
# the matrices fermijit quantises that its K-quant and Q5 products read (ops/kquant_matvec.py:
# the dense projections, the LM head, the MoE experts through model/block_moe.py), and the
# embedding, whose rows are dequantised as they are looked up (ops/embedding.py).
BLOCK_KINDS = {type_id: kind for kind, type_id in kquant.GGML_TYPE.items()}


def _block_kind(field: Field, g: GgufFile, target: str) -> str | None:
    kinds = {int(t.tensor_type) for t in field.tensors(g)}
    if len(kinds) != 1 or (kind := BLOCK_KINDS.get(kinds.pop())) is None:
        return None
    if kind not in kquant_matvec.PRODUCTS and target != "f16":
        return None
    return kind if target in ("q4_0", "q8_0", "f16") else None


def keeps_tiled_input(field: Field, kind: str) -> bool:
    """True where a block field's columns cannot be put back in grouped head order (a head's
    columns are not whole blocks: the real model's out_proj, 128 per head against Q4_K's 256):
    its blocks stay in llama.cpp's tiled order and its product permutes the input instead
    (manifest source.tiled_inputs; model/convert.py tiled_input_order)."""
    return field.col_perm is not None and field.col_head % kquant.FORMATS[kind].block_values != 0


def storage(field: Field, g: GgufFile, target: str) -> tuple[str, bool]:
    """(the quant fermijit stores the field in, whether its blocks are imported bit for bit).
    Q4_0/Q8_0 GGUF blocks are kept where fermijit stores a quantised matrix (Q8_0 experts run
    through model/block_moe.py), and the block kinds of BLOCK_KINDS where `_block_kind` says;
    otherwise the values are read as floats and stored as `convert` would."""
    from gguf import GGMLQuantizationType as T

    kinds = {t.tensor_type for t in field.tensors(g)}
    whole_blocks = field.col_perm is None or field.col_head % fj.BLOCK == 0
    if target in ("q4_0", "q8_0") and len(kinds) == 1 and whole_blocks:
        kind = next(iter(kinds))
        if kind == T.Q4_0:
            return "q4_0", True
        if kind == T.Q8_0:
            return "q8_0", True
    block_kind = _block_kind(field, g, target)
    if block_kind is not None:
        return block_kind, True
    return target, False


def _is_float(t) -> bool:
    from gguf import GGMLQuantizationType as T

    return t.tensor_type in (T.F32, T.F16, T.BF16)


def convert(src: Path, dst: Path, lm_head: str = "q8_0", show_progress: bool = True,
            chunk_bytes: int = fj.CHUNK_BYTES) -> dict:
    """A GGUF file to a fermijit model directory; returns the manifest."""
    from fermijit.model.gguf_tokenizer import tokenizer_files

    g = GgufFile(src)
    raw_config, cfg = read_config(g)
    fields = plan_fields(cfg.text_config, g)          # every tensor checked before any write
    files = tokenizer_files(g)
    quants, imported, requantised, tiled = {}, set(), {}, set()
    for name, field in fields.items():
        quants[name], is_import = storage(field, g, fj.quantisation(name, lm_head))
        if is_import and quants[name] in kquant.FORMATS and keeps_tiled_input(field,
                                                                               quants[name]):
            tiled.add(name)
        fj.stored_specs(name, field.shape, quants[name])  # quantisable: checked before any write
        if is_import:
            imported.add(name)
        elif quants[name] != "f32":
            for t in field.tensors(g):
                if not _is_float(t):
                    requantised[t.name] = (t.tensor_type.name, int(t.n_bytes))
    fj.check_output_dir(dst)
    if requantised:
        kinds = sorted({kind for kind, _ in requantised.values()})
        mib = sum(n for _, n in requantised.values()) / 2**20
        n = len(requantised)
        print(f"warning: {src.name}: {n} tensor{'s' if n > 1 else ''} ({mib:.1f} MiB of "
              f"{', '.join(kinds)}) dequantised and requantised to fermijit's Q4_0/Q8_0/F16 "
              f"(its kernels read Q4_0, Q8_0, {'/'.join(k.upper() for k in kquant_matvec.PRODUCTS)}"
              f" blocks)", file=sys.stderr)

    def fill(name: str, out):
        field = fields[name]
        if name in imported:
            return _write_blocks(field, g, quants[name], out, chunk_bytes, name in tiled)
        return fj.stream(name, field.shape, quants[name],
                         lambda lead, rows: _read_float(field, g, lead, rows), out, chunk_bytes)

    def other_files(out: Path) -> None:
        (out / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n")
        for file, text in files.items():
            (out / file).write_text(text, encoding="utf-8")

    source = Source(path=str(Path(src).resolve()), fingerprint=g.fingerprint(),
                    files=(Path(src).name,), format="gguf",
                    imported_blocks=tuple(sorted(imported)), tiled_inputs=tuple(sorted(tiled)),
                    requantised={name: kind for name, (kind, _) in requantised.items()})
    return fj.write_model(dst, {name: f.shape for name, f in fields.items()}, lm_head, fill,
                          source, other_files, desc="convert", show_progress=show_progress,
                          quants=quants)


def _read_float(field: Field, g: GgufFile, lead, rows) -> np.ndarray:
    try:
        return read_float(field, g, lead, rows)
    except NotImplementedError as e:  # gguf has no dequantiser for this type
        raise FermijitError(f"{g.path}: {field.sources}: {e}") from None


def _write_blocks(field: Field, g: GgufFile, quant: str, out, chunk_bytes: int,
                  keep_columns: bool = False):
    """Copy a field's blocks in row chunks (`keep_columns`: in the GGUF's column order);
    yields the elements done per chunk."""
    rows, cols = field.shape[-2], field.shape[-1]
    leads = range(field.shape[0]) if len(field.shape) == 3 else [None]
    step = max(1, chunk_bytes // (4 * cols))
    for e, lead in enumerate(leads):
        for r0 in range(0, rows, step):
            first_row = e * rows + r0
            if quant in kquant.FORMATS:
                blocks = read_raw_blocks(field, g, lead, slice(r0, r0 + step), quant,
                                         keep_columns)
                out.write(field.name + ".blocks", blocks, start=first_row * blocks.shape[-1])
                yield blocks.shape[0] * cols
                continue
            qs, d = read_blocks(field, g, lead, slice(r0, r0 + step), quant)
            out.write(field.name + ".qs", qs, start=first_row * qs.shape[-1])
            out.write(field.name + ".d", d, start=first_row * d.shape[-1])
            yield qs.shape[0] * cols


def cached(path: str | Path, lm_head: str = "q8_0") -> Path:
    """The fermijit model directory of a GGUF file, converted on first use into the cache
    ($FERMIJIT_CACHE, else $XDG_CACHE_HOME/fermijit, else ~/.cache/fermijit), under gguf/ by
    name and the sha256 of its bytes (model/data_hash.py: hashed again only when the file's
    stamp changed), so a changed file converts again, even with its size and header kept."""
    import os
    import shutil

    from fermijit.model.data_hash import cache_root, file_sha256

    path = Path(path)
    GgufFile(path)  # a bad file: one line, before it is hashed
    root = cache_root() / "gguf"
    dst = root / f"{path.stem}-{file_sha256(path)[:16]}-{lm_head}"
    if fj.is_fermijit_model(dst):
        return dst
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # was "Error: Read-only file system: DIR", which named no remedy
        raise FermijitError(f"cannot make the cache of converted GGUF files {root}: "
                            f"{e.strerror} (set FERMIJIT_CACHE to a writable folder)") from None
    partial = root / f".{dst.name}.{os.getpid()}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    print(f"converting {path} into {dst} (once)", file=sys.stderr, flush=True)
    try:
        convert(path, partial, lm_head)
        if not fj.is_fermijit_model(dst):  # else another process finished first: keep its copy
            shutil.rmtree(dst, ignore_errors=True)  # an earlier, interrupted conversion
            os.replace(partial, dst)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return dst


def model_directory(path: str | Path) -> Path:
    """What `--model` names: a GGUF file (converted into the cache once), else the directory."""
    path = Path(path)
    return cached(path) if path.is_file() else path


def load_float_weights(path: str | Path):
    """(ModelConfig, TextWeights in fp32, in memory): a GGUF's values unquantised, for reference
    runs of small models (as forward.load_model runs an HF checkpoint)."""
    from fermijit.model.weights import assemble

    g = GgufFile(path)
    _, cfg = read_config(g)
    arrays = {}
    for name, field in plan_fields(cfg.text_config, g).items():
        leads = range(field.shape[0]) if len(field.shape) == 3 else [None]
        parts = [_read_float(field, g, lead, slice(None)) for lead in leads]
        arrays[name] = np.stack(parts) if len(field.shape) == 3 else parts[0]
    return cfg, assemble(cfg.text_config, arrays)
