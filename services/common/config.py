"""Flags every server shares, and the checks that make bad values fail at start-up."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from services.common import eventloop
from services.common.logs import LOG_FORMATS, LOG_LEVELS

# Python's GIL switch interval for processes that run an engine or batcher thread beside an
# asyncio loop (Python's default, 5 ms, delays every result the loop relays; docs/PERF.md).
SWITCH_INTERVAL_MS = 0.5
# How a CUDA hand-off's reader knows the slot is written (services/common/cuda_arena.py).
READY_SIGNALS = ("sync", "event")


@dataclass(frozen=True)
class ServerConfig:
    host: str
    port: int
    log_level: str
    grace_s: float
    metrics_port: int
    log_format: str = "json"
    switch_interval_ms: float = SWITCH_INTERVAL_MS
    port_file: str | None = None
    event_loop: str = "auto"

    def check(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is not a TCP port (0 picks a free one)")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port {self.metrics_port}: a TCP port, 0 for a free one, -1 for none")
        if self.grace_s < 0:
            raise ValueError(f"--grace-s {self.grace_s} must be >= 0")
        if not 0 < self.switch_interval_ms <= 100:
            raise ValueError(f"--switch-interval-ms {self.switch_interval_ms} must be in (0, 100]")
        eventloop.resolve(self.event_loop)


def add_server_args(parser: argparse.ArgumentParser, default_port: int, default_metrics_port: int) -> None:
    g = parser.add_argument_group("server")
    g.add_argument(
        "--host",
        default=os.environ.get("VLMESH_HOST", "127.0.0.1"),
        help="address to bind (default %(default)s)",
    )
    g.add_argument("--port", type=int, default=default_port, help="TCP port; 0 picks a free one (default %(default)s)")
    g.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="log verbosity (default %(default)s)")
    g.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="json",
        help="json lines with trace and request ids, or plain text (default %(default)s)",
    )
    g.add_argument(
        "--metrics-port",
        type=int,
        default=default_metrics_port,
        help="Prometheus /metrics port; 0 picks a free one, -1 turns it off (default %(default)s)",
    )
    g.add_argument(
        "--grace-s",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let in-flight requests finish (default %(default)s)",
    )
    g.add_argument(
        "--switch-interval-ms",
        type=float,
        default=SWITCH_INTERVAL_MS,
        help="Python's GIL switch interval (Python's own default is 5 ms). Each server runs an engine "
        "or batcher thread beside its asyncio loop; a shorter interval lets the loop relay a result "
        "sooner. On the H200 it cut W1 TTFT p50 from 101 to 73 ms (docs/PERF.md) (default %(default)s)",
    )
    g.add_argument(
        "--event-loop",
        choices=eventloop.EVENT_LOOPS,
        default="auto",
        help="asyncio event loop: uvloop when installed (auto), or asyncio's own; uvloop makes each RPC "
        "hop cheaper (docs/PERF.md) (default %(default)s)",
    )
    g.add_argument(
        "--port-file",
        default=None,
        metavar="PATH",
        help='once serving, write the bound ports to PATH as JSON ({"port": N, "metrics_port": M}). '
        "With --port 0 this is how a launcher learns a free port without racing another process for it",
    )


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        grace_s=args.grace_s,
        metrics_port=args.metrics_port,
        log_format=args.log_format,
        switch_interval_ms=args.switch_interval_ms,
        port_file=args.port_file,
        event_loop=args.event_loop,
    )


def add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--model", required=True, help="local directory of a Hugging Face LLaVA checkpoint")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda when available)")
    g.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="weights and activations; auto = bfloat16 on CUDA, float32 on CPU",
    )
    g.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 = torch's default")


@dataclass(frozen=True)
class ModelConfig:
    path: str
    device: str
    dtype: str
    threads: int

    def apply_threads(self) -> None:
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)


def model_config(args: argparse.Namespace) -> ModelConfig:
    if args.threads < 0:
        raise ValueError(f"--threads {args.threads} must be >= 0")
    return ModelConfig(path=args.model, device=args.device, dtype=args.dtype, threads=args.threads)


def resolve_device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this host")
    return device
