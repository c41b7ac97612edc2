"""The OpenAI-compatible HTTP routes: /v1/chat/completions, /v1/models, /health. (Metrics are on
the gateway's --metrics-port alone: one /metrics per process, so a scrape counts each request once.)

A chat request goes through the gRPC servicer's own path (`GatewayServicer.run`: tenants,
qos-level, admission, vision, llm), with an `HttpCall` standing in for the gRPC context:
the HTTP headers are its metadata (`authorization: Bearer KEY`, `qos-level`,
`x-model-variant`). So both doors share every check, metric and trace, and differ only in
their wire format.

Each request runs in its own task, which owns its trace's root span (the HTTP one) and puts
what it gets on a queue: the route waits for the first item, so that a refusal (401, 429,
400 for a bad image) is a real HTTP status, not an error inside a 200 stream. A client that
disconnects cancels that task, which cancels the llm call as a gRPC cancel does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Mapping

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.common import metrics, telemetry
from services.common.config import DEGRADED_METADATA_KEY, VARIANT_METADATA_KEY
from services.common.errors import MeshError, ResourceExhausted, http_status
from services.gateway.config import HttpConfig
from services.gateway.http.errors import error_body, in_openai_terms, name_the_image
from services.gateway.http.images import ImageFetcher
from services.gateway.http.wire import Completion, image_urls, parse_request, to_generate
from services.gateway.readiness import Readiness
from services.gateway.servicer import GatewayServicer

log = logging.getLogger(__name__)

METHOD = "ChatCompletions"  # in the access log and vlmesh_requests_total
_END = object()


class HttpCall:
    """A `CallContext` (what `GatewayServicer.run` reads of a gRPC context) for a request that came
    over HTTP; `code` too, which the access log asks of a gRPC context."""

    def __init__(self, headers: Mapping[str, str]) -> None:
        self._metadata = tuple(headers.items())  # names are lowercase, as in gRPC metadata
        self.initial_metadata: tuple[tuple[str, str], ...] = ()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None  # HTTP carries no deadline: the client ends a request by disconnecting

    async def send_initial_metadata(self, metadata) -> None:
        self.initial_metadata = tuple(metadata)

    def code(self) -> None:
        return None


def error_response(err: MeshError) -> JSONResponse:
    """The OpenAI-shaped error for a mesh error, with its HTTP status (429: Retry-After too)."""
    status = http_status(err.code)
    body = error_body(err.message, err.reason or err.code.name.lower(), status, getattr(err, "param", None))
    headers = {}
    if isinstance(err, ResourceExhausted):
        headers["retry-after"] = str(max(1, math.ceil(err.retry_after_s)))
    return JSONResponse(body, status_code=status, headers=headers)


def _sse(payload: dict | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, separators=(',', ':'))}\n\n".encode()


class OpenAiApi:
    """The routes, over one GatewayServicer."""

    def __init__(self, servicer: GatewayServicer, cfg: HttpConfig, readiness: Readiness | None = None) -> None:
        self.servicer = servicer
        self.readiness = readiness  # /health says 503 while no worker can serve
        self.images = ImageFetcher(cfg)
        self.serving = True  # False once the gateway drains: /health says 503
        self.started = int(time.time())
        self._tasks: set[asyncio.Task] = set()
        app = self.app = FastAPI(title="vlmesh", summary="OpenAI-compatible chat completions with images")
        app.add_api_route("/v1/chat/completions", self.chat, methods=["POST"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["GET"])

    async def health(self) -> Response:
        """200 while the gateway can serve; 503 while it drains or no worker answers (routers stop sending)."""
        if not self.serving:
            return JSONResponse({"status": "draining"}, status_code=503)
        if self.readiness is not None and not self.readiness.ready:
            return JSONResponse({"status": "no worker reachable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(self) -> Response:
        try:
            info = await self.servicer.llm_info()
        except MeshError as err:
            return error_response(err)
        model = {
            "id": info.model_id,
            "object": "model",
            "created": self.started,
            "owned_by": "vlmesh",
            "max_model_len": info.max_context,
            "variant": info.variant,  # this worker's; pin one with the x-model-variant header
        }
        return JSONResponse({"object": "list", "data": [model]})

    async def chat(self, request: Request) -> Response:
        body = await request.body()
        headers = dict(request.headers)
        events: asyncio.Queue = asyncio.Queue()
        task = asyncio.create_task(self._produce(body, headers, events))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            first = await events.get()
        except asyncio.CancelledError:
            task.cancel()
            raise
        if isinstance(first, MeshError):
            return error_response(first)
        req, call, head = first
        out_headers = {k: v for k, v in call.initial_metadata if k in (VARIANT_METADATA_KEY, DEGRADED_METADATA_KEY)}
        out_headers["x-request-id"] = head.request_id
        answer = Completion(head.request_id, req.model or (await self.servicer.llm_info()).model_id)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            stream = self._stream(answer, head, events, task, include_usage)
            return StreamingResponse(stream, media_type="text/event-stream", headers=out_headers)
        return await self._whole(request, answer, head, events, task, out_headers, req.return_token_ids)

    async def _produce(self, body: bytes, headers: dict[str, str], events: asyncio.Queue) -> None:
        """Run one request through the servicer; put (request, call, first message), then each
        message, then _END on the queue, or a MeshError where it fails."""
        call = HttpCall(headers)
        code = "OK"
        with telemetry.server_span("POST /v1/chat/completions", headers, {"http.request.method": "POST"}) as span:
            try:
                with self.servicer.access.request(METHOD, call) as entry:  # type: ignore[arg-type]
                    if self.servicer.tenants is not None:  # who asks, before any image is fetched
                        self.servicer.tenants.authenticate(call.invocation_metadata())
                    req = parse_request(body)
                    urls = image_urls(req)
                    images = [await self.images.image(url, where) for where, url, _ in urls]
                    for image, (_, _, max_pixels) in zip(images, urls, strict=True):
                        image.max_pixels = max_pixels
                    generate = to_generate(req, images, headers.get("x-request-id", ""))
                    first = True
                    try:
                        async with contextlib.aclosing(self.servicer.run(generate, call, entry)) as msgs:
                            async for msg in msgs:
                                entry.relayed(msg)
                                events.put_nowait((req, call, msg) if first else msg)
                                first = False
                    except MeshError as err:
                        raise name_the_image(err, [where for where, _, _ in urls]) from None
                events.put_nowait(_END)
            except MeshError as err:
                code = err.code.name
                events.put_nowait(in_openai_terms(err))
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            except Exception as err:  # a bug: INTERNAL, as services/common/rpc.py makes it for gRPC
                log.exception("%s: unexpected error", METHOD)
                code = "INTERNAL"
                internal = MeshError(f"internal error in {METHOD}: {type(err).__name__}: {err}")
                events.put_nowait(internal)
            finally:
                metrics.REQUESTS.labels("gateway", METHOD, code).inc()
                telemetry.annotate({"http.response.status_code": http_status_of(code)}, span)

    async def _whole(
        self, request: Request, answer: Completion, head, events, task, headers, with_ids: bool
    ) -> Response:
        """Collect the answer; a client that disconnects first cancels the request."""
        watcher = asyncio.create_task(_cancel_on_disconnect(request, task))
        try:
            texts, ids, msg = [head.text], list(head.token_ids), head
            while (item := await events.get()) is not _END:
                if isinstance(item, MeshError):
                    return error_response(item)
                texts.append(item.text)
                ids += item.token_ids
                msg = item
            body = answer.whole("".join(texts), msg.finish_reason, msg.usage, ids if with_ids else None)
            return JSONResponse(body, headers=headers)
        finally:
            watcher.cancel()

    async def _stream(self, answer: Completion, head, events, task, include_usage: bool) -> AsyncIterator[bytes]:
        """Server-sent events: a role chunk, content deltas, the finish, usage if asked, [DONE]."""
        try:
            yield _sse(answer.chunk({"role": "assistant", "content": ""}))
            item = head
            while item is not _END:
                if isinstance(item, MeshError):  # after the 200: the error goes in the stream
                    status = http_status(item.code)
                    yield _sse(error_body(item.message, item.reason or item.code.name.lower(), status))
                    break
                if item.text:
                    yield _sse(answer.chunk({"content": item.text}))
                if item.finish_reason:
                    yield _sse(answer.chunk({}, item.finish_reason))
                    if include_usage:
                        yield _sse(answer.usage_chunk(item.usage))
                item = await events.get()
            yield _sse("[DONE]")
        finally:
            if not task.done():  # the client went away: cancel the request downstream
                task.cancel()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.images.close()


def http_status_of(code: str) -> int:
    return http_status(grpc.StatusCode[code])


async def _cancel_on_disconnect(request: Request, task: asyncio.Task) -> None:
    """Cancel `task` when the client disconnects (the body is read: the next message is the disconnect)."""
    while not task.done():
        message = await request.receive()
        if message["type"] == "http.disconnect":
            task.cancel()
            return
