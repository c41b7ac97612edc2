"""vlmesh.v1.Llm: a thin adapter from gRPC to the engine.

It validates, builds the prompt, imports the image features through their TensorRefs,
then relays the engine's outputs. Features copied on import (host slots, inline bytes)
have their leases released at once; features read in place (CUDA IPC) keep theirs until
the engine's prefill has read them. A cancelled or
expired RPC aborts the request in the engine, which frees its KV slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable

import grpc

from services.common import errors, metrics, telemetry
from services.common.errors import InvalidArgument, MeshError, Unavailable
from services.common.hostinfo import host_id
from services.common.logs import request_context
from services.common.qos import qos_from_metadata
from services.common.sampling import check_sampling
from services.common.tensorref import FeatureImporter, holds_lease, transport_name
from services.common.validation import check_prompt
from services.llm.engine import Engine
from services.llm.request import Finish, Output, Request
from services.llm.submit import submit
from services.llm.vllm_engine import VllmEngine
from services.model.prompt import PromptBuilder
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import llm_pb2, llm_pb2_grpc, vision_pb2, vision_pb2_grpc

log = logging.getLogger(__name__)

FINISH_TO_PB = {Finish.STOP: pb.FINISH_REASON_STOP, Finish.LENGTH: pb.FINISH_REASON_LENGTH}


class LlmServicer(llm_pb2_grpc.LlmServicer):
    def __init__(
        self, engine: Engine | VllmEngine, prompts: PromptBuilder, default_max_tokens: int, vision_target: str | None
    ):
        self.engine = engine
        # The native engine reads CUDA features in place (leases held to its prefill); vLLM copies
        # every feature into prompt_embeds at submit, so its leases go at once.
        self.zero_copy = isinstance(engine, Engine)
        self._submit = functools.partial(submit, engine) if self.zero_copy else engine.submit
        self.prompts = prompts
        self.spec = prompts.spec
        self.default_max_tokens = default_max_tokens
        self.importer = FeatureImporter(engine.device)
        self.host = host_id()
        self.gpu_uuid = ""
        if engine.device.type == "cuda":
            from services.common.cuda_arena import gpu_uuid

            self.gpu_uuid = gpu_uuid(engine.device)
        self._vision = None
        if vision_target:
            channel = grpc.aio.insecure_channel(vision_target, interceptors=telemetry.client_interceptors())
            self._vision = vision_pb2_grpc.VisionStub(channel)
        self._background: set[asyncio.Task] = set()

    def _import_features(self, refs) -> list:
        hidden, tokens = self.spec.text.hidden, self.spec.image_tokens
        feats = []
        for i, ref in enumerate(refs):
            tensor = self.importer.load(ref)
            if tuple(tensor.shape) != (tokens, hidden):
                raise InvalidArgument(
                    f"image_features[{i}] has shape {tuple(tensor.shape)}; this model needs ({tokens}, {hidden})"
                )
            feats.append(tensor)
        return feats

    def _lease_hooks(self, refs) -> tuple[Callable[[], None], Callable[[], None]] | None:
        """For features read in place (CUDA IPC): the engine verifies, then releases, after its prefill."""
        held = [r for r in refs if holds_lease(r)]
        if not held:
            return None
        loop = asyncio.get_running_loop()

        def verify() -> None:
            for ref in held:
                self.importer.verify(ref)

        def release() -> None:  # on the engine thread
            with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown): the TTL reclaims them
                loop.call_soon_threadsafe(self._release_soon, held)

        return verify, release

    async def _release(self, refs) -> None:
        """Hand the leases back; the producer's TTL covers a release that gets lost."""
        lease_ids = [r.lease.id for r in refs if r.transport != pb.TRANSPORT_INLINE and r.lease.id]
        if not lease_ids or self._vision is None:
            return
        try:
            await self._vision.Release(vision_pb2.ReleaseRequest(lease_ids=lease_ids), timeout=5)
        except grpc.RpcError as err:
            log.warning("lease release failed (the TTL will reclaim them): %s", err.code().name)

    def _release_soon(self, refs) -> None:
        """Release without delaying the request (the happy path)."""
        if not refs:
            return
        task = asyncio.create_task(self._release(refs))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @errors.stream
    async def Generate(self, request: llm_pb2.LlmGenerateRequest, context: grpc.aio.ServicerContext):
        qos = qos_from_metadata(context.invocation_metadata())
        request_context(request.request_id)
        telemetry.annotate(
            {
                "request.id": request.request_id,
                "qos.level": qos.wire,
                "model.id": self.spec.model_id,
                "model.variant": "default",
            }
        )
        check_prompt(request.prompt)
        sampling = check_sampling(request.sampling, self.spec.text.max_context)
        if not request.image_features:
            raise InvalidArgument("image_features: one image is required")
        t0 = time.perf_counter()
        refs = request.image_features
        kinds = sorted({transport_name(r.transport) for r in refs})
        try:
            with telemetry.span("handoff.import", {"transport": ",".join(kinds)}):
                features = self._import_features(refs)
            handoff_ms = (time.perf_counter() - t0) * 1000
            sub = self._submit(
                self.prompts,
                self.default_max_tokens,
                request.request_id,
                request.prompt,
                features,
                sampling,
                qos,
                self._lease_hooks(refs) if self.zero_copy else None,
            )
        except BaseException:
            await self._release(refs)  # answered only once the slots are back
            raise
        # Copied by now (on import, or into vLLM's prompt_embeds): no longer needed.
        self._release_soon([r for r in refs if not (self.zero_copy and holds_lease(r))])
        async with contextlib.aclosing(sub.outputs()) as outputs:  # closing it aborts an unfinished request
            async for out in outputs:
                if out.finish is None:
                    yield llm_pb2.LlmGenerateResponse(text=out.text, token_ids=out.token_ids)
                else:
                    yield self._final(sub.req, out, handoff_ms)

    def _final(self, req: Request, out: Output, handoff_ms: float):
        if out.finish is Finish.ERROR:
            if isinstance(out.error, MeshError):
                raise out.error
            raise MeshError(str(out.error or "the engine failed this request"))
        if out.finish is Finish.ABORT:
            raise Unavailable(out.error or "the request was aborted")
        self._record(req)
        timings = pb.StageTimings(
            handoff_ms=handoff_ms,
            llm_queue_ms=(req.scheduled_at - req.arrival) * 1000,
            prefill_ms=(req.prefill_done_at - req.scheduled_at) * 1000,
            decode_ms=(req.finished_at - req.prefill_done_at) * 1000,
        )
        usage = pb.Usage(
            prompt_tokens=req.text_tokens, image_tokens=req.image_tokens, output_tokens=len(req.output_ids)
        )
        return llm_pb2.LlmGenerateResponse(
            text=out.text,
            token_ids=out.token_ids,
            finish_reason=FINISH_TO_PB[out.finish],
            usage=usage,
            timings=timings,
        )

    @staticmethod
    def _record(req: Request) -> None:
        """The engine's stages of a finished request, as spans and metrics."""
        telemetry.record_span("llm.queue", req.arrival, req.scheduled_at)
        telemetry.record_span(
            "llm.prefill", req.scheduled_at, req.prefill_done_at, {"gen_ai.usage.input_tokens": req.prompt_len}
        )
        telemetry.record_span(
            "llm.decode",
            req.prefill_done_at,
            req.finished_at,
            {"gen_ai.usage.output_tokens": len(req.output_ids), "llm.preemptions": len(req.preempted_at)},
            events=[("first_token", req.prefill_done_at)] + [("preempted", t) for t in req.preempted_at],
        )
        metrics.QUEUE_WAIT.labels("llm", req.qos.wire).observe(req.scheduled_at - req.arrival)
        metrics.STAGE_DURATION.labels("prefill").observe(req.prefill_done_at - req.scheduled_at)
        metrics.STAGE_DURATION.labels("decode").observe(req.finished_at - req.prefill_done_at)

    @errors.unary
    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext):
        return pb.ServiceInfo(
            service="llm",
            model_id=self.spec.model_id,
            host_id=self.host,
            gpu_uuid=self.gpu_uuid,
            transports=self.importer.transports,
            max_context=self.spec.text.max_context,
            image_tokens=self.spec.image_tokens,
            default_max_tokens=self.default_max_tokens,
        )

    def close(self) -> None:
        self.importer.close()
