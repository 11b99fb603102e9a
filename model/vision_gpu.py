"""The vision tower on the GPU: model/vision.py's computation in .target sm_20 PTX.

The weights are widened to fp32 and copied to the device once (1.8 GB for the real tower); an
image's patches go in, its merged embeddings come back. The linears are f32_gemm.ptx (x · wᵀ)
with bias_act.ptx as their epilogue (bias, then the residual add or a GELU), the norms
layer_norm.ptx, the attention ops/vision_attention.py's gpu; the position embedding
interpolation and the rotary tables are made on the host (model/vision.py), as ops/rope.py does.
"""

from __future__ import annotations

import numpy as np

from fermijit.model.image import Image
from fermijit.model.vision import (LAYER_NORM_EPS, VisionTower, interpolated_positions,
                                   rotary_tables)
from fermijit.ops import bias_act, layer_norm, vision_attention

TILE = 16  # f32_gemm.ptx's output tile side


def usable() -> bool:
    from fermijit.jit import gpu

    return gpu.unavailable_reason() is None


class GpuTower:
    """`VisionTower.encode` on the GPU, with the same tower's weights."""

    def __init__(self, tower: VisionTower):
        from fermijit.jit import gpu as g

        self.tower, self.cfg = tower, tower.cfg
        self.d = {}
        for name in tower.weights:
            a = tower.w(name)
            if name == "patch_embed.proj.weight":
                a = a.reshape(a.shape[0], -1)
            self.d[name] = g.to_device("vision tower", name, np.ascontiguousarray(a), np.float32)

    def linear(self, x, name: str, act: str = "none", res=None, out=None):
        """act(x · Wᵀ + b) [+ res] on the device; x [N, K] a device array."""
        from fermijit.jit import gpu as g

        w = self.d[name + ".weight"]
        n, k = x.shape
        cols = w.shape[0]
        y = g.empty((n, cols))
        g.kernel("f32_gemm", MODE="plain")((-(-cols // TILE), -(-n // TILE)), (TILE * TILE,),
                                           x, w, y, None, None, None, n, cols, k, 0)
        return bias_act.gpu(y, self.d[name + ".bias"], act, res, out=y if out is None else out)

    def norm(self, x, name: str):
        return layer_norm.gpu(x, self.d[name + ".weight"], self.d[name + ".bias"],
                              LAYER_NORM_EPS)

    def encode(self, images: list[Image]) -> np.ndarray:
        return np.concatenate([self.encode_one(im) for im in images])

    def encode_one(self, image: Image) -> np.ndarray:
        from fermijit.jit import gpu as g

        cfg, merge = self.cfg, self.tower.merge
        positions = interpolated_positions(self.tower.weights["pos_embed.weight"], image.grid,
                                           merge)
        x = self.linear(g.to_device("vision tower", "patches", image.patches, np.float32),
                        "patch_embed.proj", "residual",
                        g.to_device("vision tower", "positions", positions, np.float32))
        cos, sin = rotary_tables(image.grid, merge, self.tower.head_dim, cfg.rope_theta)
        act = "gelu_tanh" if self.tower.act == "tanh" else "gelu_erf"
        for b in range(cfg.depth):
            p = f"blocks.{b}."
            qkv = self.linear(self.norm(x, p + "norm1"), p + "attn.qkv")
            o = vision_attention.gpu(qkv, cos, sin, self.tower.heads)
            x = self.linear(o, p + "attn.proj", "residual", x, out=x)
            h = self.linear(self.norm(x, p + "norm2"), p + "mlp.linear_fc1", act)
            x = self.linear(h, p + "mlp.linear_fc2", "residual", x, out=x)
        h = self.norm(x, "merger.norm").reshape(x.shape[0] // merge ** 2, -1)
        h = self.linear(h, "merger.linear_fc1", "gelu_erf")
        return self.linear(h, "merger.linear_fc2").get()


def make(tower: VisionTower) -> GpuTower:
    return GpuTower(tower)
