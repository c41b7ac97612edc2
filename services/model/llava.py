"""LLaVA-1.5 (`model_type` llava): a CLIP ViT read at one hidden layer, a 2-layer MLP projector.

Key layouts seen in the wild (ARCHITECTURE.md): transformers 5.x saves `vision_tower.embeddings.*`
and `multi_modal_projector.*`; published LLaVA-1.5 uses `vision_tower.vision_model.*`;
transformers 4.5x in-memory names prefix both with `model.`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from torch import nn

from services.common.errors import InvalidArgument
from services.model import resample
from services.model.clip import VisionTower
from services.model.family import rename_key
from services.model.preprocess import ImageProcessorConfig, crop, crop_on_device, normalize, resized_size, rgb_tensor
from services.model.spec import ModelSpec, VisionSpec, text_spec


@dataclass(frozen=True)
class LlavaVision:
    vit: VisionSpec
    projector_act: str
    projector_bias: bool


_VISION_KEYS = [
    (re.compile(r"^(?:model\.)?vision_tower\.(?:vision_model\.)?(.*)$"), r"\1"),
    (re.compile(r"^(?:model\.)?multi_modal_projector\.(.*)$"), r"multi_modal_projector.\1"),
]


class ClipProcessor:
    """CLIPImageProcessor's resize, center crop and normalisation (services/model/preprocess.py)."""

    def __init__(self, cfg: ImageProcessorConfig, resize_on: torch.device | None = None) -> None:
        self.cfg = cfg
        self.resize_on = resize_on if resize_on is not None and resample.supported(cfg.resample) else None

    def pixels(self, img: Image.Image, name: str) -> tuple[torch.Tensor, ...]:
        if self.resize_on is None:
            return (crop(img, self.cfg, name=name),)
        resized_size(img.width, img.height, self.cfg, name=name)  # refuse a sliver here, naming the picture
        return (rgb_tensor(img if img.mode == "RGB" else img.convert("RGB")),)

    def tower_inputs(self, batch: Sequence[tuple[torch.Tensor, ...]], device: torch.device) -> tuple[torch.Tensor, ...]:
        if self.resize_on is None:
            stacked = torch.stack([p[0] for p in batch]).to(device, non_blocking=True)
        else:
            stacked = torch.stack([crop_on_device(p[0].to(device, non_blocking=True), self.cfg) for p in batch])
        return (normalize(stacked, self.cfg),)

    def salt(self) -> tuple:
        return dataclasses.astuple(self.cfg)


class Llava:
    name = "llava"
    model_types = ("llava",)

    def read_spec(self, path: Path, cfg: object, model_id: str) -> ModelSpec:
        where = f"{path}/config.json"
        vc = cfg.vision_config  # type: ignore[attr-defined]
        if vc.model_type != "clip_vision_model":
            raise InvalidArgument(f"{where}: vision_config.model_type {vc.model_type!r} is not supported (CLIP only)")
        feature_layer = cfg.vision_feature_layer  # type: ignore[attr-defined]
        if not isinstance(feature_layer, int):
            raise InvalidArgument(f"{where}: vision_feature_layer={feature_layer!r}: only one layer is supported")
        layers_used = feature_layer if feature_layer >= 0 else vc.num_hidden_layers + 1 + feature_layer
        if not 0 <= layers_used <= vc.num_hidden_layers:
            raise InvalidArgument(f"{where}: vision_feature_layer={feature_layer} is outside the ViT")
        strategy = cfg.vision_feature_select_strategy  # type: ignore[attr-defined]
        if strategy not in ("default", "full"):
            raise InvalidArgument(f"{where}: vision_feature_select_strategy={strategy!r}")
        vit = VisionSpec.from_hf(vc, layers_used, keep_cls=strategy == "full")
        return ModelSpec(
            model_dir=path,
            model_id=model_id,
            family=self.name,
            text=text_spec(path, cfg),
            image_token_id=cfg.image_token_index,  # type: ignore[attr-defined]
            placeholder="<image>",
            image_tokens=vit.image_tokens,
            vision=LlavaVision(
                vit=vit,
                projector_act=cfg.projector_hidden_act,  # type: ignore[attr-defined]
                projector_bias=getattr(cfg, "multimodal_projector_bias", True),
            ),
            hf_config=cfg,
        )

    def vision_key(self, key: str) -> str | None:
        return rename_key(_VISION_KEYS, key)

    def build_tower(self, spec: ModelSpec) -> nn.Module:
        return VisionTower(spec)

    def prepare_tower(self, tower: nn.Module) -> None:
        tower.fuse_projections()  # type: ignore[operator]

    def image_processor(self, spec: ModelSpec, resize_on: torch.device | None = None) -> ClipProcessor:
        image_size = spec.vision.vit.image_size  # type: ignore[attr-defined]
        return ClipProcessor(ImageProcessorConfig.load(spec.model_dir, image_size), resize_on)

    def write_tiny(self, out_dir: Path, seed: int) -> Path:
        from services.model.tiny import build_tiny_llava

        return build_tiny_llava(out_dir, seed=seed)

    def write_preset(self, out_dir: Path, name: str) -> None:
        from transformers import CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig

        from services.model.presets import PRESETS
        from services.model.tiny import build_tokenizer

        preset = PRESETS[name]
        tok = build_tokenizer(out_dir, vocab_size=1000)
        vision = CLIPVisionConfig(**preset["vision"])
        LlavaConfig(
            vision_config=vision,
            text_config=LlamaConfig(
                **preset["text"],
                bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            ),
            image_token_index=tok.convert_tokens_to_ids("<image>"),
            image_seq_length=(vision.image_size // vision.patch_size) ** 2,
            vision_feature_layer=-2,
            vision_feature_select_strategy="default",
        ).save_pretrained(out_dir)
        side = vision.image_size
        CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side}).save_pretrained(
            out_dir
        )


LLAVA = Llava()
