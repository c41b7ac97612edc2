"""Start the gateway: `vlmesh serve gateway` or `python -m services.gateway`."""

from __future__ import annotations

import logging
import os

from services.common.config import WARMUP_KEY_ENV
from services.common.server import run_service, serve_until_signal, start_server
from services.gateway import config as gateway_config
from services.gateway.servicer import GatewayServicer
from services.gateway.tenants import TenantRegistry
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc

log = logging.getLogger("gateway")


def load_tenants(cfg: gateway_config.GatewayConfig, environ=os.environ) -> TenantRegistry | None:
    """The tenants of --tenants (None: auth off), with the launcher's warm-up key from the
    environment: read once, at start; unset or empty, it authenticates nothing."""
    if not cfg.tenants:
        return None
    return TenantRegistry.load(cfg.tenants, internal_key=environ.get(WARMUP_KEY_ENV) or None)


async def serve(cfg: gateway_config.GatewayConfig) -> None:
    tenants = load_tenants(cfg)
    servicer = GatewayServicer(
        cfg.vision_target, cfg.llm_target, cfg.max_images, tenants, cfg.admission, access_log=cfg.access_log
    )
    running = await start_server(
        cfg.server,
        [lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, s)],
        [gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name],
    )
    log.info(
        "gateway serving on %s:%d (vision %s, llm %s)",
        cfg.server.host,
        running.port,
        cfg.vision_target,
        cfg.llm_target,
    )
    await serve_until_signal(running, cfg.server.grace_s)


def main(argv: list[str] | None = None) -> int:
    return run_service("gateway", gateway_config.parse, serve, argv)
