"""Images in: reading a file with Pillow and turning it into the vision tower's patches, as
transformers' Qwen2-VL image processor (the Pil variant, `Qwen2VLImageProcessorPil`) does for
Qwen3.6 (MODEL.md §7).

    1. RGB, transparency composited onto white;
    2. smart resize (bicubic): both sides multiples of patch·merge (32 on the real model), the
       aspect ratio kept as near as may be, the pixel count within [min_pixels, max_pixels];
    3. x/255, then (x - mean)/std (0.5 and 0.5 on the real model);
    4. patches of P×P, each repeated to the temporal depth T (a still image is two equal frames),
       a row of C·T·P·P values in (C, T, py, px) order, the rows in 2×2 merge-block order
       (block row, block column, row within the block, column within it).

The settings come from the model's `preprocessor_config.json` where it has one, else the real
model's defaults with the sizes of its vision config.

An image is read in two steps: `open_image` / `from_data_uri` read the file's
bytes and its header's size only (an `Encoded` image); from that size alone its tokens are known
(`Encoded.layout`: the grid smart_resize gives), so a caller checks them against its context and
budget before anything is decoded; `Encoded.decode` then decodes it. A 16 KB PNG claiming
11500x11500 pixels was decoded, resized to 16.7 M pixels and made into 65,536 patches before its
16,384 tokens were compared with anything.

Bad files are one line each (FermijitError): missing, not a regular file (a FIFO, a directory,
a device), unreadable, not an image, truncated, or larger than MAX_SOURCE_PIXELS before decoding
(a decompression bomb: a 100-byte PNG can claim gigapixels).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import warnings
from pathlib import Path

import numpy as np

from fermijit import FermijitError
from fermijit.model.config import VisionConfig
from fermijit.model.files import read_json

# A source image is decoded only up to this many pixels (~ 12k x 12k; Pillow's own bomb check
# warns at 89 M and raises at twice that): its RGB array alone is then 400 MiB. What reaches
# the tower is bounded again by max_pixels.
MAX_SOURCE_PIXELS = 1 << 27
MAX_FILE_BYTES = 48 << 20  # an image file: far past any real photo
MAX_DATA_URI_CHARS = MAX_FILE_BYTES * 4 // 3  # its base64
MAX_ASPECT_RATIO = 200  # transformers' smart_resize refuses beyond this
# Image tokens a prompt may hold unless the caller says otherwise (`--max-image-tokens`): a
# full-HD photo is 2025. The tower's work grows faster than its tokens (attention over all of an
# image's patches): 448x448 (196 tokens) took 1.8 s through 2 of the real tower's 27 blocks on
# 2 cores (commit 88087c2), so ~24 s in all.
DEFAULT_MAX_IMAGE_TOKENS = 2048
# The real model's processor (preprocessor_config.json of Qwen3.5/3.6): 256² to 4096² pixels.
DEFAULT_MIN_PIXELS = 65536
DEFAULT_MAX_PIXELS = 16777216
DEFAULT_MEAN = (0.5, 0.5, 0.5)
DEFAULT_STD = (0.5, 0.5, 0.5)


@dataclasses.dataclass(frozen=True)
class ImageSettings:
    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    mean: tuple[float, ...] = DEFAULT_MEAN
    std: tuple[float, ...] = DEFAULT_STD

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


@dataclasses.dataclass(frozen=True)
class Layout:
    """An image's place in the prompt, known from its size before it is decoded."""

    grid: tuple[int, int, int]  # (t, h, w) in patches: grid_thw
    merge_size: int

    @property
    def n_tokens(self) -> int:
        """Merged tokens, i.e. <|image_pad|> placeholders in the prompt."""
        t, h, w = self.grid
        return t * h * w // self.merge_size ** 2


@dataclasses.dataclass(frozen=True)
class Image(Layout):
    """One preprocessed image: what the tower takes, and how many tokens it becomes."""

    patches: np.ndarray   # [h·w, C·T·P·P] fp32, rows in merge-block order


@dataclasses.dataclass(frozen=True)
class Encoded:
    """An image file's bytes and the size its header claims, not decoded yet."""

    data: bytes
    label: str    # names it in errors: "image PATH", "image 0"
    width: int
    height: int

    def layout(self, settings: ImageSettings) -> Layout:
        return _layout(self.width, self.height, settings, self.label)

    def decode(self):
        """The RGB PIL image."""
        import io

        with _pillow_errors(self.label), _open(io.BytesIO(self.data)) as im:
            im.load()
            if im.size != (self.width, self.height):  # a format whose header said otherwise
                raise FermijitError(f"{self.label}: decoded as {im.size[0]}x{im.size[1]}, its "
                                    f"header said {self.width}x{self.height}")
            return to_rgb(im)


def image_settings(directory: str | Path | None, vision: VisionConfig) -> ImageSettings:
    """The processor settings: `directory/preprocessor_config.json` over the defaults."""
    base = ImageSettings(patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                         temporal_patch_size=vision.temporal_patch_size)
    path = None if directory is None else Path(directory) / "preprocessor_config.json"
    if path is None or not path.is_file():
        return base
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise FermijitError(f"{path}: expected a JSON object")
    size = raw.get("size") or {}
    fields = {"patch_size": raw.get("patch_size"), "merge_size": raw.get("merge_size"),
              "temporal_patch_size": raw.get("temporal_patch_size"),
              "min_pixels": raw.get("min_pixels", size.get("shortest_edge")),
              "max_pixels": raw.get("max_pixels", size.get("longest_edge")),
              "mean": raw.get("image_mean"), "std": raw.get("image_std")}
    fields = {k: v for k, v in fields.items() if v is not None}
    for k in ("mean", "std"):
        if k in fields:
            v = fields[k]
            fields[k] = tuple(float(x) for x in (v if isinstance(v, list) else [v] * 3))
    for k, v in fields.items():
        if k not in ("mean", "std") and not (isinstance(v, int) and v > 0):
            raise FermijitError(f"{path}: {k} must be a positive integer, got {v!r}")
    settings = dataclasses.replace(base, **fields)
    if (settings.patch_size, settings.merge_size, settings.temporal_patch_size) != (
            base.patch_size, base.merge_size, base.temporal_patch_size):
        raise FermijitError(f"{path}: patch sizes differ from config.json's vision_config")
    if len(settings.mean) != 3 or len(settings.std) != 3 or min(settings.std) <= 0:
        raise FermijitError(f"{path}: image_mean and image_std need 3 values, std positive")
    return settings


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int, label: str = "image") -> tuple[int, int]:
    """transformers' smart_resize: (height, width) multiples of `factor`, the pixel count in
    [min_pixels, max_pixels], the aspect ratio kept as near as the rounding allows."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise FermijitError(f"{label}: aspect ratio {max(height, width) / min(height, width):.0f} "
                            f"is beyond {MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def layout(im, settings: ImageSettings) -> Layout:
    """Where `im` (Encoded, a PIL image, or a preprocessed Image) goes in the prompt and how many
    tokens it takes, without decoding it."""
    if isinstance(im, Layout):
        return im
    if isinstance(im, Encoded):
        return im.layout(settings)
    return _layout(*im.size, settings)


def _layout(width: int, height: int, settings: ImageSettings, label: str = "image") -> Layout:
    h, w = smart_resize(height, width, settings.factor, settings.min_pixels, settings.max_pixels,
                        label)
    return Layout((1, h // settings.patch_size, w // settings.patch_size), settings.merge_size)


def open_image(path: str | Path) -> Encoded:
    """The image file at `path`, read and its header checked (not decoded), or one line saying
    what is wrong with the file."""
    from fermijit.model.files import read_bytes

    label = f"image {path}"
    if not os.path.exists(path):  # a link to nothing too
        raise FermijitError(f"{label}: no such file")
    try:
        data = read_bytes(path, MAX_FILE_BYTES, "image file")
    except FermijitError as e:  # "PATH: not a regular file (a FIFO)", "PATH: cannot open (...)"
        raise FermijitError(f"image {e}") from None
    return probe(data, label)


def from_data_uri(uri: str, label: str = "image") -> Encoded:
    """The image in a `data:image/...;base64,...` URI (OpenAI `image_url` content parts), with
    `open_image`'s checks."""
    import base64
    import binascii

    head, comma, body = uri.partition(",")
    if not (head.startswith("data:") and head.endswith(";base64") and comma):
        raise FermijitError(f"{label}: expected a data:<type>;base64,<data> URI")
    if len(body) > MAX_DATA_URI_CHARS:
        raise FermijitError(f"{label}: the data URI is longer than {MAX_DATA_URI_CHARS} characters")
    try:
        data = base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise FermijitError(f"{label}: the data URI is not valid base64") from None
    return probe(data, label)


def probe(data: bytes, label: str) -> Encoded:
    """`data` as an Encoded image: Pillow reads its header only; the size it claims is checked
    (`label` names it in errors)."""
    import io

    with _pillow_errors(label), _open(io.BytesIO(data)) as im:
        width, height = im.size
    if width * height > MAX_SOURCE_PIXELS:
        raise FermijitError(f"{label}: {width}x{height} pixels is beyond the "
                            f"{MAX_SOURCE_PIXELS} this reads (a decompression bomb?)")
    if width < 1 or height < 1:
        raise FermijitError(f"{label}: empty ({width}x{height})")
    return Encoded(data, label, width, height)


def _open(f):
    """PILImage.open without Pillow's own bomb warning (past 89 M pixels): `probe`'s bound
    speaks instead, in one line."""
    from PIL import Image as PILImage

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PILImage.DecompressionBombWarning)
        return PILImage.open(f)


@contextlib.contextmanager
def _pillow_errors(label: str):
    """Pillow's errors as one FermijitError line naming the image."""
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    try:
        yield
    except UnidentifiedImageError:
        raise FermijitError(f"{label}: not an image file Pillow can read") from None
    except PILImage.DecompressionBombError as e:
        raise FermijitError(f"{label}: {e}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:  # truncated, bad chunks
        raise FermijitError(f"{label}: cannot decode it ({e})") from None


def to_rgb(im):
    """RGB, any transparency composited onto white (transformers' convert_to_rgb)."""
    from PIL import Image as PILImage

    if "A" in im.getbands() or im.info.get("transparency") is not None:
        im = im.convert("RGBA")
        white = PILImage.new("RGBA", im.size, (255, 255, 255, 255))
        return PILImage.alpha_composite(white, im).convert("RGB")
    return im.convert("RGB")


def preprocess(im, settings: ImageSettings) -> Image:
    """An RGB PIL image (or an Encoded one, decoded here) -> the tower's patches and grid (this
    module's steps 2-4)."""
    from PIL import Image as PILImage

    if isinstance(im, Encoded):
        im = im.decode()
    width, height = im.size
    h, w = smart_resize(height, width, settings.factor, settings.min_pixels, settings.max_pixels)
    im = im.resize((w, h), resample=PILImage.Resampling.BICUBIC)
    x = np.asarray(im, dtype=np.uint8).transpose(2, 0, 1)                 # [C, h, w]
    x = (x.astype(np.float64) * (1 / 255)).astype(np.float32)             # as transformers: f64
    mean = np.asarray(settings.mean, np.float32)[:, None, None]
    std = np.asarray(settings.std, np.float32)[:, None, None]
    x = ((x - mean) / std).astype(np.float32)
    p, m, t = settings.patch_size, settings.merge_size, settings.temporal_patch_size
    gh, gw = h // p, w // p
    x = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))  # [.., C, T, py, px]
    return Image((1, gh, gw), m, np.ascontiguousarray(x.reshape(gh * gw, 3 * t * p * p)))


def load(path: str | Path, settings: ImageSettings) -> Image:
    return preprocess(open_image(path), settings)
