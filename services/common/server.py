"""Start a `grpc.aio` server with health, reflection and a graceful stop on SIGTERM."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import eventloop, gcpause, glibc_malloc, host_profile, telemetry
from services.common.config import ServerConfig
from services.common.errors import MeshError
from services.common.logs import setup_logging
from services.common.undecodable import RefuseUndecodable

log = logging.getLogger(__name__)

# Images and inline tensors exceed gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)
# The mesh's own calls (gateway -> vision, llm; llm -> vision) ping their peer every second and
# give up on a connection whose pings go unanswered for a second: a stalled peer (SIGSTOP, a
# hung process) fails its calls with UNAVAILABLE within about 2 s, as a dead one does at once.
KEEPALIVE_MS = 1000
INTERNAL_OPTIONS = (
    *GRPC_OPTIONS,
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_MS),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_MS),  # grpcio >= 1.6x times a ping out here (60 s by default)
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # A peer that restarts is back within seconds, on the same port: reconnect soon after it, not
    # after gRPC's default backoff, which grows to two minutes while the peer is away.
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
# grpcio binds servers with SO_REUSEPORT unless told not to, and a second server on a busy port
# then starts without error and takes half its connections. No port sharing: a busy port fails.
# Servers accept those pings (by default a ping more often than every 5 min is a strike).
SERVER_OPTIONS = (
    *GRPC_OPTIONS,
    ("grpc.so_reuseport", 0),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
)


class PortInUse(OSError):
    """Another process listens on the port; the message names the address and the flag to change."""

    def __init__(self, address: str, flag: str, what: str = "") -> None:
        super().__init__(f"cannot bind {what}{address}: the port is in use (another mesh?); choose another with {flag}")


def port_in_use(host: str, port: int) -> bool:
    """Whether some socket listens on host:port: a plain bind test (SO_REUSEADDR, as gRPC binds, so
    closed connections in TIME_WAIT do not count; no SO_REUSEPORT, so a sharing server does).
    Port 0 is never in use; an address this host does not have is left to the real bind to report."""
    if port == 0:
        return False
    try:
        addresses = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError):
        return False
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(address)
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    return True
    return False


def _status(serving: bool) -> int:
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class RunningServer:
    """A started server. Its health: the overall status (service "") is liveness, SERVING until it
    drains; each service's own name is readiness, which a service may also lower while it cannot
    serve (the gateway without a reachable worker: services/gateway/readiness.py)."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int
    service_names: tuple[str, ...]
    draining: bool = False

    async def set_serving(self, serving: bool) -> None:
        """Liveness and readiness together (NOT_SERVING: the server drains)."""
        self.draining = not serving
        for name in ("", *self.service_names):
            await self.health.set(name, _status(serving))

    async def set_ready(self, ready: bool) -> None:
        """Readiness alone; a draining server stays NOT_SERVING."""
        if self.draining:
            return
        for name in self.service_names:
            await self.health.set(name, _status(ready))


async def start_server(
    cfg: ServerConfig,
    register: Iterable[Callable[[grpc.aio.Server], None]],
    service_names: Iterable[str],
    other_ports: Mapping[str, int] | None = None,
    public: bool = False,
) -> RunningServer:
    """Bind, register the servicers plus health and reflection, start, and report SERVING.

    Port 0 picks a free port; the bound one is returned, and written to `cfg.port_file`
    when one is given (after SERVING, so the file's presence means "ready"), with
    `other_ports` (e.g. {"http_port": 8000}: ports the service bound itself, before this).
    TLS with --tls-cert; callers' certificates required with --tls-ca unless `public` (the gateway).
    """
    interceptors = [RefuseUndecodable(), *telemetry.server_interceptors()]
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
    for add in register:
        add(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = tuple(service_names)
    reflection.enable_server_reflection(
        (*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    address = f"{cfg.host}:{cfg.port}"
    creds = cfg.server_credentials(require_client=not public)
    try:
        bound = server.add_insecure_port(address) if creds is None else server.add_secure_port(address, creds)
    except RuntimeError:  # grpcio raises instead of returning 0 since 1.5x
        bound = 0
    if bound == 0:
        if port_in_use(cfg.host, cfg.port):
            raise PortInUse(address, "--port")
        raise OSError(f"cannot bind {address}: not an address of this host?")
    if cfg.gc_freeze:  # the service is built: what is alive now lives as long as the process
        gcpause.freeze_startup_heap()
    await server.start()
    host_profile.start(cfg.profile_host)  # serving from here: the load and compile stay out of it
    running = RunningServer(server, health_servicer, bound, names)
    await running.set_serving(True)
    if cfg.port_file:
        write_port_file(cfg.port_file, bound, cfg.metrics_port, other_ports)
    return running


def write_port_file(path: str, port: int, metrics_port: int, other_ports: Mapping[str, int] | None = None) -> None:
    """Write the bound ports atomically: a reader sees the whole file or none."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"port": port, "metrics_port": metrics_port, **(other_ports or {})}, f)
    os.replace(tmp, path)


async def serve_until_signal(
    running: RunningServer,
    grace_s: float,
    on_stop: Callable[[], object] | None = None,
    drain_also: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT, then stop gracefully.

    Order: report NOT_SERVING (load balancers drain), stop accepting new RPCs, let
    in-flight RPCs finish for up to `grace_s`, then run `on_stop` (engine threads, arenas).
    `drain_also` (another door, e.g. HTTP) stops alongside the gRPC server.
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
        await asyncio.gather(running.server.stop(grace_s), *([drain_also()] if drain_also else []))
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
    fix (a bad checkpoint, a missing device). A busy port fails before any weights load, in
    one line that names the address and the flag to change.
    """
    try:
        cfg = parse(argv)
    except ValueError as err:
        print(f"vlmesh serve {name}: error: {err}", file=sys.stderr)
        return 2
    server_cfg: ServerConfig = cfg.server  # type: ignore[attr-defined]
    if port_in_use(server_cfg.host, server_cfg.port):
        busy = PortInUse(f"{server_cfg.host}:{server_cfg.port}", "--port")
        print(f"vlmesh serve {name}: {busy}", file=sys.stderr)
        return 2
    setup_logging(server_cfg.log_level, name, server_cfg.log_format)
    logging.getLogger(name).info("event loop: %s", eventloop.resolve(server_cfg.event_loop))
    sys.setswitchinterval(server_cfg.switch_interval_ms / 1000)
    glibc_malloc.cap_arenas(server_cfg.malloc_arenas)  # before the servers start their threads
    glibc_malloc.hold_heap(server_cfg.malloc_hold_mib)
    gcpause.watch_pauses(name)
    try:
        telemetry.setup_tracing(name)
        if server_cfg.metrics_port >= 0:
            metrics_port = _start_metrics(server_cfg)
            # The bound port, not 0, is what start_server reports in --port-file.
            cfg = dataclasses.replace(cfg, server=dataclasses.replace(server_cfg, metrics_port=metrics_port))  # type: ignore[type-var]
        eventloop.run(serve(cfg), server_cfg.event_loop)
    except PortInUse as err:  # lost a race for the port since the check above
        print(f"vlmesh serve {name}: {err}", file=sys.stderr)
        return 2
    except (MeshError, OSError, ValueError) as err:
        logging.getLogger(name).error("cannot start: %s", getattr(err, "message", err))
        return 2
    finally:
        host_profile.stop()
        telemetry.shutdown_tracing()
    return 0


def _start_metrics(cfg: ServerConfig) -> int:
    # Imported here: the launcher imports this module for its port check, and prometheus_client
    # brings an HTTP server along.
    from services.common.metrics import start_metrics_server

    try:
        return start_metrics_server(cfg.metrics_port, cfg.host)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise PortInUse(f"{cfg.host}:{cfg.metrics_port}", "--metrics-port", what="the metrics port ") from err
        raise
