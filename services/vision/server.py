"""Start the vision server: `vlmesh serve vision` or `python -m services.vision`."""

from __future__ import annotations

import asyncio
import logging

from services.common.memory import MemoryGuard
from services.common.metrics import watch_gpu_memory
from services.common.server import run_service, serve_until_signal, start_server
from services.handoff.header import align, pages_in
from services.handoff.producer import Producer
from services.model.spec import load_spec
from services.vision import config as vision_config
from services.vision.batcher import VisionBatcher
from services.vision.encoder import VisionEncoder
from services.vision.servicer import VisionServicer
from vlmesh.v1 import vision_pb2, vision_pb2_grpc

log = logging.getLogger("vision")


async def _reap_forever(producer: Producer, period_s: float) -> None:
    while True:
        await asyncio.sleep(period_s)
        producer.reap()


async def serve(cfg: vision_config.VisionConfig) -> None:
    cfg.model.apply_threads()
    spec = load_spec(cfg.model.path)
    encoder = VisionEncoder(
        spec, cfg.model.device, cfg.model.dtype, cfg.max_batch if cfg.graphs else 0, gpu_resize=cfg.gpu_resize
    )
    watch_gpu_memory("vision", encoder.device)
    # --arena-slots of the largest pictures, in pages that smaller pictures share out by their size.
    page_bytes = align(encoder.page_bytes)
    n_pages = cfg.arena_slots * -(-encoder.feature_bytes // page_bytes)
    keep = pages_in(cfg.feature_cache_mib, page_bytes)
    producer = Producer(page_bytes, n_pages, cfg.lease_ttl_s, encoder.device, cfg.ready_signal, keep)
    batcher = VisionBatcher(encoder, cfg.max_batch)
    batcher.start()
    memory = MemoryGuard.for_device("vision", encoder.device, cfg.model.memory_watermarks)
    servicer = VisionServicer(encoder, batcher, producer, cfg.preprocess_workers, memory)
    reaper = asyncio.create_task(_reap_forever(producer, max(cfg.lease_ttl_s / 4, 0.05)))
    try:
        running = await start_server(
            cfg.server,
            [lambda s: vision_pb2_grpc.add_VisionServicer_to_server(servicer, s)],
            [vision_pb2.DESCRIPTOR.services_by_name["Vision"].full_name],
        )
        log.info(
            "vision serving on %s:%d (arenas %s, %d pages of %d KiB each, %d more keep features: %s)",
            cfg.server.host,
            running.port,
            ", ".join(producer.arena_names),
            n_pages,
            page_bytes // 1024,
            keep,
            f"a {cfg.feature_cache_mib} MiB cache" if keep else "the cache is off",
        )
        await serve_until_signal(running, cfg.server.grace_s)
    finally:
        reaper.cancel()
        await batcher.stop()
        servicer.close()
        producer.close()


def main(argv: list[str] | None = None) -> int:
    return run_service("vision", vision_config.parse, serve, argv)
