"""vlmesh.v1.Gateway: validate, encode the image, stream the decode back.

The gateway is where a request's qos-level is checked and from where it, and the
remaining deadline, travel to every downstream call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from services.common import metrics, rpc, telemetry
from services.common.config import VARIANT_METADATA_KEY
from services.common.errors import MeshError, from_rpc_error
from services.common.logs import request_context
from services.common.qos import QosLevel, qos_from_metadata, qos_metadata
from services.common.sampling import Sampling
from services.common.server import INTERNAL_OPTIONS
from services.gateway.access_log import AccessLog, Entry
from services.gateway.admission import Admission, AdmissionConfig, Ticket
from services.gateway.checks import MAX_REQUEST_ID_CHARS, check_request, check_served
from services.gateway.context import CallContext, HeadersWithTheResult
from services.gateway.degrade import CheaperVariant, Degrader
from services.gateway.image_keys import ImageKeys
from services.gateway.relay import Ledger, NotCached, finish_response
from services.gateway.tenants import Tenant, TenantRegistry
from services.gateway.workers import Worker, Workers
from services.handoff.release import release_leases
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc, llm_pb2, vision_pb2

log = logging.getLogger(__name__)

# Refusals at admission, by status, for vlmesh_rejections_total (admission's own set their reason).
REFUSAL_REASONS = {
    grpc.StatusCode.UNAUTHENTICATED: "unauthenticated",
    grpc.StatusCode.PERMISSION_DENIED: "permission_denied",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "rate_limited",
    grpc.StatusCode.INVALID_ARGUMENT: "invalid_argument",
}


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(
        self,
        vision_target: str,
        llm_target: str,
        max_images: int,
        tenants: TenantRegistry | None = None,
        admission: AdmissionConfig | None = None,
        access_log: bool = True,
        peer_credentials: grpc.ChannelCredentials | None = None,  # mTLS to vision and llm (services/common/tls.py)
        breaker: tuple[int, float] = (5, 5.0),  # failures in a row, cool-down s (services/gateway/workers.py)
        degrade: tuple[str | None, str | None] = (None, None),  # cheaper variant: target, name (gateway/degrade.py)
        image_keys: ImageKeys | None = None,  # --skip-cached-encode's memo (default: on, IMAGE_KEY_CACHE)
    ) -> None:
        self.tenants = tenants
        self.access = AccessLog(access_log)
        self.admission = Admission(admission or AdmissionConfig())
        interceptors = telemetry.client_interceptors()  # W3C trace context into the metadata
        self.workers = Workers(vision_target, llm_target, peer_credentials, interceptors, INTERNAL_OPTIONS, *breaker)
        cheaper = CheaperVariant(*degrade, peer_credentials, interceptors) if degrade[0] else None
        self.degrade = Degrader(self.admission, cheaper)
        self.max_images = max_images
        self.image_keys = ImageKeys() if image_keys is None else image_keys
        self._background: set[asyncio.Task] = set()

    async def llm_info(self) -> pb.ServiceInfo:
        """The model and limits the workers serve (fetched once each)."""
        return await self.workers.llm_info()

    @rpc.unary
    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext):
        info = pb.ServiceInfo()
        info.CopyFrom(await self.llm_info())
        info.service = "gateway"
        return info

    async def run(self, request: gateway_pb2.GenerateRequest, context: CallContext, entry: Entry):
        """Yield GenerateResponse messages; the last one carries usage and timings. Both doors'
        path: the gRPC methods below, and the HTTP one (services/gateway/http/app.py)."""
        received = time.perf_counter()
        request_id = entry.request_id = request.request_id[:MAX_REQUEST_ID_CHARS] or uuid.uuid4().hex
        request_context(request_id)
        root = telemetry.current_span()  # the RPC's server span: the trace's root
        telemetry.annotate({"request.id": request_id}, root)
        with telemetry.span("gateway.admission") as span:
            qos, charged = None, None
            try:
                metadata_in = context.invocation_metadata()
                tenant = self.tenants.authenticate(metadata_in) if self.tenants else None
                tenant_id = entry.tenant_id = tenant.id if tenant else "anonymous"
                telemetry.annotate({"tenant.id": tenant_id}, root)
                request_context(request_id, tenant_id)
                qos = qos_from_metadata(metadata_in)
                entry.qos = qos.wire
                telemetry.annotate({"qos.level": qos.wire}, root)
                if tenant is not None and not tenant.internal:  # the warm-up is no tenant's usage
                    self.tenants.admit(tenant, qos, request.images)
                    charged = tenant  # refunded below if the request is refused after all
                check_request(request, self.max_images)
                info = await self.llm_info()
                sampling, min_output_tokens = check_served(request, metadata_in, info)
                cap = tenant.limits.get("degrade_max_tokens") if tenant else None
                admitted = self.degrade.admit(
                    qos,
                    context.time_remaining(),
                    min_output_tokens,
                    metadata_in,
                    cap,
                    sampling,
                    info.default_max_tokens,
                )
                ticket, sampling = admitted.ticket, admitted.sampling
            except MeshError as err:
                if charged is not None:
                    self.tenants.refund(charged)
                reason = err.reason or REFUSAL_REASONS.get(err.code, err.code.name.lower())
                level = qos.wire if qos is not None else "unknown"
                metrics.REJECTIONS.labels("gateway", level, reason).inc()
                telemetry.annotate({"admission.decision": "refused", "admission.reason": reason}, span)
                raise
            decision = "admitted" if ticket is not None and not admitted.headers else "degraded"
            telemetry.annotate({"admission.decision": decision}, span)
        if ticket is None:  # overloaded: relayed to the cheaper variant (services/gateway/degrade.py)
            try:
                async for out in self.degrade.cheaper.relay(request, metadata_in, context, qos, admitted.refusal):
                    yield out
            finally:
                if charged is not None:
                    self.tenants.done(charged)
            return
        worker = None
        try:
            worker = self.workers.pick()
            # The headers go out with the first answer, not before: a request that fails before it
            # ends as a gRPC trailers-only response, which a router may retry on another variant
            # (Envoy's retry_on `unavailable`); one that has streamed tokens is never retried.
            headers: tuple | None = ((VARIANT_METADATA_KEY, info.variant), *admitted.headers)
            telemetry.annotate(
                {
                    "model.id": info.model_id,
                    "model.variant": info.variant,
                    "gen_ai.request.model": info.model_id,
                    "gen_ai.request.max_tokens": sampling.max_tokens,
                    "gen_ai.request.temperature": sampling.temperature,
                }
            )
            # aclosing: a cancelled client closes the inner generator at once (llm call, leases).
            serve = self._serve(request, context, request_id, tenant, qos, sampling, worker, ticket, received)
            async with contextlib.aclosing(serve) as outputs:
                async for out in outputs:
                    if headers is not None:
                        await context.send_initial_metadata(headers)
                        headers = None
                    yield out
        finally:
            if worker is not None:
                self.workers.done(worker)
            if charged is not None:
                self.tenants.done(charged)
            self.admission.finish(ticket)  # whatever the outcome; no-op after an answered request

    async def _serve(
        self,
        request: gateway_pb2.GenerateRequest,
        context: CallContext,
        request_id: str,
        tenant: Tenant | None,
        qos: QosLevel,
        sampling: Sampling,
        worker: Worker,
        ticket: Ticket,
        received: float,
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """Encode, then relay the llm's stream (both on `worker`); the last message carries usage and
        timings. Images its llm has read before go as their content keys alone, without the vision
        (services/gateway/image_keys.py), unless its cache no longer holds them."""
        metadata = qos_metadata(qos)
        admitted = time.perf_counter()
        info = await worker.llm_info()  # its host and GPU decide how its features cross
        call = llm_pb2.LlmGenerateRequest(
            request_id=request_id,
            prompt=request.prompt,
            messages=request.messages,
            sampling=sampling.to_pb(),  # checked and normalised here, once
            max_prompt_tokens=tenant.limits.get("max_prompt_tokens", 0) if tenant else 0,
        )
        ledger = Ledger(qos, received, admitted, ticket, tenant)
        # By key alone only pictures read at the model's own size (max_pixels changes the features,
        # and the vision is where a bad max_pixels is refused).
        by_key = info.reads_cached_images and not any(image.max_pixels for image in request.images)
        digests = await self.image_keys.digests(request.images) if by_key else None
        keys = self.image_keys.get(worker.name, digests)
        if keys is not None:
            call.cached_image_keys.extend(keys)
            try:
                async with contextlib.aclosing(self._relay(worker, call, None, context, metadata, ledger)) as outs:
                    async for out in outs:
                        yield out
                return
            except NotCached:
                self.image_keys.forget(worker.name, digests)
            del call.cached_image_keys[:]
        consumer = pb.ConsumerInfo(
            host_id=info.host_id, gpu_uuid=info.gpu_uuid, accept=info.transports, peer_gpu_uuids=info.peer_gpu_uuids
        )
        with telemetry.span("gateway.vision"):
            try:
                encoded = await worker.vision.Encode(
                    vision_pb2.EncodeRequest(request_id=request_id, images=request.images, consumer=consumer),
                    metadata=metadata,
                    timeout=context.time_remaining(),
                )
            except grpc.RpcError as err:
                worker.failed(err)
                raise from_rpc_error(err, "vision") from err
        call.image_features.extend(encoded.features)
        learn = digests is not None
        async with contextlib.aclosing(self._relay(worker, call, encoded, context, metadata, ledger)) as outs:
            async for out in outs:
                if learn:  # an answer: its prompt pages are registered in the llm's prefix cache by now
                    self.image_keys.learn(worker.name, digests, encoded.features)
                    learn = False
                yield out

    async def _relay(
        self,
        worker: Worker,
        call: llm_pb2.LlmGenerateRequest,
        encoded: vision_pb2.EncodeResponse | None,
        context: CallContext,
        metadata: tuple,
        ledger: Ledger,
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """The llm's stream as the gateway's answers. `encoded` None: the call carries content keys
        alone, and a FAILED_PRECONDITION before any answer raises NotCached (nothing was sent)."""
        features = encoded.features if encoded is not None else ()
        with telemetry.span("gateway.llm", {"llm.features_cached": encoded is None}):
            stream = worker.llm.Generate(call, metadata=metadata, timeout=context.time_remaining())
            first_token_at = None
            started = False
            try:
                async for msg in stream:
                    if not started and encoded is None:
                        metrics.VISION_SKIPS.labels("skipped").inc()
                    started = True
                    if first_token_at is None and msg.token_ids:
                        first_token_at = time.perf_counter()
                    out = gateway_pb2.GenerateResponse(
                        request_id=call.request_id, text=msg.text, token_ids=msg.token_ids
                    )
                    if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                        vision = encoded.timings if encoded is not None else pb.StageTimings()
                        timings = finish_response(
                            out, msg, vision, ledger.qos, ledger.received, ledger.admitted, first_token_at
                        )
                        self.admission.finish(ledger.ticket, timings, msg.usage.output_tokens)
                        worker.breaker.record(True)
                        tenant = ledger.tenant
                        if tenant is not None and tenant.tokens is not None:
                            tenant.tokens.charge(msg.usage.output_tokens)
                    yield out
            except grpc.RpcError as err:
                if encoded is None and not started and err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    raise NotCached from err
                worker.failed(err)
                if not started and features:  # the llm never read them: hand the slots back, not at the TTL
                    await release_leases(worker.vision, features, timeout_s=2)
                raise from_rpc_error(err, "llm") from err
            except (asyncio.CancelledError, GeneratorExit):  # the client went away or the deadline passed
                stream.cancel()
                if not started and features:  # the llm may never have read them; don't wait for the TTL
                    task = asyncio.create_task(release_leases(worker.vision, features, timeout_s=2))
                    self._background.add(task)
                    task.add_done_callback(self._background.discard)
                raise

    @rpc.stream
    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        with self.access.request("Generate", context) as entry:
            async for msg in self.run(request, context, entry):
                entry.relayed(msg)
                yield msg

    @rpc.unary
    async def GenerateUnary(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        result = gateway_pb2.GenerateResult()
        texts: list[str] = []
        held = HeadersWithTheResult(context)
        with self.access.request("GenerateUnary", context) as entry:
            async for msg in self.run(request, held, entry):
                entry.relayed(msg)
                texts.append(msg.text)
                result.token_ids.extend(msg.token_ids)
                result.request_id = msg.request_id
                if msg.finish_reason:
                    result.finish_reason = msg.finish_reason
                    result.usage.CopyFrom(msg.usage)
                    result.timings.CopyFrom(msg.timings)
        result.text = "".join(texts)
        if held.headers is not None:
            await context.send_initial_metadata(held.headers)
        return result
