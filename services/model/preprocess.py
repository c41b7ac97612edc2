"""Image bytes -> normalised pixels, as `CLIPImageProcessor` does for this checkpoint.

Configured by the checkpoint's preprocessor_config.json: resize (shortest edge or a
fixed size, Pillow resampling), optional center crop (`crop`: Pillow and numpy, uint8),
then rescale and normalise (`normalize`: torch, on whichever device the pixels are). The resize
is Pillow's: on the preprocessing threads (`crop`), or where the tower runs, with Pillow's own
fixed-point arithmetic (`crop_on_device`, resample.py); no float resize reproduces its rounded
uint8 output, and tests compare against transformers' own processor to 1e-5.
"""

from __future__ import annotations

import functools
import io
import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from services.common.errors import InvalidArgument
from services.model import resample

# Pillow's decompression-bomb guard raises above 2x this many pixels; keep it explicit.
MAX_IMAGE_PIXELS = 40_000_000
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_REPR = re.compile(r"\s*<[^<>]* at 0x[0-9a-fA-F]+>")  # an object's default repr


@dataclass(frozen=True)
class ImageProcessorConfig:
    shortest_edge: int | None  # resize the short side to this, keeping the aspect ratio...
    size_hw: tuple[int, int] | None  # ...or to exactly (height, width)
    resample: int
    do_resize: bool
    do_center_crop: bool
    crop_hw: tuple[int, int]
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    do_convert_rgb: bool

    @classmethod
    def load(cls, model_dir: Path, image_size: int) -> ImageProcessorConfig:
        path, raw = image_processor_json(model_dir)
        size = raw.get("size", {"shortest_edge": image_size})
        if isinstance(size, int):
            size = {"shortest_edge": size}
        crop = raw.get("crop_size", {"height": image_size, "width": image_size})
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        cfg = cls(
            shortest_edge=size.get("shortest_edge"),
            size_hw=(size["height"], size["width"]) if "height" in size else None,
            resample=int(raw.get("resample", Image.Resampling.BICUBIC)),
            do_resize=raw.get("do_resize", True),
            do_center_crop=raw.get("do_center_crop", True),
            crop_hw=(crop["height"], crop["width"]),
            do_rescale=raw.get("do_rescale", True),
            rescale_factor=raw.get("rescale_factor", 1 / 255),
            do_normalize=raw.get("do_normalize", True),
            mean=tuple(raw.get("image_mean", OPENAI_CLIP_MEAN)),
            std=tuple(raw.get("image_std", OPENAI_CLIP_STD)),
            do_convert_rgb=raw.get("do_convert_rgb", True),
        )
        out_hw = cfg.crop_hw if cfg.do_center_crop else cfg.size_hw
        if out_hw is not None and out_hw != (image_size, image_size):
            raise InvalidArgument(f"{path}: output size {out_hw} differs from the ViT's image_size {image_size}")
        if not cfg.do_center_crop and cfg.size_hw is None:
            raise InvalidArgument(f"{path}: without a center crop, size must be a fixed height and width")
        return cfg


def image_processor_json(model_dir: Path) -> tuple[Path, dict]:
    """The image processor's settings: preprocessor_config.json, or the "image_processor" entry of
    processor_config.json (where transformers 5 saves a whole processor); ({}) when neither exists."""
    path = model_dir / "preprocessor_config.json"
    try:
        if path.is_file():
            return path, json.loads(path.read_text())
        whole = model_dir / "processor_config.json"
        if whole.is_file():
            return whole, json.loads(whole.read_text()).get("image_processor", {})
    except (ValueError, AttributeError):
        raise InvalidArgument(f"{path if path.is_file() else whole}: not a JSON object") from None
    return path, {}


def _reason(err: BaseException) -> str:
    """Pillow's complaint, without Python internals (`<_io.BytesIO object at 0x7f...>`)."""
    if isinstance(err, UnidentifiedImageError):
        return "its format is not one Pillow recognises"
    text = _REPR.sub("", str(err)).strip().rstrip(".") or type(err).__name__
    return " ".join(text.split())


def decode_image(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS, name: str = "image data") -> Image.Image:
    """Decode any format Pillow reads; INVALID_ARGUMENT naming `name` (e.g. "images[0]") and the reason otherwise."""
    if not data:
        raise InvalidArgument(f"{name} is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            if img.width * img.height > max_pixels:
                raise InvalidArgument(
                    f"{name} is {img.width}x{img.height} = {img.width * img.height} pixels; the limit is {max_pixels}"
                )
            img.load()
    except InvalidArgument:
        raise
    except (
        OSError,
        ValueError,
        SyntaxError,
        Image.DecompressionBombError,
        Image.DecompressionBombWarning,
    ) as err:
        raise InvalidArgument(
            f"{name} ({len(data)} bytes) is not a readable image (JPEG, PNG, WebP, ...): {_reason(err)}"
        ) from err
    return img


def _center_crop(arr: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
    """[h, w, 3] -> [ch, cw, 3], centred, as transformers crops (zeros around a picture too small)."""
    h, w = arr.shape[:2]
    ch, cw = hw
    if ch > h or cw > w:  # pad with zeros first, centered, as transformers does
        padded = arr.new_zeros((max(h, ch), max(w, cw), arr.shape[2]))
        top, left = (padded.shape[0] - h) // 2, (padded.shape[1] - w) // 2
        padded[top : top + h, left : left + w] = arr
        arr, h, w = padded, padded.shape[0], padded.shape[1]
    top, left = (h - ch) // 2, (w - cw) // 2
    return arr[top : top + ch, left : left + cw]


def resized_size(
    width: int, height: int, cfg: ImageProcessorConfig, max_pixels: int = MAX_IMAGE_PIXELS, name: str = "image data"
) -> tuple[int, int]:
    """The (width, height) the processor resizes a picture to.

    INVALID_ARGUMENT naming `name` when the resize would exceed `max_pixels`: the shortest edge
    goes to the processor's size, so a sliver of a picture (1 x 3,000,000) would grow a thousandfold.
    """
    if not cfg.do_resize:
        return width, height
    if cfg.size_hw is not None:
        return cfg.size_hw[1], cfg.size_hw[0]
    short, long = sorted((height, width))
    new_short, new_long = cfg.shortest_edge, int(cfg.shortest_edge * long / short)
    new_h, new_w = (new_short, new_long) if height <= width else (new_long, new_short)
    if new_h * new_w > max_pixels:
        raise InvalidArgument(
            f"{name} is {width}x{height}: resized to a shortest edge of {cfg.shortest_edge} it would be "
            f"{new_w}x{new_h} pixels; the limit is {max_pixels} (an aspect ratio of at most "
            f"{max_pixels // cfg.shortest_edge**2}:1)"
        )
    return new_w, new_h


def rgb_tensor(img: Image.Image) -> torch.Tensor:
    """A picture's pixels as a writable uint8 [h, w, C] tensor (Pillow's own array is read-only)."""
    return torch.from_numpy(np.array(img, dtype=np.uint8, order="C"))


def crop(
    img: Image.Image, cfg: ImageProcessorConfig, max_pixels: int = MAX_IMAGE_PIXELS, name: str = "image data"
) -> torch.Tensor:
    """PIL image -> its resized, center-cropped pixels [S, S, 3] uint8, resized by Pillow."""
    if cfg.do_convert_rgb and img.mode != "RGB":
        img = img.convert("RGB")
    size = resized_size(img.width, img.height, cfg, max_pixels, name)
    if size != img.size:
        img = img.resize(size, resample=cfg.resample)
    arr = rgb_tensor(img)
    return _center_crop(arr, cfg.crop_hw).contiguous() if cfg.do_center_crop else arr


def crop_on_device(pixels: torch.Tensor, cfg: ImageProcessorConfig) -> torch.Tensor:
    """`crop` of a decoded RGB picture [h, w, 3] uint8 on its device (Pillow's resize, resample.py)."""
    size = resized_size(pixels.shape[1], pixels.shape[0], cfg)
    pixels = resample.resize(pixels, *size, cfg.resample)
    return _center_crop(pixels, cfg.crop_hw) if cfg.do_center_crop else pixels


def _rescaled(pixels: torch.Tensor, cfg: ImageProcessorConfig) -> torch.Tensor:
    """uint8 [..., 3] -> float32 [..., 3] by transformers' arithmetic (rescale in float64, then float32)."""
    out = pixels.to(torch.float64) * cfg.rescale_factor if cfg.do_rescale else pixels.to(torch.float64)
    out = out.to(torch.float32)
    if cfg.do_normalize:
        mean = torch.tensor(cfg.mean, dtype=torch.float32, device=out.device)
        std = torch.tensor(cfg.std, dtype=torch.float32, device=out.device)
        out = (out - mean) / std
    return out


@functools.lru_cache(maxsize=16)
def _table(cfg: ImageProcessorConfig) -> np.ndarray:
    """[3, 256] float32: `_rescaled` of every value of each channel."""
    values = torch.arange(256, dtype=torch.uint8)[:, None].expand(256, 3)
    return _rescaled(values, cfg).T.contiguous().numpy()


def normalize(pixels: torch.Tensor, cfg: ImageProcessorConfig) -> torch.Tensor:
    """uint8 pixels [..., S, S, 3] -> float32 [..., 3, S, S], rescaled and normalised, on their device.

    The arithmetic is transformers' (rescale in float64, then float32), so the result is the
    processor's to the last bit or two on any device; the vision encoder runs it where the ViT
    runs, after a copy of a quarter of the bytes the float pixels would take. On the CPU (Qwen's
    patches, the CPU mesh) it looks each value up in a table of that arithmetic's 256 results a
    channel: the same bits, without a float64 pass over the picture.
    """
    if pixels.device.type == "cpu":
        table, values = _table(cfg), pixels.numpy()
        return torch.from_numpy(np.stack([table[c].take(values[..., c]) for c in range(3)], axis=-3))
    return _rescaled(pixels, cfg).movedim(-1, -3).contiguous()


def preprocess(img: Image.Image, cfg: ImageProcessorConfig) -> torch.Tensor:
    """PIL image -> pixels [3, S, S] float32: `crop`, then `normalize`."""
    return normalize(crop(img, cfg), cfg)
