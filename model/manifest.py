"""`fermijit.json`, the manifest of a fermijit model directory (DESIGN.md, On-disk format), read
with the typed machinery of config.json (model/config.py `build`), and the integrity of the
weights it describes.

Format 2 (format 1 had no checksums):
    {"format_version": 2, "converter": "fermijit 0.1.0",
     "source": {"path": str, "fingerprint": str, "files": [str]},
     "weights": "model.safetensors",           a bare file name beside fermijit.json
     "tensors": {field path: {"shape": [int], "quant": "q4_0" | "q8_0" | "f16" | "f32"
                                       | a GGUF block kind (ops/kquant.py FORMATS),
                              "checksum": sha256 hex of the stored bytes, `.qs` then `.d`
                                          (`.blocks` for a block kind)}},
     "reap": null or the REAP record,
     "mix": null or the quantisation mix written (model/quant_mix.py: "q4_0", "q4_k_m")}
Writers do not build this by hand: model/convert.py `write_manifest` is the one writer.

Checks: every load verifies the manifest against config.json and the weights file's header, the
checksums and finiteness of the smallest tensors (norms, gates, biases: LOAD_CHECK_NBYTES in
all), and of every other tensor a sample (`sample`: sha256 of spread-out chunks of its stored
bytes, one in each expert of a layer's experts; their floats finite): zeros or noise over a part
of lm_head, the embedding or one expert ran silently before. `python -m
fermijit verify` checks every byte of every tensor. sha256, not blake2b: hashlib's sha256 ran
0.30 GiB/s here, blake2b 0.16 (one run on this 2-core machine, `hashlib` over 256 MiB).
"""

from __future__ import annotations

import dataclasses
import hashlib
import typing
from pathlib import Path

import numpy as np

from fermijit import FermijitError
from fermijit.model.config import MAX_DIMENSION, build
from fermijit.model.files import member, read_json, short
from fermijit.model.safetensors_io import FERMIJIT_FORMAT, SINGLE_NAME, SafetensorsFile

FORMAT_VERSION = 2
MANIFEST = "fermijit.json"
Quant = typing.Literal["q4_0", "q8_0", "f16", "f32", "q4_k", "q5_k", "q6_k", "q5_0", "q5_1"]
BLOCK = 32
# Smallest tensors first. On the default model 4 MiB is 111 of 133 tensors, 41-98 ms of a
# 200 ms load_converted (3 runs on this 2-core machine under a load average of ~13).
LOAD_CHECK_NBYTES = 4 << 20
HASH_CHUNK_NBYTES = 64 << 20
# A sample: this many chunks spread evenly over each stored part, at least one per expert of a
# layer's experts (every expert slice holds a chunk's start), each SAMPLE_CHUNK_NBYTES. The
# REAP-128 model: ~80 tensors of 128 experts, ~60 MB read at load (in the page cache by then).
SAMPLE_CHUNKS = 16
SAMPLE_CHUNK_NBYTES = 1024


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    shape: tuple[int, ...]
    quant: Quant
    checksum: str  # sha256 hex of the stored bytes (`.qs` then `.d` for a quantised tensor)
    sample: str = ""  # sha256 hex of `sample_spans` of them ("": written before samples were)


@dataclasses.dataclass(frozen=True)
class Source:
    path: str
    fingerprint: str
    files: tuple[str, ...]
    format: str = "safetensors"              # or "gguf", "synthetic"
    imported_blocks: tuple[str, ...] = ()    # GGUF: tensors whose blocks were copied bit for bit
    # GGUF: block tensors whose input columns stay in llama.cpp's tiled value-head order (a
    # head's columns are not whole blocks: model/gguf_convert.py), permuted at run time instead
    tiled_inputs: tuple[str, ...] = ()
    requantised: dict[str, str] = dataclasses.field(default_factory=dict)  # GGUF: name -> type


@dataclasses.dataclass(frozen=True)
class Manifest:
    format_version: int
    converter: str
    source: Source
    weights: str
    tensors: dict[str, TensorEntry]
    reap: dict[str, object] | None = None  # no experts pruned; the REAP record otherwise
    # The quantisation mix (model/quant_mix.py) convert or synth wrote; None: as a GGUF held its
    # kinds, or written before mixes (q4_0)
    mix: str | None = None

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


def block_values(quant: str) -> int:
    """Values per block along the inner dimension of a quantised kind."""
    from fermijit.ops.kquant import FORMATS

    return FORMATS[quant].block_values if quant in FORMATS else BLOCK


def stored_specs(name: str, shape: tuple[int, ...], quant: str) -> list[tuple[str, str, tuple]]:
    """The safetensors entries of one weight: `<name>.qs`, `<name>.d`, plain `<name>`, or
    `<name>.blocks` (a GGUF block kind, its blocks as imported)."""
    from fermijit.ops.kquant import FORMATS

    if quant in ("f32", "f16"):
        return [(name, quant.upper(), shape)]
    lead, k = shape[:-1], shape[-1]
    if k % block_values(quant):
        raise FermijitError(f"cannot quantise {name} {list(shape)}: its inner dimension is not a "
                            f"multiple of {block_values(quant)}")
    if quant in FORMATS:
        return [(name + ".blocks", "U8", lead + (FORMATS[quant].n_bytes(k),))]
    qs = (name + ".qs", "U8", lead + (k // 2,)) if quant == "q4_0" else (name + ".qs", "I8", shape)
    return [qs, (name + ".d", "F16", lead + (k // BLOCK,))]


def check_finished(directory: str | Path, files=None) -> None:
    """`directory`, read without a manifest, must not hold a fermijit weights file (`files`: its
    SafetensorsFiles where opened already, else its model.safetensors): model/convert.py
    write_model writes the manifest last, so a conversion stopped between the two leaves one,
    which the HF reader refused for a tensor name."""
    if files is None:
        path = Path(directory) / SINGLE_NAME
        files = [SafetensorsFile(path)] if path.is_file() else []
    if any(f.metadata.get("format") == FERMIJIT_FORMAT for f in files):
        raise FermijitError(f"{directory} holds fermijit-converted weights ({SINGLE_NAME} with "
                            f"fermijit tensor names) but no {MANIFEST}: an unfinished "
                            f"conversion? remove it and convert again")


def read_manifest(directory: str | Path) -> Manifest:
    """The typed manifest of a model directory; a bad field is named."""
    path = Path(directory) / MANIFEST
    raw = read_json(path)
    version = raw.get("format_version")
    if type(version) is not int:
        raise FermijitError(f"{path}: format_version: expected int, got {short(version)}")
    if version != FORMAT_VERSION:
        raise FermijitError(f"{path}: format version {version}, this fermijit reads "
                            f"{FORMAT_VERSION}; convert the model again")
    manifest = build(Manifest, raw, str(path))
    member(directory, manifest.weights, f"{path}: weights")
    for name, e in manifest.tensors.items():
        where = f"{path}: tensors: {name}"
        if not e.shape or len(e.shape) > 3 or not all(0 < n <= MAX_DIMENSION for n in e.shape):
            raise FermijitError(f"{where}: shape {list(e.shape)} is not 1 to 3 dimensions in "
                                f"1..{MAX_DIMENSION}")
        for what, digest in (("checksum", e.checksum), ("sample", e.sample or "0" * 64)):
            if len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
                raise FermijitError(f"{where}: {what} is not a sha256 hex digest")
        if e.quant not in ("f16", "f32") and e.shape[-1] % block_values(e.quant):
            raise FermijitError(f"{where}: a {e.quant} tensor's inner dimension must be a "
                                f"multiple of {block_values(e.quant)}, got {list(e.shape)}")
    return manifest


def checksum(weights: SafetensorsFile, name: str, entry: TensorEntry, on_bytes=None) -> str:
    """sha256 of the stored bytes of manifest entry `name`; `on_bytes(n)` as they are hashed."""
    h = hashlib.sha256()
    for stored, _, _ in stored_specs(name, entry.shape, entry.quant):
        flat = weights.raw(stored).reshape(-1).view(np.uint8)
        for i in range(0, flat.size, HASH_CHUNK_NBYTES):
            h.update(flat[i:i + HASH_CHUNK_NBYTES])
            if on_bytes is not None:
                on_bytes(min(HASH_CHUNK_NBYTES, flat.size - i))
    return h.hexdigest()


def stored_nbytes(weights: SafetensorsFile, name: str, entry: TensorEntry) -> int:
    infos = (weights.tensors[s] for s, _, _ in stored_specs(name, entry.shape, entry.quant))
    return sum(i.end - i.begin for i in infos)


def check_tensor(weights: SafetensorsFile, name: str, entry: TensorEntry, on_bytes=None) -> None:
    """FermijitError unless the tensor's bytes match its checksum and its floats (values, or
    block scales) are finite."""
    if checksum(weights, name, entry, on_bytes) != entry.checksum:
        raise FermijitError(f"{weights.path}: tensor {name} does not match its checksum in "
                            f"{MANIFEST} (the file is damaged or was changed)")
    from fermijit.ops.kquant import FORMATS, scales_f16

    if entry.quant in FORMATS:
        floats = scales_f16(FORMATS[entry.quant], weights.raw(name + ".blocks"))
    else:
        floats = weights.raw(name if entry.quant in ("f16", "f32") else name + ".d")
    if not np.isfinite(floats).all():
        raise FermijitError(f"{weights.path}: tensor {name} holds NaN or infinite values")


def sample_spans(nbytes: int, n_experts: int = 1) -> list[tuple[int, int]]:
    """The byte ranges of a stored part of `nbytes` that its sample reads: max(SAMPLE_CHUNKS,
    n_experts + 1) chunks, evenly spaced from the first byte to the last, starts 64-aligned
    (whole floats), or the whole part when that is no larger."""
    n_chunks = max(SAMPLE_CHUNKS, n_experts + 1)
    if nbytes <= n_chunks * SAMPLE_CHUNK_NBYTES:
        return [(0, nbytes)]
    last = nbytes - SAMPLE_CHUNK_NBYTES
    starts = sorted({i * last // (n_chunks - 1) // 64 * 64 for i in range(n_chunks)})
    return [(a, min(a + SAMPLE_CHUNK_NBYTES, nbytes)) for a in starts]


def sample(weights: SafetensorsFile, name: str, entry: TensorEntry,
           check_floats: bool = False) -> str:
    """sha256 hex of the sampled chunks of a tensor's stored parts (`.qs` then `.d`); with
    `check_floats`, FermijitError if the floats in them (values or block scales) are not
    finite."""
    h = hashlib.sha256()
    n_experts = entry.shape[0] if len(entry.shape) == 3 else 1
    for stored, dtype, _ in stored_specs(name, entry.shape, entry.quant):
        # A plain ndarray view (np.memmap's slicing costs microseconds a chunk: 0.23 s of every
        # full-size load for ~30,000 chunks, issue 28 item 4), and the chunks gathered into one
        # array hashed at once: sha256 of their concatenation, what hashing them in turn gives.
        flat = np.asarray(weights.raw(stored)).reshape(-1)
        raw = flat.view(np.uint8)
        spans = sample_spans(raw.size, n_experts)
        if len(spans) == 1:
            chunks = raw[spans[0][0]:spans[0][1]]
        else:  # the chunks joined: the reap128 shape's 671 samples 0.07 s (0.11 s gathered by
            # an index array of every byte)
            view = memoryview(raw)
            chunks = np.frombuffer(b"".join([view[a:b] for a, b in spans]), np.uint8)
        h.update(chunks)  # contiguous: a slice of a flat array, or a gather's new array
        if (check_floats and dtype in ("F16", "F32")
                and not np.isfinite(chunks.view(flat.dtype)).all()):
            raise FermijitError(f"{weights.path}: tensor {name} holds NaN or infinite values")
    return h.hexdigest()


def check_at_load(weights: SafetensorsFile, manifest: Manifest,
                  budget_nbytes: int | None = None) -> tuple[int, int]:
    """`check_tensor` on the smallest tensors, up to `budget_nbytes` in all (what every load
    affords, LOAD_CHECK_NBYTES by default), and the sample of every other tensor that has one;
    returns (tensors checked whole, tensors checked by their sample)."""
    budget_nbytes = LOAD_CHECK_NBYTES if budget_nbytes is None else budget_nbytes
    sizes = sorted((stored_nbytes(weights, name, e), name) for name, e in
                   manifest.tensors.items())
    n_checked, n_sampled, spent = 0, 0, 0
    for nbytes, name in sizes:
        entry = manifest.tensors[name]
        if spent + nbytes <= budget_nbytes:
            check_tensor(weights, name, entry)
            spent += nbytes
            n_checked += 1
        elif entry.sample:
            if sample(weights, name, entry, check_floats=True) != entry.sample:
                raise FermijitError(f"{weights.path}: tensor {name} does not match its sampled "
                                    f"checksum in {MANIFEST} (the file is damaged or was "
                                    f"changed)")
            n_sampled += 1
    return n_checked, n_sampled


def verify(directory: str | Path, show_progress: bool = True) -> tuple[int, int]:
    """Every tensor of a fermijit model against its checksum (progress bar on stderr); returns
    (tensors, bytes) checked. The manifest, config and header are checked first by the loader."""
    import sys

    from tqdm import tqdm

    from fermijit.model.convert import load_converted

    _, _, manifest = load_converted(directory)
    weights = SafetensorsFile(Path(directory) / manifest.weights)
    total = sum(stored_nbytes(weights, n, e) for n, e in manifest.tensors.items())
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify", file=sys.stderr,
              disable=not show_progress) as bar:
        for name, entry in manifest.tensors.items():
            check_tensor(weights, name, entry, bar.update)
    return len(manifest.tensors), total

