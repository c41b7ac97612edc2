"""The family's tower(s) and projector, loaded from the checkpoint, with its preprocessing."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from PIL import Image

from services.common.config import resolve_device
from services.common.errors import InvalidArgument
from services.model.checkpoint import load_vision_tower
from services.model.family import family_of
from services.model.preprocess import decode_image
from services.model.spec import ModelSpec, resolve_dtype
from services.vision.graphs import GraphedTower, GridGraphs

log = logging.getLogger(__name__)

# One picture's pixels (CPU, uint8 [h, w, 3]): one per tower input, or the picture as decoded.
Pixels = tuple[torch.Tensor, ...]

# Where pictures take tokens by their size, an arena page holds this many (a 112x112 picture of
# Qwen2.5-VL's): a picture leaves less than a page unused, and the arena counts pages not pictures.
PAGE_TOKENS = 16


class VisionEncoder:
    def __init__(
        self, spec: ModelSpec, device: str, dtype: str, graphs_up_to: int = 0, gpu_resize: bool = True
    ) -> None:
        """`graphs_up_to`: on CUDA, capture the tower in CUDA graphs for batches up to this many (0: eager).
        `gpu_resize`: on CUDA, resize pictures there (Pillow's arithmetic) rather than with Pillow."""
        self.spec = spec
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.tower = load_vision_tower(spec, self.device, self.dtype)
        resize_on = self.device if gpu_resize and self.device.type == "cuda" else None
        self.processor = family_of(spec).image_processor(spec, resize_on)
        self.graphed: GraphedTower | None = None
        self.grid_graphs: GridGraphs | None = None  # pictures that take tokens by their size
        if graphs_up_to and self.device.type == "cuda":
            if spec.image_grid:
                self.grid_graphs = GridGraphs(self.tower)
            else:
                shapes = self.tower.input_shapes()  # type: ignore[operator]
                out = (spec.image_tokens, spec.text.hidden)
                self.graphed = GraphedTower(self.tower, graphs_up_to, shapes, out, self.dtype).capture()
        runs = "eager"
        if self.grid_graphs is not None:
            runs = "in a CUDA graph per batch of picture grids, each captured the second time its grids come"
        elif self.graphed is not None:
            runs = f"in CUDA graphs for batches {self.graphed.buckets}"
        log.info(
            "vision tower loaded: %s, %d image tokens x %d, %s on %s, %s, pictures resized %s",
            spec.family,
            spec.image_tokens,
            spec.text.hidden,
            self.dtype,
            self.device,
            runs,
            "by Pillow" if self.processor.resize_on is None else f"on {self.device}",
        )

    def check_max_pixels(self, max_pixels: int, name: str) -> None:
        """INVALID_ARGUMENT unless `max_pixels` is 0 or a size this model can read a picture at."""
        if not max_pixels:
            return
        if not self.spec.image_grid:
            raise InvalidArgument(
                f"{name}.max_pixels: {self.spec.model_id} ({self.spec.family}) reads every picture at one size; "
                "leave it 0"
            )
        self.processor.limited(max_pixels, name)  # type: ignore[attr-defined]

    def pixels(self, data: bytes, name: str = "image data", max_pixels: int = 0) -> Pixels:
        """Image bytes -> the family's pixels (CPU, uint8: resized, or as decoded where the resize
        runs on the device); `max_pixels` (0: the model's) lowers a grid family's limit.
        Raises InvalidArgument naming `name`."""
        img: Image.Image = decode_image(data, name=name)
        if not max_pixels:
            return self.processor.pixels(img, name)
        if not self.spec.image_grid:
            self.check_max_pixels(max_pixels, name)  # refused: the model reads every picture at one size
        return self.processor.pixels(img, name, max_pixels)  # type: ignore[call-arg]  # checks its range

    @torch.inference_mode()
    def encode(self, batch: Sequence[Pixels]) -> torch.Tensor | list[torch.Tensor]:
        """Pictures' pixels -> features on the encoder's device: [B, image_tokens, H], or where
        pictures take positions by their size (`spec.image_grid`) one [rows, cols, H] each.

        The pixels cross to the device as uint8 and are normalised there (a quarter of the bytes
        of float32 pixels, and no float work on the preprocessing threads).
        """
        inputs = self.processor.tower_inputs(batch, self.device)  # [B, 3, S, S] per input, or patches and grids
        x = [p.to(self.dtype) if p.is_floating_point() else p for p in inputs]
        if self.spec.image_grid:
            graphs = self.grid_graphs
            return self.tower.pictures(*x) if graphs is None else graphs.pictures(*x)  # type: ignore[operator]
        if self.graphed is not None and len(batch) <= self.graphed.max_batch:
            return self.graphed(*x)
        return self.tower(*x)

    @property
    def feature_bytes(self) -> int:
        """The largest picture's features."""
        return self.spec.image_tokens * self._token_bytes

    @property
    def page_bytes(self) -> int:
        """One page of the feature arenas: a whole picture's features where every picture takes
        `image_tokens`, else PAGE_TOKENS' worth (a picture takes a run of pages)."""
        tokens = min(self.spec.image_tokens, PAGE_TOKENS) if self.spec.image_grid else self.spec.image_tokens
        return tokens * self._token_bytes

    @property
    def _token_bytes(self) -> int:
        return self.spec.text.hidden * torch.empty((), dtype=self.dtype).element_size()
