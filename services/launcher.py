"""`vlmesh up`: start vision, llm and gateway as separate processes, check them, warm up.

Order: vision and llm start together (both load weights), then the gateway. Each must
report SERVING on the standard health service before the next step. Warm-up requests
then go through the whole mesh, and one line `gateway ready on HOST:PORT` says the
mesh can serve. If any child dies, the launcher names it, stops the others and exits
non-zero. SIGINT/SIGTERM stop all three gracefully.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import READY_SIGNALS
from services.common.eventloop import EVENT_LOOPS
from services.common.logs import LOG_LEVELS
from services.gateway.admission import add_admission_args, admission_argv, admission_config

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}


class MeshError(RuntimeError):
    """The mesh could not start or a child died."""


def free_port(host: str) -> int:
    """A port that is free now, for a server that cannot share a reservation (see reserve_port).

    Picked below the kernel's ephemeral range, which outgoing connections draw their source
    ports from, so only a process that binds this very port explicitly can take it first.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    candidates = random.sample(range(10000, low), min(64, low - 10000)) if low > 10000 else []
    for port in [*candidates, 0]:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise MeshError(f"no free port on {host}")


def reserve_port(host: str) -> socket.socket:
    """A socket bound to a free port with SO_REUSEPORT, held until the server that gets the port is up.

    gRPC servers bind with SO_REUSEPORT, so the child can bind the same port; meanwhile the kernel
    gives the port to nobody else (a port merely picked and released can become some connection's
    source port before the child binds it, and the child then fails to start). The socket never
    listens, so every connection goes to the child.
    """
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind((host, 0))
    return s


@dataclass
class MeshOptions:
    model: str
    host: str = "127.0.0.1"
    gateway_port: int = 50051
    vision_port: int = 50052
    llm_port: int = 50053
    # Prometheus /metrics ports: 0 picks free ones, -1 turns them off.
    metrics_ports: tuple[int, int, int] = (9464, 9465, 9466)
    vision_engine: str = "torch"
    llm_engine: str = "native"
    max_vision_batch: int = 4
    max_llm_batch: int = 8
    ready_signal: str = "sync"  # CUDA hand-off readiness: the vision syncs, or passes an IPC event
    device: str = "auto"
    dtype: str = "auto"
    threads: int = 0
    warmup_images: str | None = None
    warmup_requests: int = 10
    log_level: str = "info"
    event_loop: str = "auto"
    tenants: str | None = None
    admission_flags: tuple[str, ...] = ()  # --max-in-flight and the budgets, passed to the gateway
    start_timeout_s: float = 180.0
    extra_env: dict[str, str] = field(default_factory=dict)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen


class Mesh:
    """The three processes of one local worker plus its gateway."""

    def __init__(self, opts: MeshOptions) -> None:
        self.opts = opts
        self.children: list[Child] = []
        o = opts
        # gRPC port 0: a free port reserved here until its server is up (the llm needs the
        # vision's address when it starts). Metrics port 0: the child binds a free one and
        # reports it in its port file.
        self._reserved: dict[str, socket.socket] = {}
        self.ports = {"gateway": o.gateway_port, "vision": o.vision_port, "llm": o.llm_port}
        for name, port in self.ports.items():
            if port == 0:
                self._reserved[name] = reserve_port(o.host)
                self.ports[name] = self._reserved[name].getsockname()[1]
        self.metrics_ports = dict(zip(("gateway", "vision", "llm"), o.metrics_ports, strict=True))
        self._port_dir = tempfile.TemporaryDirectory(prefix="vlmesh-ports-")

    def target(self, name: str) -> str:
        return f"{self.opts.host}:{self.ports[name]}"

    def _port_file(self, name: str) -> Path:
        return Path(self._port_dir.name) / f"{name}.json"

    def _spawn(self, name: str, args: list[str]) -> Child:
        o = self.opts
        cmd = [
            sys.executable,
            "-m",
            f"services.{name}",
            "--host",
            o.host,
            "--port",
            str(self.ports[name]),
            "--metrics-port",
            str(self.metrics_ports[name]),
            "--port-file",
            str(self._port_file(name)),
            "--log-level",
            o.log_level,
            "--event-loop",
            o.event_loop,
            *args,
        ]
        env = {**os.environ, **o.extra_env}
        # Own process group: a Ctrl-C at the terminal reaches the launcher, which stops children in order.
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        child = Child(name, proc)
        self.children.append(child)
        return child

    def _check_alive(self) -> None:
        for child in self.children:
            code = child.proc.poll()
            if code is not None:
                why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
                raise MeshError(f"the {child.name} process {why} (its log is above)")

    def _wait_healthy(self, children: list[Child], deadline: float) -> None:
        """Wait until each child has written its port file (it does so once SERVING) and answers health."""
        pending = list(children)
        while pending:
            self._check_alive()
            if time.monotonic() > deadline:
                raise MeshError(
                    f"{', '.join(c.name for c in pending)} not healthy after {self.opts.start_timeout_s:.0f}s"
                )
            for child in list(pending):
                path = self._port_file(child.name)
                if not path.exists():
                    continue
                self.metrics_ports[child.name] = json.loads(path.read_text())["metrics_port"]
                if health_status(self.target(child.name)) == health_pb2.HealthCheckResponse.SERVING:
                    pending.remove(child)
                    reservation = self._reserved.pop(child.name, None)
                    if reservation is not None:
                        reservation.close()
            time.sleep(0.1)

    def start(self, progress=print) -> None:
        o = self.opts
        model = ["--model", o.model, "--device", o.device, "--dtype", o.dtype, "--threads", str(o.threads)]
        deadline = time.monotonic() + o.start_timeout_s
        progress(f"starting vision on {self.target('vision')} and llm on {self.target('llm')} (model {o.model})")
        vision = self._spawn(
            "vision",
            [
                *model,
                "--vision-engine",
                o.vision_engine,
                "--max-vision-batch",
                str(o.max_vision_batch),
                "--ready-signal",
                o.ready_signal,
            ],
        )
        llm = self._spawn(
            "llm",
            [
                *model,
                "--llm-engine",
                o.llm_engine,
                "--max-llm-batch",
                str(o.max_llm_batch),
                "--vision-target",
                self.target("vision"),
            ],
        )
        self._wait_healthy([vision, llm], deadline)
        progress(f"vision and llm are healthy; starting gateway on {self.target('gateway')}")
        gateway_args = [
            "--vision-target",
            self.target("vision"),
            "--llm-target",
            self.target("llm"),
            "--admission-parallelism",
            str(o.max_llm_batch),
            *o.admission_flags,
        ]
        if o.tenants:
            gateway_args += ["--tenants", o.tenants]
        gateway = self._spawn("gateway", gateway_args)
        self._wait_healthy([gateway], deadline)
        self.warm_up(progress)

    def warm_up(self, progress=print) -> None:
        from services.client import build_request
        from vlmesh.v1 import gateway_pb2_grpc

        n = self.opts.warmup_requests
        if n <= 0:
            return
        images = warmup_images(self.opts.warmup_images)
        progress(f"warming up: {n} requests through the mesh")
        start = time.perf_counter()
        with grpc.insecure_channel(self.target("gateway")) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            for i in range(n):
                self._check_alive()
                path = images[i % len(images)]
                req = build_request(path, "What is in the image?", 4, None, None, [])
                try:
                    stub.GenerateUnary(req, timeout=self.opts.start_timeout_s)
                except grpc.RpcError as err:
                    self._check_alive()
                    raise MeshError(
                        f"warm-up request {i + 1} with {path} failed: {err.code().name}: {err.details()}"
                    ) from err
        progress(f"warm-up done in {time.perf_counter() - start:.1f}s")

    def wait(self) -> None:
        """Block until a child dies (raises MeshError) or a signal arrives (returns)."""
        stop = {"flag": False}

        def on_signal(signum, frame):
            stop["flag"] = True

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while not stop["flag"]:
                self._check_alive()
                time.sleep(0.2)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the gateway first (it drains), then vision and llm; SIGKILL stragglers."""
        order = sorted(self.children, key=lambda c: c.name != "gateway")
        for child in order:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
                try:
                    child.proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    child.proc.wait()
        self.children.clear()
        for reservation in self._reserved.values():
            reservation.close()
        self._reserved.clear()
        self._port_dir.cleanup()

    def __enter__(self) -> Mesh:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def health_status(target: str, timeout: float = 1.0) -> int:
    try:
        with grpc.insecure_channel(target) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            return resp.status
    except grpc.RpcError:
        return health_pb2.HealthCheckResponse.UNKNOWN


def warmup_images(directory: str | None) -> list[Path]:
    """Images from --warmup-images DIR, or one synthetic picture when none is given."""
    if directory:
        root = Path(directory)
        found = sorted(p for p in root.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES) if root.is_dir() else []
        if not found:
            raise MeshError(f"--warmup-images {directory}: no image files there")
        return found
    from PIL import Image

    path = Path(os.environ.get("TMPDIR", "/tmp")) / "vlmesh-warmup.png"
    buf = io.BytesIO()
    Image.new("RGB", (224, 224), (230, 230, 230)).save(buf, format="PNG")
    path.write_bytes(buf.getvalue())
    return [path]


def add_mesh_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="local directory of a Hugging Face LLaVA checkpoint, or preset:NAME (random weights)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address all three servers bind (default %(default)s)")
    p.add_argument(
        "--gateway-port",
        type=int,
        default=50051,
        help="public port; 0 picks a free one (default %(default)s)",
    )
    p.add_argument("--vision-port", type=int, default=50052, help="0 picks a free one (default %(default)s)")
    p.add_argument("--llm-port", type=int, default=50053, help="0 picks a free one (default %(default)s)")
    p.add_argument("--vision-engine", default="torch", help="vision implementation (default %(default)s)")
    p.add_argument("--llm-engine", default="native", help="llm engine (default %(default)s)")
    p.add_argument("--max-vision-batch", type=int, default=4, help="images per ViT forward (default %(default)s)")
    p.add_argument("--max-llm-batch", type=int, default=8, help="sequences decoded together (default %(default)s)")
    p.add_argument(
        "--ready-signal",
        default="sync",
        choices=READY_SIGNALS,
        help="CUDA hand-off: the vision synchronises before replying, or passes an interprocess CUDA event "
        "the llm's stream waits on (default %(default)s)",
    )
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default %(default)s)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads per service; 0 = default")
    p.add_argument("--warmup-images", default=None, metavar="DIR", help="images for the warm-up requests")
    p.add_argument(
        "--warmup-requests",
        type=int,
        default=10,
        help="warm-up requests before serving (default %(default)s)",
    )
    p.add_argument(
        "--metrics-ports",
        default="9464,9465,9466",
        help="Prometheus /metrics ports of gateway,vision,llm; 0 = free, -1 = off (default %(default)s)",
    )
    p.add_argument(
        "--tenants",
        default=None,
        metavar="FILE",
        help="JSON tenants file (API keys, max qos-level, rate limits); auth is off without it",
    )
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    p.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default="auto",
        help="the servers' asyncio loop: uvloop when installed (auto), or asyncio's own (default %(default)s)",
    )
    add_admission_args(p)


def options_from_args(args: argparse.Namespace) -> MeshOptions:
    return MeshOptions(
        model=args.model,
        host=args.host,
        gateway_port=args.gateway_port,
        vision_port=args.vision_port,
        llm_port=args.llm_port,
        vision_engine=args.vision_engine,
        llm_engine=args.llm_engine,
        max_vision_batch=args.max_vision_batch,
        max_llm_batch=args.max_llm_batch,
        ready_signal=args.ready_signal,
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        warmup_images=args.warmup_images,
        warmup_requests=args.warmup_requests,
        metrics_ports=tuple(int(x) for x in args.metrics_ports.split(",")),
        tenants=args.tenants,
        admission_flags=tuple(admission_argv(args)),
        log_level=args.log_level,
        event_loop=args.event_loop,
    )


def up(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="vlmesh up", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_mesh_args(p)
    args = p.parse_args(argv)
    from services.model.presets import resolve_model

    try:
        admission_config(args, args.max_llm_batch)  # a bad admission flag fails here, not in the gateway
    except ValueError as err:
        p.error(str(err))
    args.model = resolve_model(args.model)  # preset:NAME -> its directory, made once before the children start
    if not (Path(args.model) / "config.json").is_file():
        p.error(f"--model {args.model}: not a checkpoint directory (no config.json)")
    try:
        warmup_images(args.warmup_images)  # fail before starting anything
    except MeshError as err:
        p.error(str(err))
    mesh = Mesh(options_from_args(args))

    def say(msg: str) -> None:
        print(f"vlmesh up: {msg}", file=sys.stderr, flush=True)

    try:
        mesh.start(say)
        print(f"gateway ready on {mesh.target('gateway')}", flush=True)
        mesh.wait()
        say("stopping")
        return 0
    except MeshError as err:
        say(f"error: {err}")
        return 1
    except KeyboardInterrupt:
        say("interrupted; stopping")
        return 0
    finally:
        mesh.stop()
