"""Qwen2.5-VL's vision side (`qwen2_5_vl`): pictures read at (close to) their own size.

A picture is resized to multiples of 28 px with its area inside [min_pixels, max_pixels]
(`smart_resize`), cut into 14-px patches (each repeated over the two frames that the Conv3d
patch embedding takes), and read by a ViT (services/model/qwen_vit.py) with 2-D rotary
positions whose layers attend within windows of `window_size` px, except the
`fullatt_block_indexes` layers, which see the whole picture; the merger folds each 2x2 block
of patches into one token of the decoder's width, so a picture of h x w px (after the resize) is
(h/28)(w/28) tokens. Several pictures travel packed
along one axis, each attending only to itself.

The decoder is Qwen2 (llama.py with q/k/v biases) with multimodal rotary positions
(services/model/mrope.py), which read each picture's grid: the tower hands its features on as
[rows, cols, H] (`ModelSpec.image_grid`).
Shapes: N patches of all pictures packed, D = ViT width, P = C*T*p*p values a patch, H = text width.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from torch import nn

from services.common.errors import InvalidArgument
from services.model import resample
from services.model.family import rename_key
from services.model.preprocess import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, image_processor_json, normalize, rgb_tensor
from services.model.qwen_vit import QwenVisionTower
from services.model.spec import ModelSpec, text_spec

PLACEHOLDER = "<|image_pad|>"

# --- preprocessing ---------------------------------------------------------------------------


@dataclass(frozen=True)
class QwenImageConfig:
    """Qwen2VLImageProcessor's settings (preprocessor_config.json)."""

    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    resample: int
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def load(cls, model_dir: Path) -> QwenImageConfig:
        path, raw = image_processor_json(model_dir)
        size = raw.get("size") or {}
        # As transformers reads it: min_pixels / max_pixels, where given, override the size's edges.
        cfg = cls(
            min_pixels=int(raw.get("min_pixels") or size.get("shortest_edge", 56 * 56)),
            max_pixels=int(raw.get("max_pixels") or size.get("longest_edge", 28 * 28 * 1280)),
            patch_size=int(raw.get("patch_size", 14)),
            temporal_patch_size=int(raw.get("temporal_patch_size", 2)),
            merge_size=int(raw.get("merge_size", 2)),
            resample=int(raw.get("resample", Image.Resampling.BICUBIC)),
            do_rescale=raw.get("do_rescale", True),
            rescale_factor=raw.get("rescale_factor", 1 / 255),
            do_normalize=raw.get("do_normalize", True),
            mean=tuple(raw.get("image_mean", OPENAI_CLIP_MEAN)),
            std=tuple(raw.get("image_std", OPENAI_CLIP_STD)),
        )
        if not raw.get("do_resize", True):
            raise InvalidArgument(f"{path}: do_resize must be true (pictures are resized to multiples of {cfg.factor})")
        if not 0 < cfg.min_pixels <= cfg.max_pixels:
            raise InvalidArgument(
                f"{path}: min_pixels {cfg.min_pixels} and max_pixels {cfg.max_pixels} must be 0 < min <= max"
            )
        return cfg


def smart_resize(height: int, width: int, cfg: QwenImageConfig, name: str = "image data") -> tuple[int, int]:
    """(height, width) rounded to multiples of `cfg.factor`, the area brought inside
    [min_pixels, max_pixels] keeping the aspect ratio, as Qwen2-VL's processor does."""
    factor = cfg.factor
    if max(height, width) / min(height, width) > 200:
        raise InvalidArgument(f"{name} is {width}x{height}: an aspect ratio over 200 is refused")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > cfg.max_pixels:
        beta = math.sqrt(height * width / cfg.max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < cfg.min_pixels:
        beta = math.sqrt(cfg.min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


class QwenProcessor:
    """Pictures -> packed patches [N, P] and their grids [n, 3] (t, h, w in patches)."""

    def __init__(self, cfg: QwenImageConfig, resize_on: torch.device | None = None) -> None:
        self.cfg = cfg
        self.resize_on = resize_on if resize_on is not None and resample.supported(cfg.resample) else None

    def limited(self, max_pixels: int, name: str) -> QwenImageConfig:
        """The settings with max_pixels lowered for one picture; INVALID_ARGUMENT naming `name` for a
        limit under min_pixels or over the model's."""
        if not self.cfg.min_pixels <= max_pixels <= self.cfg.max_pixels:
            raise InvalidArgument(
                f"{name}.max_pixels={max_pixels} is out of range: use {self.cfg.min_pixels} to {self.cfg.max_pixels} "
                "(the model's min_pixels and max_pixels), or 0 for the model's"
            )
        return dataclasses.replace(self.cfg, max_pixels=max_pixels)

    def pixels(self, img: Image.Image, name: str, max_pixels: int = 0) -> tuple[torch.Tensor, ...]:
        """-> the resized picture [h, w, 3]; with `resize_on`, the decoded one and the size [2] to
        resize it to there. `max_pixels` (0: the model's) lowers the limit for this picture."""
        if img.mode != "RGB":
            img = img.convert("RGB")
        h, w = smart_resize(img.height, img.width, self.limited(max_pixels, name) if max_pixels else self.cfg, name)
        if self.resize_on is not None:
            return rgb_tensor(img), torch.tensor([h, w])
        if (w, h) != img.size:
            img = img.resize((w, h), resample=self.cfg.resample)
        return (rgb_tensor(img),)

    def _patches(self, px: torch.Tensor) -> torch.Tensor:
        """uint8 [h, w, 3] (resized) -> [h/p * w/p, P], the patches in 2x2-merge order."""
        c, p, m, t = 3, self.cfg.patch_size, self.cfg.merge_size, self.cfg.temporal_patch_size
        x = normalize(px, self.cfg)  # [3, h, w] float32
        gh, gw = x.shape[1] // p, x.shape[2] // p
        x = x.reshape(c, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, p, p]
        x = x.unsqueeze(5).expand(*x.shape[:5], t, p, p)  # the picture is both frames of the patch
        return x.reshape(gh * gw, c * t * p * p)

    def tower_inputs(self, batch: Sequence[tuple[torch.Tensor, ...]], device: torch.device) -> tuple[torch.Tensor, ...]:
        """-> (patches [N, P] float32 on `device`, grid [n, 3] int64 on the host: the tower lays
        its windows out from it without a sync)."""
        patches, grids = [], []
        for px, *size in batch:
            px = px.to(device, non_blocking=True)
            if size:  # resized here, to the size `pixels` chose
                h, w = size[0].tolist()
                px = resample.resize(px, w, h, self.cfg.resample)
            patches.append(self._patches(px))
            grids.append((1, px.shape[0] // self.cfg.patch_size, px.shape[1] // self.cfg.patch_size))
        return torch.cat(patches), torch.tensor(grids, dtype=torch.long)

    def salt(self) -> tuple:
        return tuple(vars(self.cfg).values())


# --- the family ------------------------------------------------------------------------------

# transformers 5.x saves `model.visual.*`; the hub's checkpoints `visual.*`.
_VISION_KEYS = [(re.compile(r"^(?:model\.)?visual\.(.*)$"), r"\1")]


@dataclass(frozen=True)
class QwenVision:
    config: object  # transformers' Qwen2_5_VLVisionConfig
    images: QwenImageConfig


class Qwen25VL:
    name = "qwen2_5_vl"
    model_types = ("qwen2_5_vl",)

    def read_spec(self, path: Path, cfg: object, model_id: str) -> ModelSpec:
        where = f"{path}/config.json"
        vc = cfg.vision_config  # type: ignore[attr-defined]
        text = text_spec(path, cfg)
        if text.mrope_section is None:
            raise InvalidArgument(f"{where}: text_config.rope_parameters has no mrope_section (Qwen2.5-VL's M-RoPE)")
        if vc.out_hidden_size != text.hidden:
            raise InvalidArgument(
                f"{where}: vision_config.out_hidden_size {vc.out_hidden_size} differs from the decoder's {text.hidden}"
            )
        unit = vc.patch_size * vc.spatial_merge_size
        if vc.window_size % unit:
            raise InvalidArgument(f"{where}: vision_config.window_size {vc.window_size} is not a multiple of {unit}")
        images = QwenImageConfig.load(path)
        if images.patch_size != vc.patch_size or images.merge_size != vc.spatial_merge_size:
            raise InvalidArgument(
                f"{path}/preprocessor_config.json: patch_size {images.patch_size} / merge_size {images.merge_size} "
                f"differ from the vision tower's {vc.patch_size} / {vc.spatial_merge_size}"
            )
        return ModelSpec(
            model_dir=path,
            model_id=model_id,
            family=self.name,
            text=text,
            image_token_id=cfg.image_token_id,  # type: ignore[attr-defined]
            placeholder=PLACEHOLDER,
            image_tokens=images.max_pixels // (images.factor * images.factor),
            vision=QwenVision(config=vc, images=images),
            hf_config=cfg,
            image_grid=True,
        )

    def vision_key(self, key: str) -> str | None:
        return rename_key(_VISION_KEYS, key)

    def build_tower(self, spec: ModelSpec) -> nn.Module:
        return QwenVisionTower(spec.vision.config)  # type: ignore[attr-defined]

    def prepare_tower(self, tower: nn.Module) -> None:
        tower.fuse_projections()  # type: ignore[operator]

    def image_processor(self, spec: ModelSpec, resize_on: torch.device | None = None) -> QwenProcessor:
        return QwenProcessor(spec.vision.images, resize_on)  # type: ignore[attr-defined]

    def write_tiny(self, out_dir: Path, seed: int) -> Path:
        from services.model.tiny import build_tiny_qwen2_5_vl

        return build_tiny_qwen2_5_vl(out_dir, seed=seed)

    def write_preset(self, out_dir: Path, name: str) -> None:
        from services.model.tiny import write_qwen_preset

        write_qwen_preset(out_dir, name)


QWEN2_5_VL = Qwen25VL()
