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
from services.common.qos import qos_from_metadata
from services.common.timings import Timings
from services.common.validation import check_images
from services.handoff.producer import Producer
from services.vision.batcher import VisionBatcher
from services.vision.encoder import VisionEncoder
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import vision_pb2, vision_pb2_grpc

log = logging.getLogger(__name__)


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
        t0 = time.perf_counter()
        with telemetry.span("vision.preprocess", {"images": len(request.images)}):
            pixels = await asyncio.gather(
                *(
                    asyncio.wrap_future(self._preprocess.submit(qos, self.encoder.pixels, image.data, f"images[{i}]"))
                    for i, image in enumerate(request.images)
                )
            )
        preprocess = time.perf_counter() - t0
        metrics.STAGE_DURATION.labels("preprocess").observe(preprocess)
        results = await asyncio.gather(*(self.batcher.submit(p, qos) for p in pixels))
        t1 = time.perf_counter()
        with telemetry.span("handoff.export", {"transport": transport.name}):
            refs = self.producer.export([r.features for r in results], transport)
        timings = Timings(
            preprocess=preprocess,
            vision_queue=max(r.queue_s for r in results),
            vision=max(r.encode_s for r in results),
            handoff=time.perf_counter() - t1,
        )
        return vision_pb2.EncodeResponse(features=refs, timings=timings.to_pb())

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
