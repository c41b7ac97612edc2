"""Start a `grpc.aio` server with health, reflection and a graceful stop on SIGTERM."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import eventloop, telemetry
from services.common.config import ServerConfig
from services.common.errors import MeshError
from services.common.logs import setup_logging
from services.common.metrics import start_metrics_server

log = logging.getLogger(__name__)

# Images and inline tensors exceed gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)


@dataclass
class RunningServer:
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int
    service_names: tuple[str, ...]

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)


async def start_server(
    cfg: ServerConfig,
    register: Iterable[Callable[[grpc.aio.Server], None]],
    service_names: Iterable[str],
) -> RunningServer:
    """Bind, register the servicers plus health and reflection, start, and report SERVING.

    Port 0 picks a free port; the bound one is returned, and written to `cfg.port_file`
    when one is given (after SERVING, so the file's presence means "ready").
    """
    server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=telemetry.server_interceptors())
    for add in register:
        add(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = tuple(service_names)
    reflection.enable_server_reflection(
        (*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    address = f"{cfg.host}:{cfg.port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as err:  # grpcio raises instead of returning 0 since 1.5x
        raise OSError(f"cannot bind {address} (in use, or not an address of this host): {err}") from err
    if bound == 0:
        raise OSError(f"cannot bind {address}")
    await server.start()
    running = RunningServer(server, health_servicer, bound, names)
    await running.set_serving(True)
    if cfg.port_file:
        write_port_file(cfg.port_file, bound, cfg.metrics_port)
    return running


def write_port_file(path: str, port: int, metrics_port: int) -> None:
    """Write the bound ports atomically: a reader sees the whole file or none."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"port": port, "metrics_port": metrics_port}, f)
    os.replace(tmp, path)


async def serve_until_signal(
    running: RunningServer,
    grace_s: float,
    on_stop: Callable[[], object] | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT, then stop gracefully.

    Order: report NOT_SERVING (load balancers drain), stop accepting new RPCs, let
    in-flight RPCs finish for up to `grace_s`, then run `on_stop` (engine threads, arenas).
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(running.server.wait_for_termination())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        log.info("stopping: draining in-flight requests for up to %.0fs", grace_s)
        await running.set_serving(False)
        await running.server.stop(grace_s)
    stopper.cancel()
    waiter.cancel()
    if on_stop is not None:
        result = on_stop()
        if asyncio.iscoroutine(result):
            await result
    log.info("stopped")


def run_service(
    name: str,
    parse: Callable[[list[str] | None], object],
    serve: Callable[[object], Awaitable[None]],
    argv: list[str] | None,
) -> int:
    """Entry point of `vlmesh serve NAME`: parse and check the config, then serve.

    A bad flag value exits 2 with the reason; so does a start-up failure the operator can
    fix (a bad checkpoint, a missing device).
    """
    try:
        cfg = parse(argv)
    except ValueError as err:
        print(f"vlmesh serve {name}: error: {err}", file=sys.stderr)
        return 2
    setup_logging(cfg.server.log_level, name, cfg.server.log_format)  # type: ignore[attr-defined]
    logging.getLogger(name).info("event loop: %s", eventloop.resolve(cfg.server.event_loop))  # type: ignore[attr-defined]
    sys.setswitchinterval(cfg.server.switch_interval_ms / 1000)  # type: ignore[attr-defined]
    try:
        telemetry.setup_tracing(name)
        if cfg.server.metrics_port >= 0:  # type: ignore[attr-defined]
            metrics_port = start_metrics_server(cfg.server.metrics_port, cfg.server.host)  # type: ignore[attr-defined]
            # The bound port, not 0, is what start_server reports in --port-file.
            cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, metrics_port=metrics_port))  # type: ignore[attr-defined,type-var]
        eventloop.run(serve(cfg), cfg.server.event_loop)  # type: ignore[attr-defined]
    except (MeshError, OSError, ValueError) as err:
        logging.getLogger(name).error("cannot start: %s", getattr(err, "message", err))
        return 2
    finally:
        telemetry.shutdown_tracing()
    return 0
