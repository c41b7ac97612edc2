"""The ViT + projector forward, loaded from the checkpoint, with its preprocessing."""

from __future__ import annotations

import logging

import torch
from PIL import Image

from services.common.config import resolve_device
from services.model.checkpoint import load_vision_tower
from services.model.preprocess import ImageProcessorConfig, crop, decode_image, normalize
from services.model.spec import LlavaSpec, resolve_dtype
from services.vision.graphs import GraphedTower

log = logging.getLogger(__name__)


class VisionEncoder:
    def __init__(self, spec: LlavaSpec, device: str, dtype: str, graphs_up_to: int = 0) -> None:
        """`graphs_up_to`: on CUDA, capture the tower in CUDA graphs for batches up to this many (0: eager)."""
        self.spec = spec
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.tower = load_vision_tower(spec, self.device, self.dtype)
        self.processor = ImageProcessorConfig.load(spec.model_dir, spec.vision.image_size)
        self.graphed: GraphedTower | None = None
        if graphs_up_to and self.device.type == "cuda":
            size, tokens, hidden = spec.vision.image_size, spec.image_tokens, spec.text.hidden
            self.graphed = GraphedTower(self.tower, graphs_up_to, size, tokens, hidden, self.dtype).capture()
        log.info(
            "vision tower loaded: %d of %d ViT layers, %d image tokens x %d, %s on %s, %s",
            spec.vision.layers_used,
            spec.vision.layers,
            spec.image_tokens,
            spec.text.hidden,
            self.dtype,
            self.device,
            "eager" if self.graphed is None else f"in CUDA graphs for batches {self.graphed.buckets}",
        )

    def pixels(self, data: bytes, name: str = "image data") -> torch.Tensor:
        """Image bytes -> resized, cropped pixels [S, S, 3] (CPU, uint8). Raises InvalidArgument naming `name`."""
        img: Image.Image = decode_image(data, name=name)
        return crop(img, self.processor, name=name)

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 pixels [B, S, S, 3] -> features [B, image_tokens, H] on the encoder's device.

        The pixels cross to the device as uint8 and are normalised there (a quarter of the bytes
        of float32 pixels, and no float work on the preprocessing threads).
        """
        x = normalize(pixels.to(self.device, non_blocking=True), self.processor)  # [B, 3, S, S] float32
        if self.graphed is not None and x.shape[0] <= self.graphed.max_batch:
            return self.graphed(x.to(self.dtype))
        return self.tower(x.to(self.dtype))

    @property
    def feature_bytes(self) -> int:
        return self.spec.image_tokens * self.spec.text.hidden * torch.empty((), dtype=self.dtype).element_size()
