"""Errors as OpenAI's clients read them: the error body's shape, and messages and `param` that
name the request's own fields (`max_tokens`, `messages[0].content[1]`, headers), where the
gateway's checks speak of the gRPC request (`sampling.max_tokens`, metadata)."""

from __future__ import annotations

import copy
import re

import grpc

from services.common.errors import InvalidArgument, MeshError


class ParamError(InvalidArgument):
    """A 400 about one request field: `param` goes in the error body."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


# The gateway's checks speak of the gRPC request (sampling.max_tokens) and its metadata.
_SAMPLING_FIELD = re.compile(r"sampling\.([a-z_]+)")
_MESSAGE_FIELD = re.compile(r"messages(?:\[\d+\](?:\.content\[\d+\])?(?:\.[a-z_]+)?)?(?![\w\[])")


def in_openai_terms(err: MeshError) -> MeshError:
    """`err` as an OpenAI client sees its request: fields by their names in the body (`max_tokens`,
    not `sampling.max_tokens`), named in `param` too, and HTTP headers where gRPC has metadata."""
    message = (
        err.message.replace("'authorization: ", "'Authorization: ")
        .replace("authorization metadata", "Authorization header")
        .replace("' metadata", "' header")
    )
    param = getattr(err, "param", None)
    if m := _SAMPLING_FIELD.match(message):
        message, param = message[len("sampling.") :], param or m.group(1)
    elif m := _MESSAGE_FIELD.match(message):
        param = param or m.group(0)
    if message == err.message and param == getattr(err, "param", None):
        return err
    if err.code == grpc.StatusCode.INVALID_ARGUMENT:
        return ParamError(message, param)
    out = copy.copy(err)
    out.message, out.args = message, (message,)
    return out


def name_the_image(err: MeshError, paths: list[str]) -> MeshError:
    """An INVALID_ARGUMENT about `images[i]` (the gateway's or the vision's), said of the image part
    it came from."""
    if err.code != grpc.StatusCode.INVALID_ARGUMENT:
        return err
    if err.message.startswith("images: "):  # about the images as a whole: count the image_url parts
        return ParamError(f"messages: {err.message.removeprefix('images: ')} (image_url parts)", "messages")
    if err.message.startswith("images[") and "]" in err.message:
        index = err.message[len("images[") : err.message.index("]")]
        if index.isdigit() and int(index) < len(paths):
            where = paths[int(index)]
            return ParamError(f"{where}: {err.message[err.message.index(']') + 1 :].lstrip()}", where)
    return err


def error_body(message: str, code: str, status: int, param: str | None = None) -> dict:
    """OpenAI's error shape."""
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "invalid_request_error",  # as OpenAI types model_not_found
        429: "rate_limit_error",
    }.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
