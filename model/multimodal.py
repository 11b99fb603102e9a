"""Prompts with images: the placeholder tokens, their embeddings, MRoPE positions and the prefill.

An image of h×w patches becomes n = h·w/4 tokens: the prompt holds
    <|vision_start|> <|image_pad|> × n <|vision_end|>
where the user turn has the image (before its text, as Qwen's chat template puts it), and each
<|image_pad|> row of the embeddings is replaced by the tower's merged token, in order
(transformers' masked_scatter). Positions are 3 rows (T, H, W; transformers' get_rope_index):
text tokens advance all three by one; an image's tokens sit at (p, p + row, p + col) for its
merged grid, after which the text resumes at p + max(rows, cols). So a prompt takes fewer
positions than tokens, and decode continues at position + `rope_delta` (model/state.py).

A caller with images (fermijit/engine.py `Engine.image_prompt`, for generate --image and the
server) renders the chat with `render` from the images' layouts alone (model/image.py: their
sizes, before decoding), runs the tower and makes a `Prompt` with `build`; `prefill` runs it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from fermijit import FermijitError
from fermijit.model.config import ModelConfig
from fermijit.model.image import Layout
from fermijit.model.vision import VisionTower, check_config, weight_shapes

VISUAL_PREFIX = "model.visual."   # the checkpoint's names
STORED_PREFIX = "visual."         # a converted model's (model/convert.py)
IMAGE_PARTS = ("image", "image_url")
# Stands in for each image while the chat template renders; never in real text (a NUL-fenced
# ASCII word), so the rendered string splits on it exactly where the images go.
_MARK = "\x00fermijit-image\x00"


@dataclasses.dataclass(frozen=True)
class Prompt:
    ids: np.ndarray        # [T] int32, image tokens included
    rows: np.ndarray       # [K] int64: the rows of ids that are image tokens, in order
    embeds: np.ndarray     # [K, H] fp32: their embeddings (the tower's output)
    positions: np.ndarray  # [3, T] int64: T, H, W position of each token
    rope_delta: int        # max position + 1 - T: where decode's positions continue

    @property
    def size(self) -> int:
        return int(self.ids.size)


def load_tower(directory: str | Path, cfg: ModelConfig) -> VisionTower | None:
    """The model's vision tower (fp32 from an HF checkpoint, memory-mapped f16 from a converted
    model), or None when its files hold no `visual` tensors (a text-only model)."""
    from fermijit.model import convert
    from fermijit.model.safetensors_io import Checkpoint, SafetensorsFile

    directory = Path(directory)
    if cfg.vision_config is None:
        return None
    if convert.is_fermijit_model(directory):
        from fermijit.model.manifest import read_manifest

        manifest = read_manifest(directory)
        names = [n for n in manifest.tensors if n.startswith(STORED_PREFIX)]
        if not names:
            return None
        f = SafetensorsFile(directory / manifest.weights)
        weights = {n[len(STORED_PREFIX):]: f.raw(n) for n in names}
        patch = "patch_embed.proj.weight"  # stored flat [D, C·T·P·P]: a view as the Conv3d's
        if patch in weights:
            shape = weight_shapes(cfg.vision_config)[patch]
            if weights[patch].size == np.prod(shape):
                weights[patch] = weights[patch].reshape(shape)
    else:
        ckpt = Checkpoint(directory)
        names = [n for n in ckpt.names() if n.startswith(VISUAL_PREFIX)]
        if not names:
            return None
        check_config(cfg.vision_config, cfg.text_config.hidden_size)  # before reading
        shapes = weight_shapes(cfg.vision_config)
        weights = {n[len(VISUAL_PREFIX):]: ckpt.float32(n) for n in names
                   if n[len(VISUAL_PREFIX):] in shapes}
    check_config(cfg.vision_config, cfg.text_config.hidden_size)
    return VisionTower(cfg.vision_config, weights)


def image_ids(cfg: ModelConfig, image: Layout) -> list[int]:
    return ([cfg.vision_start_token_id] + [cfg.image_token_id] * image.n_tokens
            + [cfg.vision_end_token_id])


def render(tokenizer, messages: list[dict], images: list[Layout],
           cfg: ModelConfig, variables: dict | None = None) -> np.ndarray:
    """Prompt ids of chat `messages` (content a string, or a list of {"type": "text", "text"} and
    {"type": "image" | "image_url"} parts) through the model's chat template, each image part
    expanded to its placeholder tokens; `images` (their layouts, or the images) in the order of
    the image parts."""
    flat, n_parts = [], 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            text = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    if _MARK in part["text"]:
                        raise FermijitError("message text holds a NUL character")
                    text.append(part["text"])
                elif kind in IMAGE_PARTS:
                    text.append(_MARK)
                    n_parts += 1
                else:
                    raise FermijitError(f"message content part of type {kind!r}: expected "
                                        f"text, image or image_url")
            m = {**m, "content": "".join(text)}
        elif not isinstance(content, str):
            raise FermijitError("a message needs a role and a string or list content")
        flat.append(m)
    if n_parts != len(images):
        raise FermijitError(f"the messages have {n_parts} image parts for {len(images)} images")
    pieces = tokenizer.render_chat(flat, variables=variables).split(_MARK)
    if len(pieces) != len(images) + 1:
        raise FermijitError("the chat template dropped or repeated an image")
    ids = list(tokenizer.encode(pieces[0], add_special_tokens=False))
    for image, piece in zip(images, pieces[1:]):
        ids += image_ids(cfg, image) + list(tokenizer.encode(piece, add_special_tokens=False))
    return np.asarray(ids, np.int32)


def rope_index(ids: np.ndarray, images: list[Layout], image_token_id: int):
    """(positions [3, T] int64, rope_delta): transformers' get_rope_index for one sequence,
    each run of image tokens taking the next image's grid."""
    ids = np.asarray(ids)
    rows = np.nonzero(ids == image_token_id)[0]
    if rows.size != sum(im.n_tokens for im in images):
        raise FermijitError(f"the prompt has {rows.size} image tokens, the images make "
                            f"{sum(im.n_tokens for im in images)}")
    positions = np.empty((3, ids.size), np.int64)
    t, p, k = 0, 0, 0  # token, next position, image
    while t < ids.size:
        if ids[t] != image_token_id:
            end = t
            while end < ids.size and ids[end] != image_token_id:
                end += 1
            positions[:, t:end] = p + np.arange(end - t)
            p += end - t
            t = end
            continue
        im = images[k]
        frames, h, w = im.grid
        h, w = h // im.merge_size, w // im.merge_size
        n = frames * h * w
        if not (ids[t:t + n] == image_token_id).all() or (t + n < ids.size
                                                          and ids[t + n] == image_token_id):
            raise FermijitError(f"image {k + 1}: its run of image tokens does not hold {n}")
        f_, r_, c_ = np.meshgrid(np.arange(frames), np.arange(h), np.arange(w), indexing="ij")
        positions[:, t:t + n] = p + np.stack([f_.ravel(), r_.ravel(), c_.ravel()])
        p += max(h, w)
        t += n
        k += 1
    return positions, int(positions.max()) + 1 - int(ids.size)


def build(ids: np.ndarray, images: list[Layout], embeds: np.ndarray | None,
          cfg: ModelConfig) -> Prompt:
    """A Prompt from ids that hold the images' placeholders, and the images' embeddings."""
    ids = np.asarray(ids, np.int32)
    positions, delta = rope_index(ids, images, cfg.image_token_id)
    rows = np.nonzero(ids == cfg.image_token_id)[0].astype(np.int64)
    if embeds is None:
        embeds = np.zeros((0, cfg.text_config.hidden_size), np.float32)
    if embeds.shape != (rows.size, cfg.text_config.hidden_size):
        raise FermijitError(f"image embeddings {list(embeds.shape)} for {rows.size} image tokens")
    return Prompt(ids, rows, np.ascontiguousarray(embeds, np.float32), positions, delta)


def prefill(model, prompt: Prompt, state, all_logits: bool = False, on_block=None) -> np.ndarray:
    """Model.prefill for a Prompt: the image rows' embeddings replaced, MRoPE positions (offset
    by what `state` has seen); leaves `state.rope_delta` for decode. Logits of the last token
    ([T, V] of all with `all_logits`)."""
    from fermijit.model.forward import PREFILL_BLOCK, Workspace

    model._check_room(state, prompt.size)
    offset = state.position + state.rope_delta
    logits, ws, t0 = [], None, 0
    while t0 < prompt.size:
        n = min(PREFILL_BLOCK, prompt.size - t0)
        if ws is None or ws.tokens.size != n:
            ws = Workspace(model, n)
        ws.tokens[:] = prompt.ids[t0:t0 + n]
        inside = (prompt.rows >= t0) & (prompt.rows < t0 + n)
        ws.embeds = (prompt.rows[inside] - t0, prompt.embeds[inside]) if inside.any() else None
        ws.mrope = np.ascontiguousarray(prompt.positions[:, t0:t0 + n] + offset)
        model.forward(ws.tokens, state, ws)
        t0 += n
        if on_block is not None:
            on_block(n)
        if all_logits:
            logits.append(model.logits(ws.x, np.empty((n, model.vocab_size), np.float32)))
    state.rope_delta += prompt.rope_delta
    if all_logits:
        return np.concatenate(logits)
    return model.logits(ws.x[-1:], np.empty((1, model.vocab_size), np.float32))[0]
