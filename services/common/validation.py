"""Every request check, in one place: the gateway (the first line) and the services behind it
check what they consume with these same functions. INVALID_ARGUMENT names the field, the
value and the allowed range.

The command-line clients (`vlmesh generate`, `vlmesh bench`) check their flags against the
same limits before they send anything: `CliParser` and the argparse `type=` functions below.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Sequence

from services.common.errors import InvalidArgument
from services.common.sampling import Sampling
from vlmesh.v1 import common_pb2 as pb

MAX_PROMPT_CHARS = 100_000  # a prompt, or all text of a conversation
MAX_MESSAGES = 256
ROLES = ("system", "user", "assistant")
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_TEMPERATURE = 100.0
UINT32_MAX = 2**32 - 1  # SamplingParams.max_tokens
UINT64_MAX = 2**64 - 1  # SamplingParams.seed
API_KEY_ENV = "VLMESH_API_KEY"  # the clients' --api-key default


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


def check_conversation(prompt: str, messages: Sequence[pb.ChatMessage], n_images: int) -> str | list[dict]:
    """What the chat template renders: `prompt` (one user turn after the images), or `messages`
    as the template takes them ({"role", "content": [{"type": "text"|"image", ...}]}).

    Set one of the two. A conversation ends with a user message, puts images in user messages
    only, and has exactly one image part per image, in order.
    """
    if not messages:
        check_prompt(prompt)
        return prompt
    if prompt:
        raise InvalidArgument("set prompt or messages, not both")
    if len(messages) > MAX_MESSAGES:
        raise InvalidArgument(f"messages has {len(messages)} entries; the limit is {MAX_MESSAGES}")
    turns: list[dict] = []
    images = chars = 0
    for i, message in enumerate(messages):
        if message.role not in ROLES:
            raise InvalidArgument(f"messages[{i}].role {message.role!r} is not one of {', '.join(ROLES)}")
        content: list[dict] = []
        for j, part in enumerate(message.content):
            kind = part.WhichOneof("part")
            if kind == "text":
                chars += len(part.text.strip())
                content.append({"type": "text", "text": part.text})
            elif kind == "image" and part.image:
                if message.role != "user":
                    raise InvalidArgument(f"messages[{i}].content[{j}]: images go in user messages only")
                images += 1
                content.append({"type": "image"})
            else:
                raise InvalidArgument(f"messages[{i}].content[{j}] is empty: set text or image")
        if not content:
            raise InvalidArgument(f"messages[{i}] ({message.role}) has no content")
        turns.append({"role": message.role, "content": content})
    if turns[-1]["role"] != "user":
        last = turns[-1]["role"]
        raise InvalidArgument(f"messages must end with a user message, not {last!r}: the answer follows it")
    if images != n_images:
        raise InvalidArgument(f"messages have {images} image parts for {n_images} images; give one part per image")
    if chars == 0:
        raise InvalidArgument("messages have no text: ask something about the image")
    if chars > MAX_PROMPT_CHARS:
        raise InvalidArgument(f"messages have {chars} characters of text; the limit is {MAX_PROMPT_CHARS}")
    return turns


def check_sampling(p: pb.SamplingParams, max_context: int) -> Sampling:
    """Validate what a client sent; INVALID_ARGUMENT names the field and the allowed range."""
    max_tokens = p.max_tokens if p.HasField("max_tokens") else None
    if max_tokens is not None and not 1 <= max_tokens < max_context:
        # Only the value's own limits: how much room a prompt leaves is the llm's check (it tokenizes).
        raise InvalidArgument(
            f"sampling.max_tokens={max_tokens} is out of range: it must be at least 1 and below the model's "
            f"context of {max_context} tokens, or unset for the server's default"
        )
    temperature = p.temperature if p.HasField("temperature") else 0.0
    if not math.isfinite(temperature) or not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise InvalidArgument(
            f"sampling.temperature={temperature} is out of range: use 0 (greedy) to {MAX_TEMPERATURE:g}"
        )
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


# --- command-line values ---------------------------------------------------------------------


class CliParser(argparse.ArgumentParser):
    """argparse that reports a bad argument on one line, `PROG: error: argument --flag: why`, exit 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _range_text(lo: float, hi: float | None, lo_open: bool = False) -> str:
    if hi is None:
        return f"a number {'>' if lo_open else '>='} {lo:g}"
    return f"more than {lo:g} and at most {hi:g}" if lo_open else f"{lo:g} to {hi:g}"


def int_in(lo: int, hi: int | None = None, note: str = "") -> Callable[[str], int]:
    """An argparse `type=`: a whole number in [lo, hi]; the message names the range."""
    allowed = f"a whole number >= {lo}" if hi is None else f"a whole number from {lo} to {hi}"
    allowed += f" ({note})" if note else ""

    def whole_number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number: use {allowed}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{value} is out of range: use {allowed}")
        return value

    return whole_number


def float_in(lo: float, hi: float | None = None, *, lo_open: bool = False, note: str = "") -> Callable[[str], float]:
    """An argparse `type=`: a finite number above (lo_open) or from lo, up to hi."""
    allowed = _range_text(lo, hi, lo_open) + (f" ({note})" if note else "")

    def number(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number: use {allowed}") from None
        below = value <= lo if lo_open else value < lo
        if not math.isfinite(value) or below or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{text} is out of range: use {allowed}")
        return value

    return number


def prompt_text(text: str) -> str:
    """An argparse `type=` for a prompt: the gateway's check_prompt, before anything is sent."""
    try:
        check_prompt(text)
    except InvalidArgument as err:
        raise argparse.ArgumentTypeError(err.message) from None
    return text


def stop_text(text: str) -> str:
    """An argparse `type=` for one stop string (check_sampling's limit)."""
    if not 1 <= len(text) <= MAX_STOP_CHARS:
        raise argparse.ArgumentTypeError(f"a stop string has 1 to {MAX_STOP_CHARS} characters, not {len(text)}")
    return text


def api_key(text: str) -> str | None:
    """An argparse `type=` for --api-key: a metadata value (printable ASCII, no spaces). Never echoes it."""
    key = text.strip()
    if not key:
        return None
    if not all("!" <= c <= "~" for c in key):
        raise argparse.ArgumentTypeError(
            "the key (from --api-key or VLMESH_API_KEY) must be printable ASCII without spaces"
        )
    return key


def api_key_metadata(key: str | None) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata that carries an API key to a gateway with --tenants (none without a key)."""
    return (("authorization", f"Bearer {key}"),) if key else ()


def names_of(allowed: tuple[str, ...] | list[str], check: Callable[[str], None] | None = None):
    """A `type=` for a comma list of names from `allowed` (at least one); `check` vets each name."""

    def names(text: str) -> list[str]:
        out = [x.strip() for x in text.split(",") if x.strip()]
        if not out:
            raise argparse.ArgumentTypeError(f"{text!r}: give a comma list of {', '.join(allowed)}")
        for name in out:
            if name not in allowed:
                raise argparse.ArgumentTypeError(f"{name!r} is not one of {', '.join(allowed)}")
            if check is not None:
                check(name)
        return out

    return names


def device_name(text: str) -> str:
    """A `type=` for --device: auto, cpu, cuda or cuda:N (whether CUDA is there is checked where it is used)."""
    if re.fullmatch(r"auto|cpu|cuda(:\d+)?", text) is None:
        raise argparse.ArgumentTypeError(f"{text!r}: use cpu, cuda, cuda:N or auto")
    return text


def numbers(kind: type, allowed: str, *, positive: bool = True, count: int | None = None, empty: bool = False):
    """A `type=` for a comma list of numbers (> 0, or >= 0), of `count` items when given."""

    def parse(text: str) -> list:
        parts = [x.strip() for x in text.split(",") if x.strip()]
        out = []
        for part in parts:
            try:
                value = kind(part)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{part!r} is not a number: use {allowed}") from None
            if not (value > 0 if positive else value >= 0) or value != value or value == float("inf"):
                raise argparse.ArgumentTypeError(f"{part} is out of range: use {allowed}")
            out.append(value)
        if (not out and not empty) or (count is not None and len(out) != count):
            raise argparse.ArgumentTypeError(f"{text!r}: use {allowed}")
        if count is not None and sum(out) <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: the shares add up to 0; use {allowed}")
        return out

    return parse
