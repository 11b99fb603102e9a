"""Writing a pruned model: the experts model/reap.py chose, the router's rows with them.

Both kinds of model directory are pruned the same way, per layer i and kept ids kept[i] (ascending,
so the remaining experts keep their order):
    router [E, H] -> router[kept[i]],  experts [E, ...] -> experts[kept[i]],  num_experts -> keep
* a fermijit model: the Q4_0 `.qs`/`.d` bytes of the kept experts are copied as they are (no
  requantisation), written through model/convert.write_model; `fermijit.json` carries the REAP
  record (kept ids per layer, counts, saliencies, calibration source and token count).
* an HF checkpoint: every tensor copied in its own dtype, the fused `experts.*_proj` [E, ...]
  sliced, split `experts.{e}.*` renumbered 0..keep-1, one output file per input shard (and the
  index); the record goes to `reap.json` (config.json takes no unknown keys), which `convert`
  carries into the fermijit manifest.
The MTP head (`mtp.*`, MODEL.md §10), where the model has one, is pruned with its own row of
kept ids, kept[L] (its layer calibrated on the head's rows: model/reap.py), so that its router
and experts match num_experts as the layers' do; a lone `mtp.*` tensor that is no head is
dropped, and mtp_num_hidden_layers set to 0.
Experts are copied one at a time: memory stays at one expert's tensor (4 MiB in the real model).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np

from fermijit import FermijitError
from fermijit.model import convert
from fermijit.model.config import load_config
from fermijit.model.safetensors_io import (INDEX_NAME, Checkpoint, SafetensorsFile,
                                           SafetensorsWriter)
from fermijit.model.weights import MTP_LAYER, MTP_PREFIX

# Fields of a fermijit model whose first dimension is the expert: layers.{i}.mlp.<field>
EXPERT_FIELDS = ("gate", "experts_gate_up", "experts_down")


def pruned_config(config: dict, keep: int, has_mtp: bool) -> dict:
    """config.json with num_experts = keep (in text_config when composite), and no MTP head
    unless `has_mtp` (the head, pruned too, kept)."""
    config = json.loads(json.dumps(config))
    text = config.get("text_config", config)
    text["num_experts"] = keep
    if text.get("mtp_num_hidden_layers") and not has_mtp:
        text["mtp_num_hidden_layers"] = 0
    return config


def _check_kept(kept: np.ndarray, text, has_mtp: bool) -> np.ndarray:
    """`kept` as int64 [L (+1 for the MTP layer), keep], each row ascending ids of `text`'s
    (TextConfig) experts."""
    n_layers, n_experts = text.num_hidden_layers + has_mtp, text.num_experts
    kept = np.asarray(kept, dtype=np.int64)
    if (kept.ndim != 2 or kept.shape[0] != n_layers or kept.shape[1] < text.num_experts_per_tok
            or kept.min() < 0 or kept.max() >= n_experts
            or not (np.diff(kept, axis=1) > 0).all()):
        raise FermijitError(f"kept experts must be [{n_layers} layers, keep >= "
                            f"{text.num_experts_per_tok}] ascending ids in [0, {n_experts})")
    return kept


def prune_fermijit(src: str | Path, dst: str | Path, kept, record: dict,
                   show_progress: bool = False) -> "convert.Manifest":
    """Prune fermijit model `src` into `dst`; returns the manifest written."""
    src, dst = Path(src), Path(dst)
    cfg, _, manifest = convert.load_converted(src)
    text = cfg.text_config
    has_mtp = convert.has_mtp_head(text, manifest)
    kept = _check_kept(kept, text, has_mtp)
    lm_head = manifest.tensors["lm_head"].quant
    weights = SafetensorsFile(src / manifest.weights)
    shapes, rows = {}, {}          # rows: the kept ids of a tensor whose first axis is experts
    for name, entry in manifest.tensors.items():
        if name.startswith(MTP_PREFIX) and not has_mtp:
            continue                                # an unused head (config.json's 0): dropped
        if entry.quant != convert.quantisation(name, lm_head):
            raise FermijitError(f"{src}: {name} is {entry.quant}, this fermijit stores it as "
                                f"{convert.quantisation(name, lm_head)}; convert it again")
        shapes[name] = entry.shape
        layer, _, field = name.partition(".mlp.")
        if field in EXPERT_FIELDS:
            i = text.num_hidden_layers if name.startswith(MTP_PREFIX) else int(layer.split(".")[1])
            rows[name] = kept[i]
            shapes[name] = (rows[name].size,) + shapes[name][1:]

    def fill(name: str, out: SafetensorsWriter):
        for stored, _, _ in convert.stored_specs(name, manifest.tensors[name].shape,
                                                 manifest.tensors[name].quant):
            _copy_rows(out, stored, weights.raw(stored), rows.get(name))
        yield int(np.prod(shapes[name]))

    def other_files(out: Path) -> None:
        for file in convert.COPIED_FILES:
            if (src / file).is_file():
                shutil.copyfile(src / file, out / file)
        config = json.loads((src / "config.json").read_text(encoding="utf-8"))
        (out / "config.json").write_text(json.dumps(pruned_config(config, kept.shape[1],
                                                                  has_mtp), indent=2) + "\n")

    return convert.write_model(dst, shapes, lm_head, fill, manifest.source, other_files,
                               "prune", show_progress,
                               _record(record, src, kept, text.num_experts, manifest.reap))


def _record(record: dict, src: Path, kept: np.ndarray, n_experts: int, previous) -> dict:
    """The REAP record: `record` (criterion, calibration ...) plus the kept ids, where from and
    the record of `src` if it was pruned before (its ids number src's source's experts)."""
    return {**record, "n_experts": n_experts, "keep": int(kept.shape[1]), "kept": kept.tolist(),
            "pruned_from": str(src.resolve()), "previous": previous}


def _copy_rows(out: SafetensorsWriter, name: str, view: np.ndarray, ids) -> None:
    """Tensor `name` <- view (ids None), or view[ids] one leading row at a time."""
    if ids is None:
        out.write(name, view)
        return
    for j, e in enumerate(ids):
        out.write(name, view[e], start=j * view[e].size)


def _hf_expert_pattern(ckpt: Checkpoint) -> re.Pattern:
    """layer (a number, or the MTP layer's "mtp." prefix) | fused or router tensor | split
    expert id, rest of its name."""
    from fermijit.model.weights import text_prefix

    layer = rf"{re.escape(text_prefix(ckpt))}layers\.(\d+)\.|({re.escape(MTP_LAYER)})"
    return re.compile(rf"(?:{layer})mlp\.(?:(gate\.weight|experts\.gate_up_proj|"
                      rf"experts\.down_proj)|experts\.(\d+)\.(.+))$")


def prune_hf(src: str | Path, dst: str | Path, kept, record: dict) -> dict:
    """Prune HF checkpoint directory `src` into `dst` (a pruned HF checkpoint); returns the REAP
    record written beside it."""
    from fermijit.model.weights import has_mtp, plan_text_weights

    src, dst = Path(src), Path(dst)
    cfg = load_config(src)
    ckpt = Checkpoint(src)
    plan_text_weights(cfg.text_config, ckpt)       # a bad checkpoint fails before any write
    text = cfg.text_config
    with_mtp = has_mtp(text, ckpt)
    kept = _check_kept(kept, text, with_mtp)
    expert = _hf_expert_pattern(ckpt)
    copied = [path.name for path in sorted(src.iterdir())  # tokenizer, templates, licences ...
              if path.is_file() and not path.name.endswith(".safetensors") and path.name not in (
                  INDEX_NAME, "config.json", convert.REAP_RECORD, convert.MANIFEST)]
    # A full disk, a signal: shards of a whole size and header were left (their tail zeros),
    # and "Error: No space left on device"; now removed, as a fermijit model's writer does.
    return convert.write_directory(
        dst, "prune", lambda: _write_hf(src, dst, kept, record, cfg, ckpt, with_mtp, expert,
                                        copied),
        [f.path.name for f in ckpt.files] + [INDEX_NAME, convert.REAP_RECORD, "config.json",
                                              *copied])


def _write_hf(src: Path, dst: Path, kept, record: dict, cfg, ckpt, with_mtp: bool, expert,
              copied: list[str]) -> dict:
    text = cfg.text_config
    weight_map, total_nbytes = {}, 0
    for f in ckpt.files:
        plan = []                                   # (name out, name in, kept ids or None)
        for name in f.tensors:
            if name.startswith(MTP_PREFIX) and not with_mtp:
                continue
            m = expert.match(name)
            if m is None:
                plan.append((name, name, None))
                continue
            ids = kept[text.num_hidden_layers if m[2] else int(m[1])]
            if m[3] is not None:                    # router rows or fused experts
                plan.append((name, name, ids))
            elif int(m[4]) in ids:                  # split: renumbered in kept order
                j = int(np.searchsorted(ids, int(m[4])))
                plan.append((name[:m.start(4)] + f"{j}." + m[5], name, None))
        specs = []
        for out_name, name, ids in plan:
            info = f.tensors[name]
            shape = info.shape if ids is None else (ids.size,) + info.shape[1:]
            specs.append((out_name, info.dtype, shape))
            nbytes = info.end - info.begin
            total_nbytes += nbytes if ids is None else nbytes // info.shape[0] * ids.size
            weight_map[out_name] = f.path.name
        with SafetensorsWriter(dst / f.path.name, specs, f.metadata or {"format": "pt"}) as out:
            for out_name, name, ids in plan:
                _copy_rows(out, out_name, f.raw(name), ids)
    if (src / INDEX_NAME).is_file():
        (dst / INDEX_NAME).write_text(json.dumps(
            {"metadata": {"total_size": total_nbytes}, "weight_map": weight_map}, indent=2) + "\n")
    for name in copied:
        shutil.copyfile(src / name, dst / name)
    record = _record(record, src, kept, text.num_experts, convert.reap_record(src))
    (dst / convert.REAP_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    (dst / "config.json").write_text(json.dumps(pruned_config(config, kept.shape[1], with_mtp),
                                                indent=2) + "\n")
    return record


def _has_mtp(directory: Path) -> bool:
    """Whether a fermijit model or HF checkpoint directory holds an MTP head."""
    from fermijit.model.weights import has_mtp

    if convert.is_fermijit_model(directory):
        return convert.has_mtp_head(load_config(directory).text_config,
                                    convert.read_manifest(directory))
    return has_mtp(load_config(directory).text_config, Checkpoint(directory))


def run(src: Path, dst: Path, text_path: Path, keep: int | None, ratio: float | None,
        context: int | None, max_tokens: int | None, criterion: str, seed: int,
        calibrate_with: Path | None = None, err=None, prefill: str = "auto",
        gpu_mem: str | None = None, pin_budget: str | None = None,
        verbose: bool = False) -> dict:
    """`prune` for the CLI: calibrate on `text_path` with `calibrate_with` (default `src`: a
    fermijit model runs W4A8, an HF checkpoint fp32) through the `prefill` prefiller
    (cpu|gpu|auto, fermijit/prefill/hybrid.py: the GPU's activations are fp32), choose, write `dst`
    as `src`'s kind; progress and a summary to `err`. Returns the REAP record."""
    import sys

    from tqdm import tqdm

    from fermijit.evaluate import read_text
    from fermijit.model import reap
    from fermijit.model.forward import load_model
    from fermijit.model.tokenizer import Tokenizer
    from fermijit.prefill import hybrid

    err = err or sys.stderr
    if (keep is None) == (ratio is None):
        raise FermijitError("give one of --keep and --ratio")
    if criterion not in reap.CRITERIA:
        raise FermijitError(f"--criterion must be one of {', '.join(reap.CRITERIA)}")
    convert.check_output_dir(dst)
    text = load_config(src).text_config
    keep = (reap.keep_for_ratio(ratio, text.num_experts, text.num_experts_per_tok)
            if keep is None else keep)
    reap.check_keep(keep, text.num_experts, text.num_experts_per_tok)
    calibrate_with = calibrate_with or src
    cfg, model = load_model(calibrate_with, show_progress=True)
    if (len(model.layers), model.n_experts) != (text.num_hidden_layers, text.num_experts):
        raise FermijitError(f"{calibrate_with} has {len(model.layers)} layers of "
                            f"{model.n_experts} experts, {src} {text.num_hidden_layers} of "
                            f"{text.num_experts}")
    if _has_mtp(src) != (model.mtp is not None):
        raise FermijitError(f"{src} and {calibrate_with} differ in having an MTP head (its "
                            f"experts are pruned by its own calibration: give a calibration "
                            f"model that has one where the model does, or none)")
    context = reap.check_context(context, model.max_context)
    tokens = Tokenizer(calibrate_with, cfg.text_config.eos_token_id,
                       model.vocab_size).encode(read_text(text_path))
    n_tokens = reap.calibration_tokens(tokens.size, context, max_tokens)
    prefiller = hybrid.make(model, prefill, gpu_mem, pin_budget, verbose, err)
    if prefill != "cpu" and prefiller.prepare():
        print(f"calibrating through the GPU prefill ({prefill})", file=err)
    with tqdm(total=n_tokens, desc="calibrate", unit="tok", file=err) as bar:
        cal = reap.calibrate(model, tokens, context, str(text_path), max_tokens, bar.update,
                             prefiller)
    kept = reap.choose(cal.scores(criterion, seed), keep)
    record = {"criterion": criterion, **({"seed": seed} if criterion == "random" else {}),
              "calibration": {**cal.as_dict(), "model": str(Path(calibrate_with).resolve())},
              "counts": cal.counts.tolist(), "saliency": cal.saliency.tolist()}
    if convert.is_fermijit_model(src):
        record = prune_fermijit(src, dst, kept, record).reap
    else:
        record = prune_hf(src, dst, kept, record)
    print(f"wrote {dst}: {keep} of {text.num_experts} experts per layer kept by {criterion}, "
          f"calibrated on {cal.n_tokens} tokens of {text_path}", file=err)
    return record
