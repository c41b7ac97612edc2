"""One exception hierarchy for the mesh, and the one place it maps to gRPC statuses and back,
and from them to HTTP statuses (the gateway's OpenAI-compatible door).

Code anywhere raises a `MeshError` subclass; `abort` (called by the servicer wrappers in
services/common/rpc.py) turns it into the matching status, and `from_rpc_error` turns a
downstream status back into an error. Any other exception becomes INTERNAL with its
traceback logged, and the server keeps serving.
"""

from __future__ import annotations

import logging
import math
import re

import grpc

log = logging.getLogger(__name__)


class MeshError(Exception):
    """Base of every error the mesh reports to a caller."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    reason: str | None = None  # why it was refused, for metrics (e.g. "queue_full"); None: from the code

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(MeshError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(MeshError):
    """A stale, forged, expired or released tensor reference."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class FeaturesNeeded(FailedPrecondition):
    """The llm was sent an image's content key alone (LlmGenerateRequest.cached_image_keys) and its
    prefix cache no longer holds that image's positions: the caller sends the features instead."""

    reason = "features_needed"

    def __init__(
        self, message: str = "the llm's prefix cache does not hold these images' positions: send their features"
    ):
        super().__init__(message)


class ResourceExhausted(MeshError):
    """Overload: the caller should retry after `retry_after_s`."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(f"{message} (retry after {format_delay(retry_after_s)})")
        self.retry_after_s = retry_after_s


def format_delay(seconds: float) -> str:
    """A delay for people: whole milliseconds below 1 s (never "0.0 s"), else seconds to 0.1 s.

    It rounds up (to 1 ms at least), so a client that waits as long as it says is not early.
    """
    ms = max(1, math.ceil(seconds * 1000 - 1e-6))
    if ms < 1000:
        return f"{ms} ms"
    return f"{math.ceil(seconds * 10 - 1e-6) / 10:.1f} s"


class Unauthenticated(MeshError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(MeshError):
    code = grpc.StatusCode.PERMISSION_DENIED


class NotFound(MeshError):
    code = grpc.StatusCode.NOT_FOUND


class Unavailable(MeshError):
    code = grpc.StatusCode.UNAVAILABLE


# Downstream statuses that describe the request, not the peer: they travel upstream as they are.
_PASS_THROUGH = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.INTERNAL,
    }
)


# The end of a ResourceExhausted message (format_delay): "(retry after 40 ms)", "(retry after 1.5 s)";
# also the older "(retry after 0.5s)" of peers that predate format_delay.
_RETRY_SUFFIX = re.compile(r" \(retry after ([0-9]+(?:\.[0-9]*)?) ?(ms|s)\)$")


def _retry_after(err: grpc.RpcError, details: str | None) -> float:
    """RetryInfo from the status details; else the delay our messages end with; else 1 s."""
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    raw = next((v for k, v in trailing or () if k == "grpc-status-details-bin"), None)
    if raw:
        try:
            from google.rpc import error_details_pb2, status_pb2

            for detail in status_pb2.Status.FromString(raw).details:
                if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                    info = error_details_pb2.RetryInfo()
                    detail.Unpack(info)
                    return info.retry_delay.ToNanoseconds() / 1e9
        except Exception:  # a malformed detail: fall back to the message
            pass
    found = _RETRY_SUFFIX.search(details or "")
    if not found:
        return 1.0
    value = float(found.group(1))
    return value / 1000 if found.group(2) == "ms" else value


def from_rpc_error(err: grpc.RpcError, peer: str) -> MeshError:
    """Carry a downstream status upstream.

    Statuses about the request keep their code and message; a peer that is down or
    answers oddly becomes UNAVAILABLE, naming the peer.
    """
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # keep when to retry
        message = _RETRY_SUFFIX.sub("", details or f"{peer}: {code.name}")
        return ResourceExhausted(message, retry_after_s=_retry_after(err, details))
    if code in _PASS_THROUGH:
        out = MeshError(details or f"{peer}: {code.name}")
        out.code = code
        return out
    return Unavailable(f"{peer} failed with {code.name}: {details}")


# gRPC status -> HTTP status, as grpc-gateway and Envoy's grpc_json_transcoder map them (499: the
# client closed the request). Anything not listed is 500.
HTTP_STATUS = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def http_status(code: grpc.StatusCode) -> int:
    """The HTTP status for a gRPC status code."""
    return HTTP_STATUS.get(code, 500)


async def abort(context: grpc.aio.ServicerContext, err: BaseException, method: str) -> None:
    """End the RPC with the status `err` maps to (RetryInfo for overload); any other exception is INTERNAL."""
    if isinstance(err, ResourceExhausted):
        # Clients and proxies read when to retry from google.rpc RetryInfo in the status details.
        try:
            from google.protobuf import duration_pb2
            from google.rpc import code_pb2, error_details_pb2, status_pb2
            from grpc_status import rpc_status
        except ImportError:  # a host without grpcio-status: the message still says when
            await context.abort(err.code, err.message)
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(err.retry_after_s * 1e9))
        detail = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=err.message)
        detail.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        await context.abort_with_status(rpc_status.to_status(detail))
    if isinstance(err, MeshError):
        if err.code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE):
            log.warning("%s failed: %s: %s", method, err.code.name, err.message)
        await context.abort(err.code, err.message)
    log.exception("%s: unexpected error", method, exc_info=err)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(err).__name__}: {err}")
