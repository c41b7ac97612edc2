"""vlmesh.v1.Llm: a thin adapter from gRPC to the engine.

It validates, opens the image features' TensorRefs (services/handoff), submits a Job to
its Engine (services/llm/interface.py), then relays the engine's outputs. Features the
engine reads in place keep their leases until its prefill has read them; every other
lease goes back once the engine has taken its copy. A cancelled or expired RPC aborts
the request in the engine, which frees its KV space.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import torch

from services.common import metrics, rpc, telemetry
from services.common.config import DEFAULT_HOST
from services.common.errors import FeaturesNeeded, InvalidArgument, MeshError, Unavailable
from services.common.logs import request_context
from services.common.memory import MemoryGuard, Watermarks
from services.common.qos import QosLevel, qos_from_metadata
from services.common.server import INTERNAL_OPTIONS
from services.common.timings import Timings
from services.common.tls import aio_channel
from services.common.validation import check_conversation, check_sampling
from services.handoff.consumer import Consumer
from services.handoff.wire import CONTENT_KEY_BYTES, transport_name
from services.llm.interface import Engine, Job, Submission
from services.llm.request import Finish, Output, Request
from services.model.spec import ModelSpec
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import llm_pb2, llm_pb2_grpc, vision_pb2_grpc


def check_grids(tensors: list[torch.Tensor], most: int, hidden: int) -> None:
    """INVALID_ARGUMENT unless each picture's features are a grid [rows, cols, hidden] of 1..`most` tokens."""
    for i, t in enumerate(tensors):
        if t.dim() != 3 or t.shape[2] != hidden or not 0 < t.shape[0] * t.shape[1] <= most:
            raise InvalidArgument(
                f"image_features[{i}] has shape {tuple(t.shape)}; this model needs a picture's grid of tokens "
                f"[rows, cols, {hidden}], at most {most} of them"
            )


log = logging.getLogger(__name__)

FINISH_TO_PB = {Finish.STOP: pb.FINISH_REASON_STOP, Finish.LENGTH: pb.FINISH_REASON_LENGTH}


class LlmServicer(llm_pb2_grpc.LlmServicer):
    def __init__(
        self,
        engine: Engine,
        spec: ModelSpec,
        default_max_tokens: int,
        vision_target: str | None,
        vision_port_file: str | None = None,
        memory: MemoryGuard | None = None,
        variant: str = "full",
        vision_credentials: grpc.ChannelCredentials | None = None,  # mTLS for lease releases
    ):
        self.engine = engine
        self.variant = variant  # what Info reports, and the gateway names in each answer
        metrics.MODEL_INFO.labels("llm", spec.model_id, variant).set(1)
        # GPU memory watermarks: best-effort work is refused over the top one (inert on the CPU).
        self.memory = memory or MemoryGuard("llm", None, Watermarks())
        self.spec = spec
        self.default_max_tokens = default_max_tokens
        vision = (
            VisionPeer(vision_target, vision_port_file, vision_credentials)
            if vision_target or vision_port_file
            else None
        )
        # Opens the features' references; hands their leases back to the vision (without one, the TTL does).
        self.consumer = Consumer(engine.device, vision, release_timeout_s=5)

    @property
    def reads_cached_images(self) -> bool:
        """Whether it serves a picture by its content key alone: from the prefix cache, where each
        picture takes a known number of positions (a grid family's depends on the picture)."""
        return self.engine.reads_cached_images and not self.spec.image_grid

    @rpc.stream
    async def Generate(self, request: llm_pb2.LlmGenerateRequest, context: grpc.aio.ServicerContext):
        qos = qos_from_metadata(context.invocation_metadata())
        request_context(request.request_id)
        telemetry.annotate(
            {
                "request.id": request.request_id,
                "qos.level": qos.wire,
                "model.id": self.spec.model_id,
                "model.variant": self.variant,
            }
        )
        self.memory.admit(qos)
        if request.cached_image_keys:
            async with contextlib.aclosing(self._from_cache(request, qos)) as msgs:
                async for msg in msgs:
                    yield msg
            return
        if not request.image_features:
            raise InvalidArgument("image_features: one image is required")
        prompt = check_conversation(request.prompt, request.messages, len(request.image_features))
        sampling = check_sampling(request.sampling, self.spec.text.max_context)
        t0 = time.perf_counter()
        refs = request.image_features
        kinds = sorted({transport_name(r.transport) for r in refs})
        try:
            with telemetry.span("handoff.import", {"transport": ",".join(kinds)}):
                # Each [image_tokens, hidden] (or a picture's grid [rows, cols, hidden]); read in
                # place (CUDA IPC) or copied (SHM, INLINE).
                grid = self.spec.image_grid
                shape = None if grid else (self.spec.image_tokens, self.spec.text.hidden)
                features = self.consumer.open(refs, shape=shape, field="image_features")
                if grid:
                    check_grids(features.tensors, self.spec.image_tokens, self.spec.text.hidden)
            handoff = time.perf_counter() - t0
            keys = [ref.content_key for ref in refs]
            job = Job(request.request_id, prompt, features.tensors, sampling, qos, keys, request.max_prompt_tokens)
            # An engine that reads in place verifies, then releases, the leases after its prefill.
            sub = self.engine.submit(job, features.hold() if self.engine.reads_in_place else None)
        except BaseException:
            await self.consumer.release(refs)  # answered only once the slots are back
            raise
        features.release_rest()  # the engine holds its copy of the rest by now
        async with contextlib.aclosing(self._relay(sub, handoff)) as msgs:  # closed with this RPC's generator
            async for msg in msgs:
                yield msg

    async def _from_cache(
        self, request: llm_pb2.LlmGenerateRequest, qos: QosLevel
    ) -> AsyncIterator[llm_pb2.LlmGenerateResponse]:
        """A request sent with its images' content keys alone: served from the prefix cache, reading
        no features, or FAILED_PRECONDITION (FeaturesNeeded) before any work."""
        keys = list(request.cached_image_keys)
        if request.image_features:
            raise InvalidArgument("send image_features or cached_image_keys, not both")
        if any(len(k) != CONTENT_KEY_BYTES for k in keys):
            raise InvalidArgument(f"cached_image_keys: each is a {CONTENT_KEY_BYTES}-byte TensorRef.content_key")
        if not self.reads_cached_images:
            raise FeaturesNeeded("this llm serves no image from its cache: send image_features")
        prompt = check_conversation(request.prompt, request.messages, len(keys))
        sampling = check_sampling(request.sampling, self.spec.text.max_context)
        # Placeholders of each image's length: the engine reads none of them.
        holes = [torch.empty(self.spec.image_tokens, 0) for _ in keys]
        job = Job(request.request_id, prompt, holes, sampling, qos, keys, request.max_prompt_tokens, True)
        telemetry.annotate({"llm.features_cached": True})
        async with contextlib.aclosing(self._relay(self.engine.submit(job), 0.0)) as msgs:
            async for msg in msgs:
                yield msg

    async def _relay(self, sub: Submission, handoff_s: float) -> AsyncIterator[llm_pb2.LlmGenerateResponse]:
        """The engine's outputs as responses; the last carries usage and timings."""
        async with contextlib.aclosing(sub.outputs()) as outputs:  # closing it aborts an unfinished request
            async for out in outputs:
                if out.finish is None:
                    yield llm_pb2.LlmGenerateResponse(text=out.text, token_ids=out.token_ids)
                else:
                    yield self._final(sub.req, out, handoff_s)

    def _final(self, req: Request, out: Output, handoff_s: float):
        if out.finish is Finish.ERROR:
            if isinstance(out.error, MeshError):
                raise out.error
            raise MeshError(str(out.error or "the engine failed this request"))
        if out.finish is Finish.ABORT:
            raise Unavailable(out.error or "the request was aborted")
        timings = req.timings().replace(handoff=handoff_s)
        self._record(req, timings)
        usage = pb.Usage(
            prompt_tokens=req.text_tokens,
            image_tokens=req.image_tokens,
            output_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
        )
        return llm_pb2.LlmGenerateResponse(
            text=out.text,
            token_ids=out.token_ids,
            finish_reason=FINISH_TO_PB[out.finish],
            usage=usage,
            timings=timings.to_pb(),
        )

    @staticmethod
    def _record(req: Request, t: Timings) -> None:
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
        metrics.QUEUE_WAIT.labels("llm", req.qos.wire).observe(t.llm_queue)
        metrics.STAGE_DURATION.labels("prefill").observe(t.prefill)
        metrics.STAGE_DURATION.labels("decode").observe(t.decode)

    @rpc.unary
    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext):
        return pb.ServiceInfo(
            service="llm",
            model_id=self.spec.model_id,
            host_id=self.consumer.host,
            gpu_uuid=self.consumer.gpu_uuid,
            transports=self.consumer.transports,
            peer_gpu_uuids=self.consumer.peer_gpu_uuids,
            max_context=self.spec.text.max_context,
            image_tokens=self.spec.image_tokens,
            default_max_tokens=self.default_max_tokens,
            variant=self.variant,
            reads_cached_images=self.reads_cached_images,
        )

    def close(self) -> None:
        self.consumer.close()


class VisionPeer:
    """The vision's Release, connected on first use.

    The vision's address may not be known when the llm starts: a launcher that starts both on
    port 0 passes the vision's port file (--vision-port-file), written once the vision serves,
    and the host (--vision-target). Requests, and so releases, come only after both serve.
    """

    def __init__(self, target: str | None, port_file: str | None, creds: grpc.ChannelCredentials | None) -> None:
        """`creds`: mTLS to the vision (services/common/tls.py); None: plaintext."""
        self._target, self._port_file, self._creds = target, port_file, creds
        self._stub: vision_pb2_grpc.VisionStub | None = None

    def _resolve(self) -> str | None:
        if not self._port_file:
            return self._target
        try:
            port = int(json.loads(Path(self._port_file).read_text())["port"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("no vision port in %s yet (%s); the TTL will reclaim the leases", self._port_file, err)
            return None
        return f"{host_of(self._target)}:{port}"

    async def Release(self, request, timeout: float | None = None):  # noqa: ASYNC109 (the stub's signature)
        if self._stub is None:
            target = self._resolve()
            if target is None:
                return None
            channel = aio_channel(
                target, self._creds, options=INTERNAL_OPTIONS, interceptors=telemetry.client_interceptors()
            )
            self._stub = vision_pb2_grpc.VisionStub(channel)
            log.info("releasing feature leases to the vision at %s", target)
        return await self._stub.Release(request, timeout=timeout)


def host_of(target: str | None) -> str:
    """The host of HOST, HOST:PORT, [V6]:PORT or a bare IPv6 address (None: 127.0.0.1)."""
    if not target:
        return DEFAULT_HOST
    if target.startswith("["):
        return target[: target.index("]") + 1]
    if target.count(":") == 1:
        return target.split(":")[0]
    return f"[{target}]" if ":" in target else target
