"""Start the llm server: `vlmesh serve llm` or `python -m services.llm`."""

from __future__ import annotations

import logging

from services.common.config import resolve_device
from services.common.memory import MemoryGuard
from services.common.metrics import watch_gpu_memory
from services.common.server import run_service, serve_until_signal, start_server
from services.llm import config as llm_config
from services.llm.engines import build_engine
from services.llm.servicer import LlmServicer
from services.model.prompt import PromptBuilder
from services.model.spec import load_spec, resolve_dtype
from vlmesh.v1 import llm_pb2, llm_pb2_grpc

log = logging.getLogger("llm")


async def serve(cfg: llm_config.LlmConfig) -> None:
    cfg.model.apply_threads()
    spec = load_spec(cfg.model.path)
    device = resolve_device(cfg.model.device)
    watch_gpu_memory("llm", device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    prompts = PromptBuilder(spec)
    engine = build_engine(
        cfg.engine, prompts, device, dtype, cfg.max_batch, cfg.default_max_tokens, cfg.vllm_kv_cache_gib, cfg.native
    )
    memory = MemoryGuard.for_device("llm", device, cfg.model.memory_watermarks)
    servicer = LlmServicer(
        engine,
        spec,
        cfg.default_max_tokens,
        cfg.vision_target,
        cfg.vision_port_file,
        memory,
        cfg.variant,
        vision_credentials=cfg.server.channel_credentials(),
    )
    try:
        running = await start_server(
            cfg.server,
            [lambda s: llm_pb2_grpc.add_LlmServicer_to_server(servicer, s)],
            [llm_pb2.DESCRIPTOR.services_by_name["Llm"].full_name],
        )
        log.info(
            "llm serving on %s:%d (%s engine, max batch %d)", cfg.server.host, running.port, cfg.engine, cfg.max_batch
        )
        await serve_until_signal(running, cfg.server.grace_s)
    finally:
        engine.stop()
        servicer.close()


def main(argv: list[str] | None = None) -> int:
    return run_service("llm", llm_config.parse, serve, argv)
