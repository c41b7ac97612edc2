"""Start the gateway: `vlmesh serve gateway` or `python -m services.gateway`."""

from __future__ import annotations

import logging
import os

from services.common.config import WARMUP_KEY_ENV
from services.common.server import run_service, serve_until_signal, start_server
from services.gateway import config as gateway_config
from services.gateway.image_keys import ImageKeys
from services.gateway.readiness import Readiness
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
        cfg.vision_target,
        cfg.llm_target,
        cfg.max_images,
        tenants,
        cfg.admission,
        access_log=cfg.access_log,
        peer_credentials=cfg.server.channel_credentials(),
        breaker=(cfg.breaker_failures, cfg.breaker_cooldown_s),
        degrade=(cfg.degrade_target, cfg.degrade_variant),
        image_keys=ImageKeys(cfg.skip_cached_encode, cfg.image_key_cache),
    )
    readiness = Readiness(servicer.workers.all)
    http = await start_http(cfg, servicer, readiness) if cfg.http.port >= 0 else None
    running = await start_server(
        cfg.server,
        [lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, s)],
        [gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name],
        other_ports={"http_port": http[1].port} if http else None,
        public=True,
    )
    log.info(
        "gateway serving %s on %s:%d (vision %s, llm %s)%s",
        "TLS" if cfg.server.tls_cert else "plaintext",
        cfg.server.host,
        running.port,
        cfg.vision_target,
        cfg.llm_target,
        f"; OpenAI-compatible HTTP on {http[1].scheme}://{cfg.server.host}:{http[1].port}/v1" if http else "",
    )

    readiness.on_change = running.set_ready
    readiness.start()

    async def drain() -> None:
        await readiness.stop()
        if http is not None:
            api, server = http
            api.serving = False
            await server.stop()
            await api.close()

    await serve_until_signal(running, cfg.server.grace_s, drain_also=drain)


async def start_http(cfg: gateway_config.GatewayConfig, servicer: GatewayServicer, readiness: Readiness):
    """The OpenAI-compatible door on --http-port: (its routes, its running server)."""
    # Imported here: FastAPI and uvicorn load only when the HTTP door is on.
    from services.gateway.http.app import OpenAiApi
    from services.gateway.http.server import HttpServer

    api = OpenAiApi(servicer, cfg.http, readiness)
    tls = cfg.server.tls_cert, cfg.server.tls_key
    server = HttpServer(api.app, cfg.server.host, cfg.http.port, cfg.server.grace_s, *tls)
    await server.start()
    return api, server


def main(argv: list[str] | None = None) -> int:
    return run_service("gateway", gateway_config.parse, serve, argv)
