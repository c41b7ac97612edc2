"""vlmesh.v1.Vision: a thin adapter from gRPC to the batcher and the feature arena."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.common import errors
from services.common.hostinfo import host_id
from services.common.qos import qos_from_metadata
from services.common.shm_arena import ShmArena
from services.common.tensorref import TORCH_TO_PB, choose_transport, inline_ref
from services.common.validation import check_images
from services.vision.batcher import VisionBatcher
from services.vision.encoder import VisionEncoder
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import vision_pb2, vision_pb2_grpc

log = logging.getLogger(__name__)

OFFERED = (pb.TRANSPORT_SHM,)


class VisionServicer(vision_pb2_grpc.VisionServicer):
    def __init__(self, encoder: VisionEncoder, batcher: VisionBatcher, arena: ShmArena, workers: int) -> None:
        self.encoder = encoder
        self.batcher = batcher
        self.arena = arena
        self.host = host_id()
        self._preprocess = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="preprocess")

    @errors.unary
    async def Encode(self, request: vision_pb2.EncodeRequest, context: grpc.aio.ServicerContext):
        qos = qos_from_metadata(context.invocation_metadata())
        check_images(request.images)
        transport = choose_transport(self.host, OFFERED, request.consumer)
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        pixels = await asyncio.gather(
            *(loop.run_in_executor(self._preprocess, self.encoder.pixels, image.data) for image in request.images)
        )
        preprocess_ms = (time.perf_counter() - t0) * 1000
        results = await asyncio.gather(*(self.batcher.submit(p, qos) for p in pixels))
        t1 = time.perf_counter()
        refs: list[pb.TensorRef] = []
        try:
            for result in results:
                refs.append(self._export(result.features, transport))
        except BaseException:
            self._release_refs(refs)  # nobody will ever read them
            raise
        handoff_ms = (time.perf_counter() - t1) * 1000
        timings = pb.StageTimings(
            preprocess_ms=preprocess_ms,
            vision_queue_ms=max(r.queue_ms for r in results),
            vision_ms=max(r.encode_ms for r in results),
            handoff_ms=handoff_ms,
        )
        return vision_pb2.EncodeResponse(features=refs, timings=timings)

    def _export(self, features, transport: int) -> pb.TensorRef:
        if transport == pb.TRANSPORT_INLINE:
            return inline_ref(features, self.host)
        lease, offset = self.arena.write(features)
        return pb.TensorRef(
            transport=pb.TRANSPORT_SHM,
            arena_id=self.arena.name,
            producer_host_id=self.host,
            offset=offset,
            nbytes=features.numel() * features.element_size(),
            shape=list(features.shape),
            dtype=TORCH_TO_PB[features.dtype],
            lease=pb.Lease(id=lease.id, expires_unix_ms=lease.expires_unix_ms),
            ready=pb.READY_SIGNAL_PRODUCER_SYNCED,
        )

    def _release_refs(self, refs: list[pb.TensorRef]) -> None:
        for ref in refs:
            if ref.transport == pb.TRANSPORT_SHM:
                self.arena.release(ref.lease.id)

    @errors.unary
    async def Release(self, request: vision_pb2.ReleaseRequest, context: grpc.aio.ServicerContext):
        released = sum(self.arena.release(lease_id) for lease_id in request.lease_ids)
        return vision_pb2.ReleaseResponse(released=released)

    @errors.unary
    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext):
        spec = self.encoder.spec
        return pb.ServiceInfo(
            service="vision",
            model_id=spec.model_id,
            host_id=self.host,
            transports=[*OFFERED, pb.TRANSPORT_INLINE],
            image_tokens=spec.image_tokens,
        )

    def close(self) -> None:
        self._preprocess.shutdown(wait=False, cancel_futures=True)
