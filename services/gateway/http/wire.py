"""OpenAI's chat-completions wire format <-> vlmesh.v1 messages.

A request body is parsed into `ChatRequest` (pydantic), then into a `GenerateRequest` whose
`messages` carry the conversation and whose `images` carry the pictures, in the order of
their `image_url` parts. Fields that OpenAI defines and this server cannot honour (tools,
logprobs, n > 1, penalties) are refused with a 400 that names them, never silently dropped;
fields it does not define are ignored, as vLLM does, so that newer clients keep working.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from services.common.validation import UINT64_MAX
from services.gateway.http.errors import ParamError
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2

FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class ImageUrl(BaseModel):
    url: str
    detail: str | None = None  # accepted and ignored: a picture's size, not this hint, sets its tokens
    max_pixels: int | None = None  # vlmesh's: the picture read at no more pixels (pb.Image.max_pixels)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageUrl


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[Part] | None = None
    name: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatRequest(BaseModel):
    """The fields of POST /v1/chat/completions that this server reads."""

    model_config = ConfigDict(extra="ignore")
    messages: list[Message] = Field(min_length=1)
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions (extra_body in the openai client): generate at least min_tokens; go on past EOS.
    min_tokens: int = 0
    ignore_eos: bool = False
    return_token_ids: bool = False  # vLLM's too: the answer's token ids beside its text (not streamed)
    # Defined by OpenAI, refused unless neutral (see `unsupported`).
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        return [v] if isinstance(v, str) else v


PART_TYPES = ("text", "image_url")  # the tags of a content part (Part's discriminator)


def json_path(loc: Sequence[str | int]) -> str:
    """A field's place in the body as the gateway's messages write it: pydantic's ('messages', 0,
    'content', 'list[...]', 1, 'image_url', 'image_url') -> messages[0].content[1].image_url; the
    names pydantic gives a union's branches (a type, or a part's tag) are not places in the body."""
    out, previous = "", None
    for key in loc:
        branch = isinstance(key, str) and (
            "[" in key or key == "str" or (key in PART_TYPES and isinstance(previous, int))
        )
        previous = key
        if not branch:
            out += f"[{key}]" if isinstance(key, int) else f"{'.' if out else ''}{key}"
    return out


def parse_request(body: bytes) -> ChatRequest:
    """The request, or a ParamError naming the first field that is wrong."""
    try:
        req = ChatRequest.model_validate_json(body)
    except ValidationError as err:
        first = max(err.errors(), key=lambda e: len(e["loc"]))  # a union's deepest branch says most
        where = json_path(first["loc"]) or None
        raise ParamError(f"{where + ': ' if where else ''}{first['msg']}", where) from None
    for name, neutral in _NEUTRAL.items():
        value = getattr(req, name)
        if value not in neutral:
            shown = f" (got {value!r})" if isinstance(value, int | float | str) and len(repr(value)) <= 40 else ""
            raise ParamError(f"{name} is not supported by this server{shown}", name)
    both = req.max_tokens is not None and req.max_completion_tokens is not None
    if both and req.max_tokens != req.max_completion_tokens:
        raise ParamError("max_tokens and max_completion_tokens differ: set one", "max_completion_tokens")
    return req


# What an unsupported field may be: absent, or a value that changes nothing.
_NEUTRAL: dict[str, tuple] = {
    "n": (None, 1),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
}


def image_urls(req: ChatRequest) -> list[tuple[str, str, int]]:
    """(JSON path, URL, max_pixels or 0) of every image part, in order."""
    return [
        (f"messages[{i}].content[{j}].image_url.url", part.image_url.url, _max_pixels(part, i, j))
        for i, m in enumerate(req.messages)
        if isinstance(m.content, list)
        for j, part in enumerate(m.content)
        if isinstance(part, ImagePart)
    ]


def _max_pixels(part: ImagePart, i: int, j: int) -> int:
    value = part.image_url.max_pixels
    if value is None:
        return 0
    if not 0 <= value <= 2**32 - 1:
        where = f"messages[{i}].content[{j}].image_url.max_pixels"
        raise ParamError(f"{where}={value} is out of range: a number of pixels, or 0 for the model's", where)
    return value


def to_generate(req: ChatRequest, images: list[pb.Image], request_id: str) -> gateway_pb2.GenerateRequest:
    """The gRPC request for a parsed chat request and its fetched images (one per image part)."""
    messages = []
    for i, m in enumerate(req.messages):
        role = ROLES.get(m.role)
        if role is None:
            raise ParamError(
                f"messages[{i}].role {m.role!r} is not supported: use system, developer, user or assistant",
                f"messages[{i}].role",
            )
        if m.content is None:
            raise ParamError(f"messages[{i}].content is missing", f"messages[{i}].content")
        parts = m.content if isinstance(m.content, list) else [TextPart(type="text", text=m.content)]
        messages.append(
            pb.ChatMessage(
                role=role,
                content=[
                    pb.ContentPart(text=p.text) if isinstance(p, TextPart) else pb.ContentPart(image=True)
                    for p in parts
                ],
            )
        )
    if not 0 <= req.min_tokens <= 2**32 - 1:
        raise ParamError(f"min_tokens={req.min_tokens} is out of range", "min_tokens")
    sampling = pb.SamplingParams(stop=req.stop or [], min_tokens=req.min_tokens, ignore_eos=req.ignore_eos)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is not None:
        if max_tokens < 1:
            raise ParamError(f"max_tokens={max_tokens} must be at least 1", "max_tokens")
        sampling.max_tokens = min(max_tokens, 2**32 - 1)
    if req.temperature is not None:
        sampling.temperature = req.temperature
    if req.top_p is not None:
        sampling.top_p = req.top_p
    if req.seed is not None:
        if not 0 <= req.seed <= UINT64_MAX:
            raise ParamError(f"seed={req.seed} is out of range: use 0 to {UINT64_MAX}", "seed")
        sampling.seed = req.seed
    return gateway_pb2.GenerateRequest(
        request_id=request_id, images=images, messages=messages, sampling=sampling, model=req.model or ""
    )


def usage(u: pb.Usage) -> dict:
    """OpenAI's usage: image positions count as prompt tokens, as they do for OpenAI's models."""
    prompt = u.prompt_tokens + u.image_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": u.output_tokens,
        "total_tokens": prompt + u.output_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


class Completion:
    """The ids and stamps shared by one answer's chunks or its whole completion."""

    def __init__(self, request_id: str, model: str) -> None:
        self.id = f"chatcmpl-{request_id}"
        self.model = model
        self.created = int(time.time())

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, finish: int, u: pb.Usage, token_ids: list[int] | None = None) -> dict:
        choice: dict = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": FINISH.get(finish, "stop"),
            "logprobs": None,
        }
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return {**self._head("chat.completion"), "choices": [choice], "usage": usage(u)}

    def chunk(self, delta: dict, finish: int | None = None) -> dict:
        choice = {"index": 0, "delta": delta, "finish_reason": FINISH.get(finish) if finish else None, "logprobs": None}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def usage_chunk(self, u: pb.Usage) -> dict:
        return {**self._head("chat.completion.chunk"), "choices": [], "usage": usage(u)}
