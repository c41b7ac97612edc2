"""Requests whose bytes do not parse as their message: INVALID_ARGUMENT, not UNKNOWN.

grpc.aio answers a request its deserializer cannot parse with UNKNOWN ("Unexpected
DecodeError"): to a client that is a server fault. This interceptor gives every handler a
deserializer that returns the parse error instead of raising, and a behavior that turns it into
INVALID_ARGUMENT naming the message type, before the servicer runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import grpc


class _Undecodable:
    def __init__(self, message: str) -> None:
        self.message = message


def _safe(deserialize: Callable[[bytes], object], method: str) -> Callable[[bytes], object]:
    def parse(data: bytes) -> object:
        try:
            return deserialize(data)
        except Exception as err:  # DecodeError, or a field the message cannot hold
            return _Undecodable(f"{method}: the request ({len(data)} bytes) is not a valid message: {err}")

    return parse


async def _refuse(context: grpc.aio.ServicerContext, request: _Undecodable) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


def _unary_unary(behavior):
    async def handle(request, context):
        if isinstance(request, _Undecodable):
            await _refuse(context, request)
        return await behavior(request, context)

    return handle


def _unary_stream(behavior):
    if inspect.isasyncgenfunction(behavior):

        async def stream(request, context):
            if isinstance(request, _Undecodable):
                await _refuse(context, request)
            async for item in behavior(request, context):
                yield item

        return stream

    async def write(request, context):  # a behavior that writes through context.write
        if isinstance(request, _Undecodable):
            await _refuse(context, request)
        return await behavior(request, context)

    return write


class RefuseUndecodable(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        # method -> (its handler, the wrapped one): a registered handler is the same object on
        # every call, so it is wrapped once (another interceptor's per-call handlers miss).
        self._wrapped: dict[str, tuple[object, grpc.RpcMethodHandler]] = {}

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler
        cached = self._wrapped.get(details.method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        parse = _safe(handler.request_deserializer, details.method)
        if handler.unary_unary is not None:
            wrapped = grpc.unary_unary_rpc_method_handler(
                _unary_unary(handler.unary_unary), parse, handler.response_serializer
            )
        else:
            wrapped = grpc.unary_stream_rpc_method_handler(
                _unary_stream(handler.unary_stream), parse, handler.response_serializer
            )
        self._wrapped[details.method] = (handler, wrapped)
        return wrapped
