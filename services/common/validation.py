"""Every request check, in one place: the gateway (the first line) and the services behind it
check what they consume with these same functions. INVALID_ARGUMENT names the field, the
value and the allowed range.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from services.common.errors import InvalidArgument
from services.common.sampling import Sampling
from vlmesh.v1 import common_pb2 as pb

MAX_PROMPT_CHARS = 100_000
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


def check_images(images: Sequence[pb.Image], max_images: int | None = None) -> None:
    """At least one image, each with bytes and, if given, an image/* mime type."""
    if not images:
        raise InvalidArgument("images: one image is required")
    if max_images is not None and len(images) > max_images:
        raise InvalidArgument(f"images: {len(images)} given, the served model takes at most {max_images}")
    for i, image in enumerate(images):
        if not image.data:
            raise InvalidArgument(f"images[{i}].data is empty")
        if image.mime_type and not image.mime_type.lower().startswith("image/"):
            raise InvalidArgument(f"images[{i}].mime_type {image.mime_type!r} is not an image/* type")


def check_prompt(prompt: str) -> None:
    if not prompt.strip():
        raise InvalidArgument("prompt is empty: ask something about the image")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise InvalidArgument(f"prompt has {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}")


def check_sampling(p: pb.SamplingParams, max_context: int) -> Sampling:
    """Validate what a client sent; INVALID_ARGUMENT names the field and the allowed range."""
    max_tokens = p.max_tokens if p.HasField("max_tokens") else None
    if max_tokens is not None and not 1 <= max_tokens < max_context:
        raise InvalidArgument(
            f"sampling.max_tokens={max_tokens} is out of range: use 1..{max_context - 1} "
            f"(the model's context is {max_context} tokens, prompt included), or leave it unset"
        )
    temperature = p.temperature if p.HasField("temperature") else 0.0
    if not math.isfinite(temperature) or not 0.0 <= temperature <= 100.0:
        raise InvalidArgument(f"sampling.temperature={temperature} is out of range: use 0 (greedy) to 100")
    top_p = p.top_p if p.HasField("top_p") else 1.0
    if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise InvalidArgument(f"sampling.top_p={top_p} is out of range: use a value in (0, 1]")
    if len(p.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"sampling.stop has {len(p.stop)} strings; at most {MAX_STOP_STRINGS}")
    for i, s in enumerate(p.stop):
        if not s or len(s) > MAX_STOP_CHARS:
            raise InvalidArgument(f"sampling.stop[{i}] must be 1..{MAX_STOP_CHARS} characters")
    if max_tokens is not None and p.min_tokens > max_tokens:
        raise InvalidArgument(f"sampling.min_tokens={p.min_tokens} exceeds max_tokens={max_tokens}")
    return Sampling(
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        seed=p.seed if p.HasField("seed") else None,
        stop=tuple(p.stop),
        min_tokens=p.min_tokens,
        ignore_eos=p.ignore_eos,
    )
