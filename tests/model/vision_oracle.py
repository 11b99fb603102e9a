"""transformers as the oracle of images (MODEL.md §7): the image processor, the vision tower, the
MRoPE positions and the logits of prompts with images, on tiny.VISION, live and stored.

The images are made here from seeds (several sizes and aspect ratios, RGB and RGBA, one below
min_pixels and one above max_pixels); the prompts are token ids around one and two images. The
golden file stores transformers' outputs so that the default run needs no torch. Regenerate with
    .venv/bin/python -m tests.model.vision_oracle
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from tests.model import oracle, tiny

MODEL = tiny.VISION
GOLDEN = oracle.GOLDEN_DIR / "tiny_vision_oracle.npz"
REGENERATE = ".venv/bin/python -m tests.model.vision_oracle"
GOLDEN_FORMAT = 1
# The tiny tower's processor: patch 4 and merge 2 (a multiple of 8 per side), 16² to 64² pixels,
# CLIP's mean and std (per-channel, so a channel mix-up shows).
PREPROCESSOR = {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2,
                "size": {"shortest_edge": 256, "longest_edge": 4096},
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711]}
# (height, width, mode): landscape, wide, tall, below min_pixels (scaled up), above max_pixels
# (scaled down), RGBA (composited onto white).
IMAGES = ((37, 53, "RGB"), (24, 64, "RGB"), (100, 40, "RGB"), (9, 12, "RGB"), (120, 90, "RGB"),
          (30, 30, "RGBA"))
# Prompts: token ids with "I<k>" where image k's placeholders go (vision_start, pads, vision_end).
PROMPTS = {"one": [5, 17, 200, "I0", 9, 100, 250, 7],
           "two": [4, "I1", 33, 64, "I4", 1, 300, 42, 64, 3],
           "three": ["I2", "I3", "I5", 77, 128]}
N_DECODE = 6
# Prompt rows whose logits are stored: the last text token before and after each image, and the
# last (all rows would make a file of ~0.2 MB for nothing more).
N_LAST_ROWS = 3


def images():
    """The test images as PIL images, from seeds."""
    from PIL import Image as PILImage

    out = []
    for k, (h, w, mode) in enumerate(IMAGES):
        rng = np.random.default_rng(100 + k)
        pixels = rng.integers(0, 256, (h, w, len(mode)), dtype=np.uint8)
        # a gradient under the noise: smooth content as well (at most 127 + 120)
        pixels[..., :3] = pixels[..., :3] // 2 + np.linspace(0, 120, w, dtype=np.uint8)[:, None]
        out.append(PILImage.fromarray(pixels, mode))
    return out


def write_model(directory: Path) -> Path:
    """The tiny VLM checkpoint with its preprocessor_config.json."""
    tiny.write_checkpoint(directory, model=MODEL)
    (directory / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    return directory


def converted_model(root: Path, max_pixels: int | None = None) -> Path:
    """The tiny VLM converted (4-bit) into root/q4 (its checkpoint in root/hf); `max_pixels`
    replaces its processor's upper bound (the real model's is 16777216)."""
    from fermijit.model import convert

    q4 = root / "q4"
    convert.convert(write_model(root / "hf"), q4, show_progress=False)
    if max_pixels is not None:
        (q4 / "preprocessor_config.json").write_text(json.dumps(
            {**PREPROCESSOR, "size": {**PREPROCESSOR["size"], "longest_edge": max_pixels}}))
    return q4


def prompt_ids(name: str, n_tokens: list[int], cfg) -> tuple[np.ndarray, list[int]]:
    """(ids, image indices in order) of PROMPTS[name], image k taking n_tokens[k] pads."""
    ids, order = [], []
    for item in PROMPTS[name]:
        if isinstance(item, str):
            k = int(item[1:])
            order.append(k)
            ids += ([cfg.vision_start_token_id] + [cfg.image_token_id] * n_tokens[k]
                    + [cfg.vision_end_token_id])
        else:
            ids.append(item)
    return np.array(ids, np.int64), order


def stored_rows(ids: np.ndarray, image_token_id: int) -> np.ndarray:
    is_image = ids == image_token_id
    edges = np.nonzero(is_image[1:] != is_image[:-1])[0]      # last row before a change
    rows = np.concatenate([edges, edges + 1, np.arange(ids.size - N_LAST_ROWS, ids.size)])
    rows = rows[(rows >= 0) & ~is_image[np.clip(rows, 0, ids.size - 1)]]
    return np.unique(rows)


@dataclasses.dataclass
class Outputs:
    pixel_values: list[np.ndarray]   # per image [N, 96]
    grids: np.ndarray                # [n_images, 3]
    embeds: list[np.ndarray]         # per image [n_tokens, H], the tower's merged output
    prompts: dict                    # name -> dict(ids, positions, rope_delta, rows, logits,
                                     #                 tokens, decode_logits)


def live(directory: Path) -> Outputs:
    """transformers' processor, tower, positions and logits (fp32, eager); needs torch."""
    import torch
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    from fermijit.model.config import load_config

    cfg = load_config(directory)
    proc = Qwen2VLImageProcessorPil(**{k: v for k, v in PREPROCESSOR.items()})
    pixel_values, grids = [], []
    for im in images():
        out = proc(images=[im], return_tensors="np")
        pixel_values.append(out["pixel_values"].astype(np.float32))
        grids.append(out["image_grid_thw"][0])
    grids = np.array(grids, np.int64)
    model = oracle.hf_model(directory)
    embeds = []
    with torch.no_grad():
        for pv, g in zip(pixel_values, grids):
            feats = model.model.get_image_features(torch.tensor(pv), torch.tensor(g[None]))
            embeds.append(feats.pooler_output[0].numpy())
    n_tokens = [e.shape[0] for e in embeds]
    prompts = {}
    for name in PROMPTS:
        ids, order = prompt_ids(name, n_tokens, cfg)
        tt = torch.tensor(ids[None])
        mm_types = (tt == cfg.image_token_id).int()
        g = torch.tensor(grids[order])
        with torch.no_grad():
            positions, delta = model.model.get_rope_index(tt, mm_types, g)
            out = model(input_ids=tt, pixel_values=torch.tensor(np.concatenate(
                [pixel_values[k] for k in order])), image_grid_thw=g, mm_token_type_ids=mm_types,
                use_cache=True)
            logits = out.logits[0].numpy()
            tokens, decode_logits = [], []
            token = int(logits[-1].argmax())
            for _ in range(N_DECODE):
                tokens.append(token)
                out = model(input_ids=torch.tensor([[token]]), cache=out.cache, use_cache=True)
                decode_logits.append(out.logits[0, -1].numpy())
                token = int(decode_logits[-1].argmax())
        rows = stored_rows(ids, cfg.image_token_id)
        prompts[name] = dict(ids=ids, positions=positions[:, 0].numpy(), rope_delta=int(delta),
                             rows=rows, logits=logits[rows], tokens=np.array(tokens),
                             decode_logits=np.stack(decode_logits))
    return Outputs(pixel_values, grids, embeds, prompts)


def golden() -> Outputs:
    g = np.load(GOLDEN)
    assert int(g["format_version"]) == GOLDEN_FORMAT, f"old golden format; run {REGENERATE}"
    assert str(g["fingerprint"]) == oracle.fingerprint(MODEL), \
        f"tests/model/tiny.py changed the vision model; run {REGENERATE}"
    assert json.loads(str(g["cases"])) == [list(c) for c in IMAGES], f"run {REGENERATE}"
    n = len(IMAGES)
    prompts = {name: {k: g[f"{name}.{k}"] for k in ("ids", "positions", "rope_delta", "rows",
                                                    "logits", "tokens", "decode_logits")}
               for name in PROMPTS}
    for name, p in prompts.items():
        p["rope_delta"] = int(p["rope_delta"])
    return Outputs([g[f"pixel_values.{k}"] for k in range(n)], g["grids"],
                   [g[f"embeds.{k}"] for k in range(n)], prompts)


def write_golden(directory: Path) -> None:
    import torch
    import transformers

    out = live(write_model(directory))
    arrays = {f"pixel_values.{k}": v for k, v in enumerate(out.pixel_values)}
    arrays.update({f"embeds.{k}": v.astype(np.float32) for k, v in enumerate(out.embeds)})
    for name, p in out.prompts.items():
        arrays.update({f"{name}.{k}": (v.astype(np.float32) if "logits" in k else v)
                       for k, v in p.items()})
    np.savez_compressed(
        GOLDEN, format_version=GOLDEN_FORMAT, command=REGENERATE,
        fingerprint=oracle.fingerprint(MODEL), cases=json.dumps([list(c) for c in IMAGES]),
        versions=f"transformers {transformers.__version__}, torch {torch.__version__}",
        grids=out.grids, **arrays)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        write_golden(Path(tmp) / MODEL.name)
    print(f"wrote {GOLDEN}")
