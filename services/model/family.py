"""Model families: the one place that knows a checkpoint layout's vision side and prompt.

A family reads its config into a ModelSpec, names which checkpoint keys are its vision
weights, builds its tower(s) and projector, preprocesses a picture, and writes tiny random
checkpoints and production-shaped presets. Past the projector nothing branches on it: every
family's decoder is the Llama-like one in llama.py, and the llm, the hand-off, the caches,
QoS and tracing see only `ModelSpec.image_tokens` features of `text.hidden` per image.

Adding a family is one module that implements `Family` plus its entry in `_families()` and
`FAMILY_NAMES` (docs/DESIGN.md, "Model families").
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch
from PIL import Image
from torch import nn

from services.common.errors import InvalidArgument
from services.model.spec import ModelSpec

# Runs one layer of a tower: the vision service passes a compiled one (services/vision/graphs.py).
LayerFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def rename_key(rules: Sequence[tuple[re.Pattern, str]], key: str) -> str | None:
    """`key` renamed by the first (pattern, replacement) rule that matches it; None if none does."""
    for pattern, repl in rules:
        if pattern.match(key):
            return pattern.sub(repl, key)
    return None


def run_layer(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One transformer layer, x -> x (a function, to compile once for every layer of a kind)."""
    return layer(x)


class ImageProcessor(Protocol):
    """Picture -> the tower's inputs, as the checkpoint's transformers image processor computes them.

    The work splits in two so that only uint8 bytes cross to the tower's device: `pixels` (CPU,
    on the preprocessing threads) and `tower_inputs` (where the tower runs). Built with a
    `resize_on` device, a processor leaves its resizing (Pillow's arithmetic, resample.py) to
    `tower_inputs` on that device, and `pixels` hands over the decoded picture itself.
    """

    resize_on: torch.device | None  # where `tower_inputs` resizes; None: Pillow, in `pixels`

    def pixels(self, img: Image.Image, name: str) -> tuple[torch.Tensor, ...]:
        """One picture -> uint8 [h, w, 3] tensors (CPU): one per tower input, resized, or the
        decoded picture alone where the resize is left to `tower_inputs`.

        Raises InvalidArgument naming `name` ("images[0]") when the picture cannot be resized.
        """
        ...

    def tower_inputs(self, batch: Sequence[tuple[torch.Tensor, ...]], device: torch.device) -> tuple[torch.Tensor, ...]:
        """Pictures' `pixels` -> float32 [B, 3, S, S] per tower input, on `device`."""
        ...

    def salt(self) -> tuple:
        """Everything in the preprocessing that shapes the features (the feature cache's key)."""
        ...


class Tower(Protocol):
    """A family's vision side: pixels -> features [B, image_tokens, text hidden], on its device."""

    def input_shapes(self) -> list[tuple[int, ...]]:
        """The shape of each input for one picture ([3, S, S] each), for static graph buffers."""
        ...

    def __call__(self, *pixels: torch.Tensor, run_layer: LayerFn = run_layer) -> torch.Tensor: ...


class Family(Protocol):
    """One checkpoint layout (LLaVA, DeepSeek-VL, ...): everything that differs between them."""

    name: str
    model_types: tuple[str, ...]  # config.json model_type values this family reads

    def read_spec(self, path: Path, cfg: object, model_id: str) -> ModelSpec:
        """Validate the transformers config; InvalidArgument naming the file and the field."""
        ...

    def vision_key(self, key: str) -> str | None:
        """A checkpoint key's name in the tower module, or None for a key that is not vision's."""
        ...

    def build_tower(self, spec: ModelSpec) -> nn.Module:
        """The tower and projector (on whatever device is current: the loader uses meta)."""
        ...

    def prepare_tower(self, tower: nn.Module) -> None:
        """After loading: fuse what the checkpoint keeps apart (q/k/v) as the forward needs."""
        ...

    def image_processor(self, spec: ModelSpec, resize_on: torch.device | None = None) -> ImageProcessor:
        """The preprocessing the checkpoint's image processor settings describe; `resize_on`: resize
        on that device in `tower_inputs` rather than with Pillow in `pixels`."""
        ...

    def write_tiny(self, out_dir: Path, seed: int) -> Path:
        """A tiny random checkpoint transformers itself loads (tokenizer, chat template, processor)."""
        ...

    def write_preset(self, out_dir: Path, name: str) -> None:
        """A production-shaped preset's config, tokenizer and processor (no weights: presets.py)."""
        ...


# The families' names, which are also the model types they read (`make-tiny-model --family`).
FAMILY_NAMES = ("llava", "deepseek_vl", "deepseek_vl_hybrid", "qwen2_5_vl")


def _families() -> list[Family]:
    from services.model.deepseek_vl import DEEPSEEK_VL, DEEPSEEK_VL_HYBRID
    from services.model.llava import LLAVA
    from services.model.qwen2_5_vl import QWEN2_5_VL

    return [LLAVA, DEEPSEEK_VL, DEEPSEEK_VL_HYBRID, QWEN2_5_VL]


def model_types() -> list[str]:
    return [t for f in _families() for t in f.model_types]


def family_for(model_type: object, config: Path | str = "config.json") -> Family:
    """The family that reads `model_type`; InvalidArgument naming the file and the types served."""
    for family in _families():
        if model_type in family.model_types:
            return family
    raise InvalidArgument(
        f"{config}: model_type {model_type!r} is not one vlmesh serves (it serves {', '.join(model_types())})"
    )


def family_of(spec: ModelSpec) -> Family:
    return next(f for f in _families() if f.name == spec.family)


def family_named(name: str) -> Family:
    """A family by its name or one of its model types (`make-tiny-model --family`)."""
    key = name.replace("-", "_")
    for family in _families():
        if key == family.name or key in family.model_types:
            return family
    names = sorted({f.name for f in _families()} | set(model_types()))
    raise InvalidArgument(f"unknown family {name!r}: use one of {', '.join(names)}")
