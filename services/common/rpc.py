"""The servicer method wrappers: every RPC's errors become statuses (services/common/errors.py)
and every RPC is counted by its final status (vlmesh_requests_total).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from services.common.errors import MeshError, abort
from services.common.metrics import REQUESTS


def _count(fn, code: str) -> None:
    cls, _, method = fn.__qualname__.partition(".")
    REQUESTS.labels(cls.removesuffix("Servicer").lower(), method, code).inc()


def _code(err: BaseException) -> str:
    return err.code.name if isinstance(err, MeshError) else "INTERNAL"


Req = TypeVar("Req")
Resp = TypeVar("Resp")


def unary(fn: Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]):
    """Wrap a unary servicer method so that errors map to statuses in one place."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        try:
            out = await fn(self, request, context)
        except asyncio.CancelledError:
            _count(fn, "CANCELLED")
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as err:
            _count(fn, _code(err))
            await abort(context, err, fn.__qualname__)
            raise  # unreachable: abort raises
        _count(fn, "OK")
        return out

    return wrapper


def stream(fn: Callable[[Any, Req, grpc.aio.ServicerContext], AsyncIterator[Resp]]):
    """Wrap a server-streaming servicer method; errors map to statuses as in `unary`."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext) -> AsyncIterator[Resp]:
        try:
            # aclosing: a cancelled RPC closes the inner generator now, so its
            # `finally` (engine abort, lease release) runs at once, not at GC.
            async with contextlib.aclosing(fn(self, request, context)) as items:
                async for item in items:
                    yield item
        except (asyncio.CancelledError, GeneratorExit):
            _count(fn, "CANCELLED")
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as err:
            _count(fn, _code(err))
            await abort(context, err, fn.__qualname__)
            return
        _count(fn, "OK")

    return wrapper
