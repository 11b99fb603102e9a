"""HF checkpoint -> fermijit model directory (DESIGN.md, On-disk format), and its loader.

The output directory holds config.json (verbatim), the tokenizer and generation files, one
`model.safetensors` and `fermijit.json` (format version, quantisation per tensor, source
fingerprint, REAP record). Tensors are named by weight-field path (model/weights.py), e.g.
`layers.3.mlp.experts_gate_up`. A quantised tensor is two: `<name>.qs` and `<name>.d`, GGML block
layout, structure of arrays, with a layer's experts contiguous ([E, rows, ...]).

Quantised: the big matrices (Q4_0) and the lm_head (Q6_K by default, as llama.cpp's, Q8_0 where
its rows are not whole 256-blocks: it is the matrix most sensitive to error; model/quant_mix.py
head_kind); the MTP head (`mtp.*`, where the checkpoint has it: MODEL.md §10) is stored as
a decoder layer is, its fc [H, 2H] Q4_0. The embedding is fp16: exact for bf16 sources in the normal range, one row
is read per token so its size costs no speed, and its error would enter the residual stream
undiluted (in Q4_0, 8.6% RMS per row, it alone moved the tiny model's logits by 54% of their
max). Kept fp32: norms, conv taps, A_log, dt_bias, and the small matrices whose outputs are
decisions (router [E, H]) or decays (in_proj_a/b [Hv, H], shared_expert_gate [1, H]).

Memory: tensors stream through in row chunks of at most `chunk_bytes` of fp32, read from the
memory-mapped source and written in place into the preallocated output; no tensor is ever
whole in memory (a layer's experts are 2 GiB in fp32).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

import numpy as np

from fermijit import FermijitError, __version__
from fermijit.host import numa
from fermijit.model import vision
from fermijit.model.config import ModelConfig, load_config
from fermijit.model.files import member, read_json
from fermijit.model.manifest import (BLOCK, FORMAT_VERSION, MANIFEST, Manifest, Source,
                                     TensorEntry, check_at_load, check_finished, checksum,
                                     read_manifest, sample, stored_specs)
from fermijit.model.safetensors_io import (FERMIJIT_FORMAT, INDEX_NAME, Checkpoint,
                                           SafetensorsFile, SafetensorsWriter)
from fermijit.model.state import available_nbytes
from fermijit.model.weights import (MTP_PREFIX, BlockTensor, QuantTensor, TextWeights, assemble,
                                    plan_text_weights, text_weight_shapes)

WEIGHTS = "model.safetensors"
PARTIAL_SUFFIX = ".partial"
REAP_RECORD = "reap.json"  # beside a pruned HF checkpoint: its config.json takes no extra keys
COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
                "video_preprocessor_config.json",
                # licence files travel with the weights they cover
                "LICENSE", "LICENSE.txt", "NOTICE.txt", "copyright")
# Weight fields stored as Q4_0 (the last component of the field path).
Q4_0_FIELDS = frozenset({"in_proj_qkv", "in_proj_z", "out_proj", "q_proj",
                         "k_proj", "v_proj", "o_proj", "experts_gate_up", "experts_down",
                         "shared_gate_up", "shared_down", "fc"})  # fc: the MTP head's [H, 2H]
LM_HEAD_CHOICES = ("q8_0", "q6_k", "q4_0")
MTP_FC = MTP_PREFIX + "fc"  # in a manifest: the model has its MTP head (older ones dropped it)
CHUNK_BYTES = 64 << 20  # fp32 bytes per streamed piece: ~3x this is the converter's working set


def quantisation(name: str, lm_head: str) -> str:
    """"q4_0", "q8_0", "f16" or "f32" for a weight field path."""
    if name == "lm_head":
        return lm_head
    if name == "embed_tokens":
        return "f16"
    if name.startswith("visual."):  # the vision tower: matrices f16, norms and biases f32
        return "f32" if name.endswith("bias") or ".norm" in name else "f16"
    return "q4_0" if name.rsplit(".", 1)[-1] in Q4_0_FIELDS else "f32"


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


def convert(src: str | Path, dst: str | Path, lm_head: str | None = None,
            show_progress: bool = True, chunk_bytes: int = CHUNK_BYTES,
            mix: str = "q4_0") -> Manifest:
    """Convert an HF checkpoint directory, or a GGUF file (model/gguf_convert.py); returns the
    manifest written to `dst/fermijit.json`. `mix` (an HF checkpoint's): the quantisation mix,
    model/quant_mix.py; `lm_head` replaces its LM head's kind (default: the mix's, Q6_K where its
    rows are whole 256-blocks, else Q8_0). On any failure, SIGTERM included, what was written is removed (a `.partial` file held
    the space of the model)."""
    from fermijit.model import quant_mix

    src, dst = Path(src), Path(dst)
    if lm_head is not None and lm_head not in LM_HEAD_CHOICES:
        raise FermijitError(f"--lm-head must be one of {', '.join(LM_HEAD_CHOICES)}")
    if mix not in quant_mix.MIXES:
        raise FermijitError(f"--quant must be one of {', '.join(quant_mix.MIXES)}, got {mix!r}")
    if src.is_file():
        from fermijit.model import gguf_convert

        if mix != "q4_0":
            raise FermijitError(f"--quant {mix}: a GGUF file is imported in the kinds it holds "
                                f"(its K-quants bit for bit); --quant is for HF checkpoints")
        return gguf_convert.convert(src, dst, lm_head or "q8_0", show_progress, chunk_bytes)
    if not src.is_dir():
        raise FermijitError(f"no such model directory or GGUF file: {src}")
    if is_fermijit_model(src):  # else read as an HF checkpoint: "missing tensor model..."
        raise FermijitError(f"{src} is a fermijit model already ({MANIFEST}): nothing to "
                            f"convert")
    cfg = load_config(src)
    ckpt = Checkpoint(src)
    plans = plan_text_weights(cfg.text_config, ckpt)  # every tensor checked before any write
    plans.update(vision.plan_weights(cfg, ckpt))     # the tower's, when the checkpoint has one
    _check_tokenizer(src)
    quants = mix_quants(cfg.text_config, {name: plan.shape for name, plan in plans.items()},
                        mix, lm_head)

    def copy_files(out: Path) -> None:
        for file in COPIED_FILES:
            if (src / file).is_file():
                shutil.copyfile(src / file, out / file)

    source = Source(path=str(src.resolve()), fingerprint=source_fingerprint(src, ckpt),
                    files=tuple(f.path.name for f in ckpt.files))
    return write_model(
        dst, {name: plan.shape for name, plan in plans.items()}, quants["lm_head"],
        lambda name, out: stream(name, plans[name].shape, quants[name],
                                 lambda lead, rows: plans[name].read(ckpt, lead, rows), out,
                                 chunk_bytes),
        source, other_files=copy_files, desc="convert", show_progress=show_progress,
        reap=reap_record(src), quants=quants, mix=mix)


def mix_quants(t, shapes: dict[str, tuple[int, ...]], mix: str,
               lm_head: str | None = None) -> dict[str, str]:
    """Every field's kind in quantisation mix `mix` (model/quant_mix.py) for a model of text
    config `t`; `lm_head`, if given, replaces the LM head's."""
    from fermijit.model import quant_mix

    base = {name: quantisation(name, "q8_0") for name in shapes}
    quants = quant_mix.quants(mix, shapes, base, t.num_hidden_layers, t.num_experts,
                              t.tie_word_embeddings)
    if lm_head is not None:
        quants["lm_head"] = lm_head
    return quants


def reap_record(src: Path) -> dict | None:
    """The REAP record of an HF checkpoint pruned by fermijit (its REAP_RECORD file), else None."""
    path = src / REAP_RECORD
    if not path.is_file():
        return None
    return read_json(path)


def check_output_dir(dst: Path, claimed_here: bool = False) -> None:
    """A model is written into a new or empty directory only. `claimed_here`: this process
    holds the directory's claim (`_claim`), so a .partial in it is a dead writer's."""
    try:
        if dst.exists() and not dst.is_dir():
            raise FermijitError(f"output directory {dst} is a file")
        leftovers = sorted(p.name for p in dst.iterdir()) if dst.exists() else []
    except OSError as e:  # under a regular file, or unreadable
        raise FermijitError(f"output directory {dst}: {e.strerror}") from None
    if leftovers:
        partial = [n for n in leftovers if n.endswith(PARTIAL_SUFFIX)]
        if partial and not claimed_here and _claimed_elsewhere(dst):
            raise _busy(dst)
        hint = (f" (it holds {', '.join(partial)}, left by a convert that was killed: remove "
                f"the directory)" if partial else "")
        raise FermijitError(f"output directory {dst} exists and is not empty{hint}")


# Two writers of one output directory at once (two `convert`s, a convert and a prune) shared
# model.safetensors.partial: the first to finish renamed it while the other still wrote into it,
# the other's rename then failed and its cleanup removed the first one's finished model; a
# second writer was also told the first's .partial was "left by a convert that was killed". A
# writer holds an exclusive flock on the directory (released when it exits, however it exits).
def _busy(dst: Path) -> FermijitError:
    return FermijitError(f"output directory {dst} is being written by another process")


def _claim(dst: Path) -> int | None:
    """The directory `dst` opened and flock'ed exclusively (the descriptor to close when done),
    None where it cannot be locked (a filesystem without flock); a FermijitError if another
    process holds it."""
    try:
        fd = os.open(dst, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise _busy(dst) from None
    except OSError:
        os.close(fd)
        return None
    return fd


def _claimed_elsewhere(dst: Path) -> bool:
    try:
        fd = _claim(dst)
    except FermijitError:
        return True
    if fd is not None:
        os.close(fd)
    return False


def write_model(dst: Path, shapes: dict[str, tuple[int, ...]], lm_head: str, fill,
                source: Source, other_files, desc: str, show_progress: bool = True,
                reap: dict | None = None, quants: dict[str, str] | None = None,
                checksums: dict[str, str] | None = None, mix: str | None = None) -> Manifest:
    """The one writer of a model directory (`convert`, `model/synth.py`, `model/prune.py`,
    model/gguf_convert.py): the weights file, in which `fill(name, writer)` stores tensor `name`
    (quantised as `quantisation` says, or as `quants` does: a GGUF's imported blocks keep their
    kind), yielding the elements done per piece; then `other_files(dst)` (config, tokenizer...);
    the manifest last, with `reap` (the REAP record of a pruned model), as it marks the directory
    complete; `checksums`, if the writer hashed what it wrote (write_manifest). Returns the
    manifest. On any failure, SIGTERM included, what was written is removed."""
    return write_directory(
        dst, desc, lambda: _write_into(Path(dst), shapes, lm_head, fill, source, other_files,
                                       desc, show_progress, reap, quants, checksums, mix),
        (WEIGHTS + PARTIAL_SUFFIX, WEIGHTS, MANIFEST + PARTIAL_SUFFIX, MANIFEST, *COPIED_FILES))


def write_directory(dst: Path, desc: str, write, names):
    """write() into the model directory `dst`, new or empty (checked), claimed against other
    writers (`_claim`), with SIGTERM and SIGHUP raising: its result. On any failure the files
    `names` (all it may write) are removed, and `dst` if made here; an OSError is one line
    (`write_failure`). The skeleton of every writer of a model directory (write_model, and
    model/prune.py's of a pruned HF checkpoint)."""
    dst = Path(dst)
    check_output_dir(dst)
    made_dir = not dst.exists()
    try:
        dst.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FermijitError(f"cannot create the output directory {dst}: {e.strerror}") from None
    claim = _claim(dst)  # another writer at work: said, and nothing of its touched
    try:
        check_output_dir(dst, claimed_here=True)  # again: one may have finished meanwhile
        try:
            with terminate_as_exception(desc):
                return write()
        except BaseException as e:
            failure = write_failure(desc, e, dst) if isinstance(e, OSError) else None
            for name in names:
                with contextlib.suppress(OSError):
                    (dst / name).unlink()
            if made_dir:
                with contextlib.suppress(OSError):
                    dst.rmdir()
            if failure is not None:
                raise failure from None
            raise
    finally:
        if claim is not None:
            os.close(claim)


def write_failure(desc: str, e: OSError, dst: Path) -> FermijitError:
    """The one line for an OSError while `desc` wrote `dst`, a model directory or a file (all it
    wrote then removed); called before the removal, while a full disk is still full. The file
    named is the one written:
    shutil.copyfile's error names its source (a file of the model read, not the one that
    failed). numpy's tofile (the gguf package's writes) says only "N requested and M written",
    without an errno: a short write on a disk with no room left is said to be the full disk."""
    is_dir = dst.is_dir()
    reason = e.strerror
    if reason is None:
        reason = str(e)
        with contextlib.suppress(OSError):
            if shutil.disk_usage(dst if is_dir else dst.parent).free < 1 << 20:
                reason = f"No space left on device ({e})"
    where = f" {e.filename}" if e.filename and str(dst) in str(e.filename) else ""
    left = f"nothing was left in {dst}" if is_dir else f"nothing was written to {dst}"
    return FermijitError(f"{desc} failed writing{where}: {reason}; {left}")


def _write_into(dst: Path, shapes: dict[str, tuple[int, ...]], lm_head: str, fill,
                source: Source, other_files, desc: str, show_progress: bool,
                reap: dict | None, quants: dict[str, str] | None,
                checksums: dict[str, str] | None, mix: str | None) -> Manifest:
    from tqdm import tqdm

    quants = quants or {name: quantisation(name, lm_head) for name in shapes}
    specs = {name: stored_specs(name, shape, quants[name]) for name, shape in shapes.items()}
    # .qs first (and GGUF blocks of a 16-byte multiple, Q4_K's 144): each is a multiple of 16
    # bytes, so every one starts 16-byte aligned; then the other 4-byte-multiple tensors (F32),
    # so the F32 ones stay 4-byte aligned; the odd-sized blocks (Q6_K's 210, Q5_0's 22) last.
    # A layer's matrices that read one input stay back to back (decode reads them as one:
    # model/forward.py).
    def place(spec) -> int:
        stored, dtype, shape = spec
        if stored.endswith(".blocks"):
            return 0 if int(np.prod(shape)) % 16 == 0 else 3
        return 0 if stored.endswith(".qs") else 1 if dtype == "F32" else 2

    flat = [s for name in shapes for s in specs[name]]
    order = sorted(flat, key=place)
    partial = dst / (WEIGHTS + PARTIAL_SUFFIX)
    total = sum(int(np.prod(shape)) for shape in shapes.values())
    with SafetensorsWriter(partial, order, {"format": FERMIJIT_FORMAT}) as out, \
            tqdm(total=total, unit="param", unit_scale=True, desc=desc, file=sys.stderr,
                 disable=not show_progress) as bar:
        for name in shapes:
            for n_done in fill(name, out):
                bar.update(n_done)
    os.replace(partial, dst / WEIGHTS)
    other_files(dst)
    return write_manifest(dst, {name: (shape, quants[name]) for name, shape in shapes.items()},
                          source, reap, checksums=checksums, mix=mix)


def write_manifest(directory: str | Path, tensors: dict[str, tuple[tuple[int, ...], str]],
                   source: Source, reap: dict | None = None, weights: str = WEIGHTS,
                   checksums: dict[str, str] | None = None, mix: str | None = None) -> Manifest:
    """Write `directory/fermijit.json` for the weights file `weights` already there: every writer
    of fermijit models (convert, REAP, GGUF import, synthetic models) calls this, so the format
    lives in one place. `tensors` maps each weight field path, in file order, to (shape, quant);
    their stored tensors (model/manifest.py `stored_specs`) must be in the file. The checksums are
    of the bytes on disk, read back (what a later `verify` compares), unless the writer hashed
    the bytes it wrote (`checksums`, sha256 per entry as `checksum` orders them: synth, whose
    256-expert file outgrows the page cache, so reading it back was 20.6 GB read from storage).
    Written last, by rename: a directory with a fermijit.json is complete."""
    directory = Path(directory)
    weights_file = SafetensorsFile(member(directory, weights, "write_manifest: weights"))
    entries = {}
    for name, (shape, quant) in tensors.items():
        shape = tuple(int(n) for n in shape)
        for stored, dtype, stored_shape in stored_specs(name, shape, quant):
            info = weights_file.tensors.get(stored)
            if info is None or (info.dtype, info.shape) != (dtype, stored_shape):
                raise FermijitError(f"{weights_file.path}: no {dtype} {list(stored_shape)} "
                                    f"tensor {stored} for the manifest")
        entry = TensorEntry(shape, quant, "")
        digest = checksums[name] if checksums else checksum(weights_file, name, entry)
        entries[name] = dataclasses.replace(entry, checksum=digest,
                                            sample=sample(weights_file, name, entry))
    manifest = Manifest(FORMAT_VERSION, f"fermijit {__version__}", source, weights, entries, reap,
                        mix)
    partial = directory / (MANIFEST + PARTIAL_SUFFIX)
    partial.write_text(json.dumps(manifest.as_json(), indent=1) + "\n")
    os.replace(partial, directory / MANIFEST)
    return manifest


def describe(manifest: Manifest) -> str:
    """One line for the CLI: what was written."""
    kinds = [t.quant for t in manifest.tensors.values()]
    order = ("q4_0", "q8_0", "f16", "f32") + tuple(sorted(set(kinds) - {"q4_0", "q8_0", "f16",
                                                                        "f32"}))
    counts = ", ".join(f"{kinds.count(k)} {k}" for k in order if k in kinds)
    mix = f"mix {manifest.mix}, " if manifest.mix else ""
    return (f"{mix}{len(kinds)} tensors ({counts}), lm_head "
            f"{manifest.tensors['lm_head'].quant}")


def _check_tokenizer(src: Path) -> None:
    """A tokenizer that does not load fails here, not at the first `generate`; a missing one is
    said on stderr (the weights alone still convert)."""
    path = src / "tokenizer.json"
    if not path.exists():
        print(f"warning: {src} has no tokenizer.json; generate and eval need one beside the "
              f"converted weights", file=sys.stderr)
        return
    from fermijit.model.tokenizer import Tokenizer

    Tokenizer(src)  # tokenizer.json, tokenizer_config.json, generation_config.json


class Terminated(FermijitError):
    """SIGTERM during a convert or an export, raised so that its cleanup runs."""


@contextlib.contextmanager
def terminate_as_exception(what: str = "convert"):
    """SIGTERM or SIGHUP inside the block raises Terminated, so that a writer's cleanup runs.
    SIGHUP (the terminal or ssh session closed) killed a `synth` outright and left its 2.3 GB
    model.safetensors.partial behind. A signal someone else owns (a test runner, an embedding
    program, `nohup`'s ignored SIGHUP) is left as it is."""
    signums = [s for s in (signal.SIGTERM, signal.SIGHUP)
               if signal.getsignal(s) is signal.SIG_DFL]

    def handler(signum, frame):
        raise Terminated(f"{what}: terminated ({signal.Signals(signum).name})")

    try:
        for signum in signums:
            signal.signal(signum, handler)
    except ValueError:  # not the main thread: no handler, and no cleanup on a signal
        signums = []
    try:
        yield
    finally:
        for signum in signums:
            signal.signal(signum, signal.SIG_DFL)


def stream(name: str, shape: tuple[int, ...], quant: str, read, out: SafetensorsWriter,
           chunk_bytes: int):
    """Read, quantise and write one tensor in row chunks; `read(lead, rows)` gives fp32 rows
    [n, cols] (or [n]) of expert `lead` (None for 1-D and 2-D tensors). Yields the elements
    done per chunk."""
    from fermijit.ops import kquant, kquant_quantize
    from fermijit.ops import quant as q

    rows, cols = (shape[-2], shape[-1]) if len(shape) >= 2 else (shape[0], 1)
    leads = range(shape[0]) if len(shape) == 3 else [None]
    step = max(1, chunk_bytes // (4 * cols))
    for e, lead in enumerate(leads):
        for r0 in range(0, rows, step):
            x = read(lead, slice(r0, r0 + step))        # fp32 [n, cols] (or [n])
            if not np.isfinite(x).all():  # issue 11: NaN weights ran to exit 0, garbage out
                raise FermijitError(f"{name} holds NaN or infinite values; refusing to convert "
                                    f"it")
            first_row = e * rows + r0
            if quant == "f32":
                out.write(name, x, start=first_row * cols)
            elif quant == "f16":
                if np.abs(x).max(initial=0) > np.finfo(np.float16).max:
                    raise FermijitError(f"{name}: values beyond the fp16 range")
                out.write(name, x.astype(np.float16), start=first_row * cols)
            elif quant in kquant.FORMATS:  # a mix's K-quant or 5-bit kind (model/quant_mix.py)
                blocks = kquant_quantize.quantize_cpu(kquant.FORMATS[quant], x)
                if not np.isfinite(kquant.scales_f16(kquant.FORMATS[quant], blocks)).all():
                    raise FermijitError(f"{name}: block scales beyond the fp16 range")
                out.write(name + ".blocks", blocks, start=first_row * blocks.shape[-1])
            else:
                qs, d = q.quantize_q4_0_cpu(x) if quant == "q4_0" else q.quantize_q8_0(x)
                if not np.isfinite(d).all():
                    raise FermijitError(f"{name}: block scales beyond the fp16 range")
                out.write(name + ".qs", qs, start=first_row * qs.shape[-1])
                out.write(name + ".d", d, start=first_row * d.shape[-1])
            yield x.size


def is_fermijit_model(directory: str | Path) -> bool:
    return (Path(directory) / MANIFEST).exists()


def has_mtp_head(text, manifest: Manifest) -> bool:
    """Whether a fermijit model runs its MTP head: stored (MTP_FC), and config.json's
    mtp_num_hidden_layers (`text`, TextConfig) is 1; 0 leaves a stored head unused, as an HF
    checkpoint's (model/weights.py has_mtp)."""
    return MTP_FC in manifest.tensors and text.mtp_num_hidden_layers == 1


# Weights are faulted in at load (SafetensorsFile.populate) when they take at most this share of
# the memory the process can get; a larger file (the 19.7 GB 256-expert model on a 24 GiB machine)
# would have its first pages evicted while its last are read, so it is left to fault on use.
POPULATE_SHARE = 0.8


def tiled_input_order(t) -> np.ndarray:
    """The input columns of a GDN out_proj kept in llama.cpp's tiled value-head order: column j
    of its blocks multiplies input (grouped order) in_perm[j] (model/gguf_io.py
    grouped_from_tiled: grouped head i is tiled head perm[i])."""
    from fermijit.model.gguf_io import grouped_from_tiled

    perm = grouped_from_tiled(t.linear_num_key_heads, t.linear_num_value_heads,
                              t.linear_value_head_dim)
    return np.argsort(perm).astype(np.int64)


def load_converted(directory: str | Path) -> tuple[ModelConfig, TextWeights, Manifest]:
    """A converted model: (config, weights as memmap views, manifest). Nothing is copied. The
    manifest is checked against config.json and the weights file's header, and the smallest
    tensors against their checksums (`verify` checks them all)."""
    cfg, arrays, manifest = converted_arrays(directory)
    return cfg, assemble(cfg.text_config, arrays), manifest


def converted_arrays(directory: str | Path) -> tuple[ModelConfig, dict, Manifest]:
    """`load_converted`'s checks, and every tensor by its field name (an array, or a
    QuantTensor), as memmap views (model/gguf_export.py reads them so)."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.exists():
        check_finished(directory)
        raise FermijitError(f"{directory}: not a fermijit model (no {MANIFEST}; convert it first)")
    manifest = read_manifest(directory)
    cfg = load_config(directory)
    with_mtp = has_mtp_head(cfg.text_config, manifest)
    unused = () if with_mtp else (MTP_PREFIX,)  # a stored head config.json turns off
    expected = text_weight_shapes(cfg.text_config, mtp=with_mtp)
    for name, shape in expected.items():
        if name not in manifest.tensors:
            raise FermijitError(f"{path}: missing tensor {name}")
        if manifest.tensors[name].shape != shape:
            raise FermijitError(f"{path}: tensor {name} has shape "
                                f"{list(manifest.tensors[name].shape)}, config.json implies "
                                f"{list(shape)}")
    # The tower's are model/multimodal.py's to load; an unused head's are left as they are.
    extra = sorted(n for n in set(manifest.tensors) - set(expected)
                   if not n.startswith(("visual.", *unused)))
    if extra:
        raise FermijitError(f"{path}: tensor {extra[0]} is not in a model of this config.json")
    weights_file = SafetensorsFile(directory / manifest.weights)
    numa.apply([weights_file.mapped()])  # --numa: where the weights' pages go (before any is)
    if weights_file.data_nbytes <= POPULATE_SHARE * available_nbytes():
        weights_file.populate(background=True)  # serve's: after its warm-up (populate_after)
    arrays = {}
    for name, entry in manifest.tensors.items():
        if name.startswith(unused):
            continue
        for stored, dtype, shape in stored_specs(name, entry.shape, entry.quant):
            info = weights_file.tensors.get(stored)
            if info is None:
                raise FermijitError(f"{weights_file.path}: missing tensor {stored}")
            if info.dtype != dtype or info.shape != shape:
                raise FermijitError(f"{weights_file.path}: tensor {stored} is {info.dtype} "
                                    f"{list(info.shape)}, expected {dtype} {list(shape)}")
        if entry.quant in ("f32", "f16"):
            arrays[name] = weights_file.raw(name)
        elif stored_specs(name, entry.shape, entry.quant)[0][0].endswith(".blocks"):
            in_perm = (tiled_input_order(cfg.text_config)
                       if name in manifest.source.tiled_inputs else None)
            arrays[name] = BlockTensor(entry.quant, weights_file.raw(name + ".blocks"), in_perm)
        else:
            arrays[name] = QuantTensor(entry.quant, weights_file.raw(name + ".qs"),
                                       weights_file.raw(name + ".d"))
    pending = getattr(_checks, "pending", None)
    if pending is None:
        check_at_load(weights_file, manifest)
    else:
        pending.append(_CheckThread(weights_file, manifest))
    return cfg, arrays, manifest


# `checks_beside`: where the calling thread's loads put their checks (a list), or None.
_checks = threading.local()


class _CheckThread(threading.Thread):
    """check_at_load on a thread of its own; `error` what it raised."""

    def __init__(self, weights_file, manifest):
        super().__init__(name="fermijit-load-check", daemon=True)
        self.args_, self.error = (weights_file, manifest), None
        self.start()

    def run(self) -> None:
        try:
            check_at_load(*self.args_)
        except BaseException as e:  # noqa: BLE001 - raised by `checks_beside`
            self.error = e


@contextlib.contextmanager
def checks_beside():
    """Inside the block, the checks of the models this thread loads (check_at_load: the smallest
    tensors' checksums, the others' samples; 0.13-0.25 s of a full-size load on 2 cores) run on
    threads of their own, beside what follows the load (its gathers and hashes release the GIL);
    leaving the block waits for them and raises what they found, so a damaged model still fails
    before the block's work is used (serve: before it says ready; issue 28 item 4)."""
    before, pending = getattr(_checks, "pending", None), []
    _checks.pending = pending
    try:
        yield
    finally:
        _checks.pending = before
        for thread in pending:
            thread.join()
    for thread in pending:
        if thread.error is not None:
            raise thread.error


def add_mtp_head(src: str | Path, head: str | Path, dst: str | Path,
                 show_progress: bool = False) -> Manifest:
    """A copy of fermijit model `src` into `dst` with the MTP head (MODEL.md §10) read from the
    HF-named `mtp.*` tensors of checkpoint directory `head` (training/train.py `train_mtp`
    writes one), quantised as `convert` stores a head; the model's own tensors are copied as
    stored, its other files too, config.json with mtp_num_hidden_layers 1."""
    from fermijit.model.weights import plan_mtp_weights

    src, dst = Path(src), Path(dst)
    cfg, _, manifest = load_converted(src)
    if MTP_FC in manifest.tensors:
        raise FermijitError(f"{src} has an MTP head already")
    config = read_json(src / "config.json")
    text = config.get("text_config", config)
    text["mtp_num_hidden_layers"] = 1
    head_cfg = dataclasses.replace(cfg.text_config, mtp_num_hidden_layers=1)
    ckpt = Checkpoint(head)
    plans = plan_mtp_weights(head_cfg, ckpt)
    lm_head = manifest.tensors["lm_head"].quant
    weights = SafetensorsFile(src / manifest.weights)
    shapes = {name: entry.shape for name, entry in manifest.tensors.items()}
    shapes.update({name: plan.shape for name, plan in plans.items()})
    quants = {name: entry.quant for name, entry in manifest.tensors.items()}
    quants.update({name: quantisation(name, lm_head) for name in plans})

    def fill(name: str, out):
        if name in plans:
            yield from stream(name, plans[name].shape, quants[name],
                              lambda lead, rows: plans[name].read(ckpt, lead, rows),
                              out, CHUNK_BYTES)
            return
        for stored, _, _ in stored_specs(name, shapes[name], quants[name]):
            out.write(stored, weights.raw(stored))
        yield int(np.prod(shapes[name]))

    def other_files(out: Path) -> None:
        for path in sorted(src.iterdir()):
            if path.is_file() and path.name not in (WEIGHTS, MANIFEST, "config.json"):
                shutil.copyfile(path, out / path.name)
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    return write_model(dst, shapes, lm_head, fill, manifest.source, other_files, "add mtp",
                       show_progress, manifest.reap, quants)
