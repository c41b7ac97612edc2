"""vlmesh.v1.Vision: a thin adapter from gRPC to the batcher and the feature arena."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from services.common import metrics, rpc, telemetry
from services.common.logs import request_context
from services.common.memory import MemoryGuard, Watermarks
from services.common.priority_pool import PriorityPool
from services.common.qos import QosLevel, qos_from_metadata
from services.common.timings import Timings
from services.common.validation import check_images
from services.handoff.producer import Producer
from services.handoff.transport import Transport
from services.handoff.wire import lease_ids
from services.vision.batcher import Member, VisionBatcher
from services.vision.encoder import VisionEncoder
from services.vision.feature_cache import FeatureCache, config_salt
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import vision_pb2, vision_pb2_grpc

log = logging.getLogger(__name__)

_STAGES = ("preprocess", "vision_queue", "vision", "handoff")


class VisionServicer(vision_pb2_grpc.VisionServicer):
    def __init__(
        self,
        encoder: VisionEncoder,
        batcher: VisionBatcher,
        producer: Producer,
        workers: int,
        memory: MemoryGuard | None = None,
    ) -> None:
        self.encoder = encoder
        # Repeated images are served from kept slots when the producer keeps any (--feature-cache-mib).
        salt = config_salt(encoder.spec.model_id, encoder.processor, encoder.dtype)
        self.cache = FeatureCache(producer, salt, enabled=producer.keeps)
        # GPU memory watermarks: best-effort work is refused over the top one (inert on the CPU).
        self.memory = memory or MemoryGuard("vision", None, Watermarks())
        self.batcher = batcher
        self.producer = producer
        self._preprocess = PriorityPool(workers, "preprocess")  # realtime images are decoded first

    @rpc.unary
    async def Encode(self, request: vision_pb2.EncodeRequest, context: grpc.aio.ServicerContext):
        qos = qos_from_metadata(context.invocation_metadata())
        request_context(request.request_id)
        telemetry.annotate(
            {
                "request.id": request.request_id,
                "qos.level": qos.wire,
                "model.id": self.encoder.spec.model_id,
                "model.variant": "default",
            }
        )
        self.memory.admit(qos)
        check_images(request.images)
        transport = self.producer.negotiate(request.consumer)  # a consumer we cannot serve fails before any work
        members = self.batcher.group(len(request.images))  # the pictures it encodes share a batch
        results = await asyncio.gather(
            *(self._features(qos, transport, members[i], i, image) for i, image in enumerate(request.images)),
            return_exceptions=True,
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:  # nobody will read the others: their leases go now
            self.producer.release(lease_ids(r[0] for r in results if not isinstance(r, BaseException)))
            raise failed[0]
        stages = [r[1] for r in results if r[1] is not None]  # cache hits ran no stage
        timings = Timings(**{k: max((getattr(t, k) for t in stages), default=0.0) for k in _STAGES})
        return vision_pb2.EncodeResponse(features=[r[0] for r in results], timings=timings.to_pb())

    async def _features(self, qos: QosLevel, transport: Transport, member: Member, i: int, image: pb.Image):
        """One image's reference, from the cache or encoded, and the stages it ran (None on a hit)."""

        async def encode() -> tuple[pb.TensorRef, Timings]:
            t0 = time.perf_counter()
            with telemetry.span("vision.preprocess", {"images": 1}):
                pixels = await asyncio.wrap_future(
                    self._preprocess.submit(qos, self.encoder.pixels, data, f"images[{i}]", image.max_pixels)
                )
            preprocess = time.perf_counter() - t0
            metrics.STAGE_DURATION.labels("preprocess").observe(preprocess)
            result = await self.batcher.submit(pixels, qos, member)
            t1 = time.perf_counter()
            with telemetry.span("handoff.export", {"transport": transport.name}):
                (ref,) = self.producer.export([result.features], transport, [key] if key is not None else None)
            stages = Timings(
                preprocess=preprocess,
                vision_queue=result.queue_s,
                vision=result.encode_s,
                handoff=time.perf_counter() - t1,
            )
            return ref, stages

        data = image.data
        try:
            self.encoder.check_max_pixels(image.max_pixels, f"images[{i}]")  # before a cache lookup
            key = self.cache.key(data, image.max_pixels) if self.cache.enabled else None
            # Waiting for another encode of this picture (maybe this request's own) it leaves the group.
            return await self.cache.get(key, transport, encode, on_wait=member.leave)
        finally:
            member.leave()  # a hit or an error: the request's other pictures need not wait for it

    @rpc.unary
    async def Release(self, request: vision_pb2.ReleaseRequest, context: grpc.aio.ServicerContext):
        return vision_pb2.ReleaseResponse(released=self.producer.release(request.lease_ids))

    @rpc.unary
    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext):
        spec = self.encoder.spec
        return pb.ServiceInfo(
            service="vision",
            model_id=spec.model_id,
            host_id=self.producer.host,
            gpu_uuid=self.producer.gpu_uuid,
            transports=self.producer.transports,
            image_tokens=spec.image_tokens,
        )

    def close(self) -> None:
        self._preprocess.shutdown()
