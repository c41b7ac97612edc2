"""What the gateway's request path (`GatewayServicer.run`) reads of a call: the gRPC context, or a
stand-in for it (a unary call's held-back headers here, the HTTP door's `HttpCall`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import grpc


class CallContext(Protocol):
    """What `GatewayServicer.run` reads of a request's context: a gRPC ServicerContext, or the
    HTTP door's HttpCall."""

    def invocation_metadata(self) -> Sequence[tuple[str, str | bytes]] | None: ...

    def time_remaining(self) -> float | None: ...

    async def send_initial_metadata(self, metadata: Sequence[tuple[str, str]]) -> None: ...


class HeadersWithTheResult:
    """A unary call's context as `GatewayServicer.run` sees it: the initial metadata is held back
    and goes out with the result, so that a failure at any point before the result is a
    trailers-only response, which a router may retry on another variant (nothing reached the caller)."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        self.headers: Sequence[tuple[str, str]] | None = None

    def invocation_metadata(self) -> Sequence[tuple[str, str | bytes]] | None:
        return self._context.invocation_metadata()

    def time_remaining(self) -> float | None:
        return self._context.time_remaining()

    async def send_initial_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        self.headers = metadata
