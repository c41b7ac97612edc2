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

    The work splits in two so that only bytes a quarter the size of float pixels cross to the GPU:
    `pixels` (CPU, uint8, on the preprocessing threads) and `normalize` (where the tower runs).
    """

    def pixels(self, img: Image.Image, name: str) -> tuple[torch.Tensor, ...]:
        """One picture -> its resized pixels, one uint8 [S, S, 3] tensor per tower input (CPU).

        Raises InvalidArgument naming `name` ("images[0]") when the picture cannot be resized.
        """
        ...

    def normalize(self, batch: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Stacked uint8 pixels ([B, S, S, 3] per input) -> float32 [B, 3, S, S] per input, on their device."""
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

    def image_processor(self, spec: ModelSpec) -> ImageProcessor:
        """The preprocessing the checkpoint's image processor settings describe."""
        ...

    def write_tiny(self, out_dir: Path, seed: int) -> Path:
        """A tiny random checkpoint transformers itself loads (tokenizer, chat template, processor)."""
        ...

    def write_preset(self, out_dir: Path, name: str) -> None:
        """A production-shaped preset's config, tokenizer and processor (no weights: presets.py)."""
        ...


# The families' names, which are also the model types they read (`make-tiny-model --family`).
FAMILY_NAMES = ("llava", "deepseek_vl", "deepseek_vl_hybrid")


def _families() -> list[Family]:
    from services.model.deepseek_vl import DEEPSEEK_VL, DEEPSEEK_VL_HYBRID
    from services.model.llava import LLAVA

    return [LLAVA, DEEPSEEK_VL, DEEPSEEK_VL_HYBRID]


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
