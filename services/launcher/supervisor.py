"""The mesh's three processes: spawn each from its service's config, wait for health, warm up,
watch, stop.

Order: vision and llm start together (both load weights), then the gateway. Each must
report SERVING on the standard health service before the next step. Warm-up requests
then go through the whole mesh. If any child dies, `wait` names it (MeshError).
"""

from __future__ import annotations

import dataclasses
import io
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.flags import flag, to_argv
from services.gateway.config import GatewayConfig
from services.launcher.ports import MeshError, PortFiles, reserve_port
from services.llm.config import LlmConfig
from services.vision.config import VisionConfig

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}


@dataclass
class MeshOptions:
    """One config per service (port 0: a free one; metrics port 0: the child picks one, -1: none),
    and the launcher's own settings.

    The gateway's peer targets and each --port-file are filled in at start; the gateway's
    admission.parallelism should be the llm's max_batch (from_flags sees to it).
    """

    FLAGS_TITLE = "mesh"

    gateway: GatewayConfig
    vision: VisionConfig
    llm: LlmConfig
    warmup_images: str | None = flag(
        "--warmup-images", default=None, metavar="DIR", help="images for the warm-up requests"
    )
    warmup_requests: int = flag(
        "--warmup-requests", default=10, help="warm-up requests before serving (default %(default)s)"
    )
    start_timeout_s: float = 180.0
    extra_env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_flags(cls, argv: Sequence[str] = (), **flags) -> MeshOptions:
        """The options `vlmesh up` builds from these flags, by dest (model=..., max_llm_batch=16,
        metrics_ports=(0, 0, 0)) and/or as `argv`; the rest take their defaults. ValueError on a
        bad value, TypeError on a flag `vlmesh up` does not have."""
        from services.launcher.cli import options_from_flags  # the CLI's parser imports this module

        return options_from_flags(argv, **flags)

    def configs(self) -> dict[str, GatewayConfig | VisionConfig | LlmConfig]:
        return {"gateway": self.gateway, "vision": self.vision, "llm": self.llm}


@dataclass
class Child:
    name: str
    proc: subprocess.Popen


class Mesh:
    """The three processes of one local worker plus its gateway."""

    def __init__(self, opts: MeshOptions) -> None:
        self.opts = opts
        self.children: list[Child] = []
        self.configs = opts.configs()
        # gRPC port 0: a free port reserved here until its server is up (the llm needs the
        # vision's address when it starts). Metrics port 0: the child binds a free one and
        # reports it in its port file.
        self._reserved: dict[str, socket.socket] = {}
        self.ports = {name: cfg.server.port for name, cfg in self.configs.items()}
        for name, port in self.ports.items():
            if port == 0:
                self._reserved[name] = reserve_port(self.configs[name].server.host)
                self.ports[name] = self._reserved[name].getsockname()[1]
        self.metrics_ports = {name: cfg.server.metrics_port for name, cfg in self.configs.items()}
        self._port_files = PortFiles()

    def target(self, name: str) -> str:
        return f"{self.configs[name].server.host}:{self.ports[name]}"

    def _spawn(self, name: str, cfg: GatewayConfig | VisionConfig | LlmConfig) -> Child:
        server = dataclasses.replace(cfg.server, port=self.ports[name], port_file=str(self._port_files.path(name)))
        cmd = [sys.executable, "-m", f"services.{name}", *to_argv(dataclasses.replace(cfg, server=server))]
        env = {**os.environ, **self.opts.extra_env}
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
                bound = self._port_files.read(child.name)
                if bound is None:
                    continue
                self.metrics_ports[child.name] = bound["metrics_port"]
                if health_status(self.target(child.name)) == health_pb2.HealthCheckResponse.SERVING:
                    pending.remove(child)
                    reservation = self._reserved.pop(child.name, None)
                    if reservation is not None:
                        reservation.close()
            time.sleep(0.1)

    def start(self, progress=print) -> None:
        o = self.opts
        deadline = time.monotonic() + o.start_timeout_s
        progress(
            f"starting vision on {self.target('vision')} and llm on {self.target('llm')} (model {o.vision.model.path})"
        )
        vision = self._spawn("vision", o.vision)
        llm = self._spawn("llm", dataclasses.replace(o.llm, vision_target=self.target("vision")))
        self._wait_healthy([vision, llm], deadline)
        progress(f"vision and llm are healthy; starting gateway on {self.target('gateway')}")
        gateway = self._spawn(
            "gateway",
            dataclasses.replace(o.gateway, vision_target=self.target("vision"), llm_target=self.target("llm")),
        )
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
        self._port_files.cleanup()

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
