"""The vision tower (MODEL.md §7): an image's patches -> one embedding per merged 2×2 block, in
the text model's hidden size, fp32, on the CPU (numpy's BLAS matmuls and ops/gelu.py).

    x = patches · W_patchᵀ + b                     Conv3d [D, C, T, P, P] as a linear map
    x += bilinear(pos_embed, grid)                 a learned S×S grid resampled (align corners)
    per block: x += proj(attn(rope2d(qkv(LN1(x)))))   bidirectional, within the image
               x += fc2(gelu_tanh(fc1(LN2(x))))
    merger:    y = fc2(gelu(fc1(concat4(LN(x)))))   4 consecutive rows = one 2×2 block

Weights are a mapping from the checkpoint's names without `model.visual.` (e.g.
"blocks.0.attn.qkv.weight") to arrays of any float dtype: fp32 from an HF checkpoint, f16
memory-mapped from a converted model; each matrix is made fp32 as its block runs, so the tower
holds half its fp32 size in memory (0.9 GB for the real model).

Dimensions: N patches of one image, D hidden (1152), Hd heads (16) of d (72), I the MLP width
(4304), M = merge² (4), O out_hidden_size (2048), S×S the position grid (48×48).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

import numpy as np

from fermijit import FermijitError
from fermijit.model.config import VisionConfig
from fermijit.model.image import Image
from fermijit.ops import gelu, layer_norm, vision_attention, widen

LAYER_NORM_EPS = 1e-6          # every LayerNorm of the tower (blocks and merger)
BLOCK_FIELDS = ("norm1.weight", "norm1.bias", "attn.qkv.weight", "attn.qkv.bias",
                "attn.proj.weight", "attn.proj.bias", "norm2.weight", "norm2.bias",
                "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight",
                "mlp.linear_fc2.bias")
ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "exact"}


def weight_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tower tensor's name (checkpoint name less `model.visual.`) and shape."""
    D, I = cfg.hidden_size, cfg.intermediate_size
    P, T, C = cfg.patch_size, cfg.temporal_patch_size, cfg.in_channels
    Dm = D * cfg.spatial_merge_size ** 2
    shapes = {"patch_embed.proj.weight": (D, C, T, P, P), "patch_embed.proj.bias": (D,),
              "pos_embed.weight": (cfg.num_position_embeddings, D)}
    block = {"norm1.weight": (D,), "norm1.bias": (D,), "attn.qkv.weight": (3 * D, D),
             "attn.qkv.bias": (3 * D,), "attn.proj.weight": (D, D), "attn.proj.bias": (D,),
             "norm2.weight": (D,), "norm2.bias": (D,), "mlp.linear_fc1.weight": (I, D),
             "mlp.linear_fc1.bias": (I,), "mlp.linear_fc2.weight": (D, I),
             "mlp.linear_fc2.bias": (D,)}
    for b in range(cfg.depth):
        shapes.update({f"blocks.{b}.{k}": s for k, s in block.items()})
    shapes.update({"merger.norm.weight": (D,), "merger.norm.bias": (D,),
                   "merger.linear_fc1.weight": (Dm, Dm), "merger.linear_fc1.bias": (Dm,),
                   "merger.linear_fc2.weight": (cfg.out_hidden_size, Dm),
                   "merger.linear_fc2.bias": (cfg.out_hidden_size,)})
    return shapes


def plan_weights(cfg, ckpt) -> dict:
    """The tower's tensors of an HF checkpoint as convert's plans (model/weights.py), named
    `visual.<name>`, the Conv3d weight flattened to [D, C·T·P·P]; {} for a text-only checkpoint.
    `cfg` is the whole ModelConfig."""
    from fermijit.model.weights import Piece, TensorPlan, _check

    if cfg.vision_config is None or not any(n.startswith("model.visual.") for n in ckpt.names()):
        return {}
    try:
        check_config(cfg.vision_config, cfg.text_config.hidden_size)
        for name, shape in weight_shapes(cfg.vision_config).items():
            _check(ckpt, "model.visual." + name, shape)
    except FermijitError as e:  # the text model converts all the same; images will say why not
        print(f"warning: converting without the vision tower: {e}", file=sys.stderr)
        return {}
    plans = {}
    for name, shape in weight_shapes(cfg.vision_config).items():
        source = "model.visual." + name
        if len(shape) > 2:
            shape = (shape[0], int(np.prod(shape[1:])))
        plans["visual." + name] = TensorPlan("visual." + name, shape,
                                             (Piece(source, None, 0, shape[0]),))
    return plans


def check_config(cfg: VisionConfig, text_hidden: int, where: str = "vision_config") -> None:
    """What the tower supports, checked before any weight is read."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise FermijitError(f"{where}: {what}")

    need(cfg.hidden_act in ACTIVATIONS, f"unsupported hidden_act {cfg.hidden_act!r} "
                                        f"(supported: {', '.join(ACTIVATIONS)})")
    need(cfg.num_heads > 0 and cfg.hidden_size % cfg.num_heads == 0,
         "hidden_size must be a multiple of num_heads")
    need((cfg.hidden_size // cfg.num_heads) % 4 == 0, "the head dim must be a multiple of 4 "
                                                      "(2-D rotary)")
    side = int(round(cfg.num_position_embeddings ** 0.5))
    need(side * side == cfg.num_position_embeddings, "num_position_embeddings must be a square")
    need(cfg.in_channels == 3, "in_channels must be 3 (RGB)")
    need(not cfg.deepstack_visual_indexes, "deepstack_visual_indexes must be empty")
    need(cfg.out_hidden_size == text_hidden,
         f"out_hidden_size {cfg.out_hidden_size} differs from the text hidden size {text_hidden}")
    need(0 < cfg.depth <= 1024 and 0 < cfg.hidden_size <= 1 << 16
         and 0 < cfg.intermediate_size <= 1 << 18, "sizes out of range")


def position_grid(grid: tuple[int, int, int], merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) [N] int64 of each patch, in merge-block order (the patches' row order)."""
    t, h, w = grid
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    cols = cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    return np.tile(rows, t), np.tile(cols, t)


def interpolated_positions(pos_embed: np.ndarray, grid, merge: int) -> np.ndarray:
    """pos_embed [S·S, D] resampled bilinearly (align_corners) to the patches [N, D], fp32."""
    side = int(round(pos_embed.shape[0] ** 0.5))
    _, h, w = grid
    rows, cols = position_grid(grid, merge)
    table = np.asarray(pos_embed, np.float32)

    def taps(index, size):  # the two source taps per axis and their weights
        src = index * (side - 1) / max(size - 1, 1)
        lo = np.floor(src)
        frac = src - lo
        lo = lo.astype(np.int64)
        return (np.clip(lo, 0, side - 1), np.clip(lo + 1, 0, side - 1)), (1 - frac, frac)

    (r0, r1), (wr0, wr1) = taps(rows, h)
    (c0, c1), (wc0, wc1) = taps(cols, w)
    out = np.zeros((rows.size, table.shape[1]), np.float64)
    for r, wr in ((r0, wr0), (r1, wr1)):
        for c, wc in ((c0, wc0), (c1, wc1)):
            out += (wr * wc)[:, None] * table[r * side + c]
    return out.astype(np.float32)


def rotary_tables(grid, merge: int, head_dim: int, theta: float):
    """cos, sin [N, d] fp32 of the 2-D rotary: frequencies inv_j = theta^(-4j/d), j < d/4; dims
    [0, d/4) turn by row·inv, [d/4, d/2) by col·inv, and the second half repeats the first
    (rotate-half pairs (i, i + d/2))."""
    rows, cols = position_grid(grid, merge)
    inv = 1.0 / theta ** (np.arange(0, head_dim // 2, 2, dtype=np.float64) / (head_dim // 2))
    angle = np.concatenate([rows[:, None] * inv, cols[:, None] * inv], axis=1)   # [N, d/2]
    angle = np.concatenate([angle, angle], axis=1)                               # [N, d]
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


class VisionTower:
    """The tower of one model: its config and weights (see the module docstring)."""

    def __init__(self, cfg: VisionConfig, weights: Mapping[str, np.ndarray]):
        shapes = weight_shapes(cfg)
        for name, shape in shapes.items():
            if name not in weights:
                raise FermijitError(f"vision tower: missing tensor model.visual.{name}")
            if tuple(weights[name].shape) != shape:
                raise FermijitError(f"vision tower: tensor model.visual.{name} has shape "
                                    f"{list(weights[name].shape)}, expected {list(shape)}")
        self.cfg, self.weights = cfg, weights
        self.heads, self.head_dim = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        self.merge = cfg.spatial_merge_size
        self.act = ACTIVATIONS[cfg.hidden_act]

    def w(self, name: str) -> np.ndarray:
        """A weight as fp32 (a copy from f16, else the array itself)."""
        a = self.weights[name]
        return widen.cpu(np.asarray(a)) if a.dtype == np.float16 else np.asarray(a, np.float32)

    def linear(self, x, name: str) -> np.ndarray:
        """x · Wᵀ + b for the checkpoint's `name`.weight and `name`.bias."""
        y = x @ self.w(name + ".weight").T
        y += self.w(name + ".bias")
        return y

    def encode(self, images: list[Image]) -> np.ndarray:
        """The merged embeddings of `images`, in order: [Σ n_tokens, O] fp32."""
        return np.concatenate([self.encode_one(im) for im in images])

    def embed_patches(self, image: Image) -> np.ndarray:
        """Patch embedding plus the interpolated position embedding: [N, D]."""
        cfg = self.cfg
        w = self.w("patch_embed.proj.weight").reshape(cfg.hidden_size, -1)
        x = image.patches @ w.T
        x += self.w("patch_embed.proj.bias")
        x += interpolated_positions(self.weights["pos_embed.weight"], image.grid, self.merge)
        return x

    def encode_one(self, image: Image) -> np.ndarray:
        if image.merge_size != self.merge or image.patches.shape[1] != (
                self.cfg.in_channels * self.cfg.temporal_patch_size * self.cfg.patch_size ** 2):
            raise FermijitError(f"vision tower: image patches {list(image.patches.shape)} do not "
                                f"fit this tower's patch size")
        x = self.embed_patches(image)
        cos, sin = rotary_tables(image.grid, self.merge, self.head_dim, self.cfg.rope_theta)
        for b in range(self.cfg.depth):
            x = self.block(x, f"blocks.{b}.", cos, sin)
        return self.merger(x)

    def norm(self, x, name: str) -> np.ndarray:
        return layer_norm.cpu(x, self.w(name + ".weight"), self.w(name + ".bias"),
                              LAYER_NORM_EPS)

    def block(self, x, p: str, cos, sin) -> np.ndarray:
        qkv = self.linear(self.norm(x, p + "norm1"), p + "attn.qkv")
        x = x + self.linear(vision_attention.cpu(qkv, cos, sin, self.heads), p + "attn.proj")
        h = gelu.cpu(self.linear(self.norm(x, p + "norm2"), p + "mlp.linear_fc1"), self.act)
        return x + self.linear(h, p + "mlp.linear_fc2")

    def merger(self, x) -> np.ndarray:
        h = self.norm(x, "merger.norm")
        h = h.reshape(-1, h.shape[1] * self.merge ** 2)               # [N/M, M·D]
        h = gelu.cpu(self.linear(h, "merger.linear_fc1"), "exact")
        return self.linear(h, "merger.linear_fc2")
