"""What the gateway checks of a request before admission: the request alone, then against the served model."""

from __future__ import annotations

from collections.abc import Sequence

from services.common.config import MODEL_VARIANT_SEPARATOR, VARIANT_METADATA_KEY
from services.common.errors import InvalidArgument, NotFound
from services.common.qos import metadata_value
from services.common.sampling import Sampling
from services.common.validation import check_conversation, check_images, check_sampling
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2

MAX_REQUEST_ID_CHARS = 128


def check_request(request: gateway_pb2.GenerateRequest, max_images: int) -> None:
    """What the request alone shows (before anything is asked of the workers), or the MeshError."""
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
    check_images(request.images, max_images)
    check_conversation(request.prompt, request.messages, len(request.images))


class ModelNotFound(NotFound):
    """The request's `model` names no model (or variant) served here: OpenAI's 404 model_not_found."""

    reason = "model_not_found"
    param = "model"


def check_model(model: str, info: pb.ServiceInfo) -> None:
    """`model` empty, the served model's id, or MODEL:VARIANT naming this worker's variant; else
    ModelNotFound saying what is served."""
    if not model or model == info.model_id:
        return
    pinned = f"{info.model_id}{MODEL_VARIANT_SEPARATOR}{info.variant}"
    if model == pinned:
        return
    if model.startswith(f"{info.model_id}{MODEL_VARIANT_SEPARATOR}"):
        raise ModelNotFound(
            f"model {model!r}: that variant is not served here; this worker serves {pinned!r} "
            "(the mesh's router sends a pinned model to its variant)"
        )
    or_pinned = f" (or {pinned!r})" if info.variant else ""
    raise ModelNotFound(f"model {model!r} does not exist; this mesh serves {info.model_id!r}{or_pinned}")


def check_served(
    request: gateway_pb2.GenerateRequest, metadata: Sequence | None, info: pb.ServiceInfo
) -> tuple[Sampling, int]:
    """Against the served model: (the resolved sampling, the output tokens the request will generate
    at least), or the MeshError. At least: admission refuses only work that cannot finish in time,
    not work that might stop early at EOS."""
    check_model(request.model, info)
    pinned = metadata_value(metadata, VARIANT_METADATA_KEY)
    if pinned and pinned != info.variant:
        raise NotFound(
            f"{VARIANT_METADATA_KEY} {pinned!r} is not served here; this worker serves {info.variant!r} "
            "(the mesh's router sends a pinned request to its variant)"
        )
    sampling = check_sampling(request.sampling, info.max_context)
    at_least = (sampling.max_tokens or info.default_max_tokens) if sampling.ignore_eos else sampling.min_tokens
    return sampling, max(1, at_least)
