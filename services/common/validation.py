"""Request checks shared by the gateway (first line) and the services behind it."""

from __future__ import annotations

from collections.abc import Sequence

from services.common.errors import InvalidArgument
from vlmesh.v1 import common_pb2 as pb

MAX_PROMPT_CHARS = 100_000


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
