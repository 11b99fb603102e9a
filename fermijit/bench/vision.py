"""`python -m fermijit bench vision`: seconds per image through the full-size vision tower.

The real model's tower (MODEL.md §7: depth 27, hidden 1152, 16 heads, MLP 4304, merger to 2048)
with random weights made in memory, stored f16 as a converted model stores them (0.9 GB), on
synthetic images of the given sizes (448x448 and 1024x768 by default) preprocessed as the real
processor does (model/image.py: 448x448 -> 28x28 patches -> 196 tokens; 1024x768 -> 64x48 ->
768). Per size: preprocessing and the tower on the CPU (numpy fp32 matmuls), and on the GPU
where one is usable (model/vision_gpu.py), with the tower's GFLOP and the rate reached.
"""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np

from fermijit.model.config import VisionConfig

SIZES = ((448, 448), (1024, 768))
REAL = VisionConfig(out_hidden_size=2048)  # the published config (MODEL.md §2)


def random_weights(cfg: VisionConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Every tower tensor, f16 matrices at 1/sqrt(fan_in) (unit-variance outputs), f32
    vectors near the real ones' scale (norm weights ~1, biases small)."""
    from fermijit.model.vision import weight_shapes

    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in weight_shapes(cfg).items():
        if len(shape) == 1:
            base = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            out[name] = (base + 0.02 * rng.standard_normal(shape)).astype(np.float32)
        else:
            fan_in = int(np.prod(shape[1:]))
            out[name] = (rng.standard_normal(shape, dtype=np.float32)
                         / np.float32(np.sqrt(fan_in))).astype(np.float16)
    return out


def tower_flops(cfg: VisionConfig, n_patches: int) -> float:
    """Multiply-adds × 2 of one image through the tower: the linears and the attention."""
    D, I, M = cfg.hidden_size, cfg.intermediate_size, cfg.spatial_merge_size ** 2
    patch = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    per_block = n_patches * (3 * D * D + D * D + 2 * D * I) + 2 * n_patches ** 2 * D
    merger = n_patches // M * ((M * D) ** 2 + M * D * cfg.out_hidden_size)
    return 2.0 * (n_patches * patch * D + cfg.depth * per_block + merger)


def synthetic_image(width: int, height: int, seed: int = 0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def measure(cfg: VisionConfig, sizes, repeat: int, use_gpu: bool | None) -> list[dict]:
    from fermijit.model import image as mi
    from fermijit.model.vision import VisionTower

    tower = VisionTower(cfg, random_weights(cfg))
    settings = mi.ImageSettings(cfg.patch_size, cfg.spatial_merge_size, cfg.temporal_patch_size)
    gpu_tower = None
    if use_gpu is not False:
        from fermijit.model import vision_gpu

        gpu_tower = vision_gpu.make(tower) if vision_gpu.usable() else None
    warm = mi.preprocess(synthetic_image(8, 8), settings)  # compiles and loads every kernel
    tower.encode([warm])
    if gpu_tower is not None:
        gpu_tower.encode([warm])
    rows = []
    for width, height in sizes:
        im = synthetic_image(width, height)
        start = time.perf_counter()
        processed = mi.preprocess(im, settings)
        preprocess_s = time.perf_counter() - start
        n = processed.patches.shape[0]
        flops = tower_flops(cfg, n)
        row = {"image": f"{width}x{height}", "patches": n, "tokens": processed.n_tokens,
               "gflop": flops / 1e9, "preprocess_s": preprocess_s}
        runs = {"cpu": tower.encode} | ({"gpu": gpu_tower.encode} if gpu_tower else {})
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(repeat):  # interleaved: the machine is shared
            for kind, encode in runs.items():
                start = time.perf_counter()
                encode([processed])
                times[kind].append(time.perf_counter() - start)
        for kind, ts in times.items():
            row[f"{kind}_s"] = float(np.median(ts))
            row[f"{kind}_gflop_per_s"] = flops / 1e9 / row[f"{kind}_s"]
        rows.append(row)
    return rows


def run(sizes, depth: int | None, repeat: int, as_json: bool, use_gpu: bool | None) -> None:
    cfg = REAL if depth is None else dataclasses.replace(REAL, depth=depth)
    rows = measure(cfg, sizes or SIZES, repeat, use_gpu)
    if as_json:
        print(json.dumps({"depth": cfg.depth, "hidden": cfg.hidden_size, "images": rows},
                         indent=1))
    else:
        print_table(cfg, rows, repeat)


def print_table(cfg: VisionConfig, rows: list[dict], repeat: int) -> None:
    print(f"vision tower: depth {cfg.depth}, hidden {cfg.hidden_size}, {cfg.num_heads} heads, "
          f"MLP {cfg.intermediate_size}, out {cfg.out_hidden_size}; random f16 weights; "
          f"median of {repeat}")
    has_gpu = any("gpu_s" in r for r in rows)
    head = f"{'image':>10} {'patches':>8} {'tokens':>7} {'GFLOP':>8} {'prep s':>7} {'CPU s':>8} " \
           f"{'CPU GF/s':>9}" + (f" {'GPU s':>8} {'GPU GF/s':>9}" if has_gpu else "")
    print(head)
    for r in rows:
        line = (f"{r['image']:>10} {r['patches']:>8} {r['tokens']:>7} {r['gflop']:>8.1f} "
                f"{r['preprocess_s']:>7.3f} {r['cpu_s']:>8.2f} {r['cpu_gflop_per_s']:>9.1f}")
        if has_gpu:
            line += f" {r['gpu_s']:>8.3f} {r['gpu_gflop_per_s']:>9.1f}"
        print(line)
