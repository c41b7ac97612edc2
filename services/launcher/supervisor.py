"""The mesh's three processes: spawn each from its service's config, wait for health, warm up,
watch, stop.

Order: vision and llm start together (both load weights), then the gateway. Each must
report SERVING on the standard health service before the next step. Warm-up requests
then go through the whole mesh. While serving, `wait` restarts a child that dies or stalls
(services/launcher/restarts.py), and past the restart limit names it (MeshError).

Ports: a fixed port must be free (checked before anything starts; no server shares a port).
A child given port 0 binds a free one itself and reports it in its port file; the llm reads
the vision's from there when it first needs it, and the gateway starts once both are known.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

from services.common import segments
from services.common.config import WARMUP_KEY_ENV
from services.common.flags import to_argv
from services.gateway.config import GatewayConfig
from services.launcher.mps import CudaMps
from services.launcher.options import MeshOptions
from services.launcher.ports import MeshError, RunDir, check_ports
from services.launcher.process import signals_held, spawn
from services.launcher.restarts import TICK_S, Watch, health_status
from services.launcher.warmup import warm_up, warmup_images
from services.llm.config import LlmConfig
from services.vision.config import VisionConfig


def profile_path(opts: MeshOptions, name: str) -> str | None:
    """Where server `name` writes its host profile: DIR/<name>.pstat with --profile-host DIR (a
    worker behind Envoy has a DIR of its own, services/launcher/variants.py), else nowhere."""
    return str(Path(opts.profile_host) / f"{name}.pstat") if opts.profile_host else None


@dataclass
class Child:
    name: str
    proc: subprocess.Popen


class Mesh:
    """The three processes of one local worker plus its gateway."""

    def __init__(self, opts: MeshOptions) -> None:
        self._run = RunDir()
        if opts.tls_throwaway_ca:  # cryptography loads only then (a GPU host may lack it)
            from services.launcher.certs import make_throwaway, with_tls

            hosts = [cfg.server.host for cfg in opts.configs().values()]
            opts = with_tls(opts, *make_throwaway(self._run.path, hosts))
        self.opts = opts
        self.children: list[Child] = []
        self.configs = opts.configs()
        # Port 0 (gRPC or metrics): the child binds a free one and reports it in its port file;
        # these hold the bound ports from then on.
        self.ports = {name: cfg.server.port for name, cfg in self.configs.items()}
        self.metrics_ports = {name: cfg.server.metrics_port for name, cfg in self.configs.items()}
        self.http_port = opts.gateway.http.port if opts.gateway.http.port > 0 else None  # -1: off; 0: once bound
        self._warmup_key = secrets.token_urlsafe(32)  # to the gateway in its environment only (ps shows argv)
        self._creds = opts.gateway.server.channel_credentials()
        self._mps = CudaMps(self._run.path / "mps") if opts.cuda_mps else None

    def target(self, name: str) -> str:
        """HOST:PORT of a child; for port 0, known once the child serves."""
        if self.ports[name] == 0:
            raise MeshError(f"the {name}'s port is not known before it serves")
        return f"{self.configs[name].server.host}:{self.ports[name]}"

    def http_url(self) -> str:
        """The gateway's OpenAI-compatible base URL (http://HOST:PORT/v1), once it serves with --http-port."""
        if not self.http_port:
            raise MeshError("the gateway serves no HTTP (--http-port -1), or does not serve yet")
        scheme = "https" if self.opts.gateway.server.tls_cert else "http"
        return f"{scheme}://{self.configs['gateway'].server.host}:{self.http_port}/v1"

    def _where(self, name: str) -> str:
        host = self.configs[name].server.host
        return f"{host}:{self.ports[name]}" if self.ports[name] else f"a free port of {host}"

    def _spawn(self, name: str, cfg: GatewayConfig | VisionConfig | LlmConfig) -> Child:
        # The ports it has (a restarted child takes the ones it had bound) and a fresh port file.
        port_file = self._run.port_file(name)
        port_file.unlink(missing_ok=True)
        server = dataclasses.replace(
            cfg.server, port=self.ports[name], metrics_port=self.metrics_ports[name], port_file=str(port_file)
        )
        # The launcher's to set: the flag it parsed (a directory) reached each server's config as well.
        if profile := profile_path(self.opts, name):
            Path(profile).parent.mkdir(parents=True, exist_ok=True)
        server = dataclasses.replace(server, profile_host=profile)
        cmd = [sys.executable, "-m", f"services.{name}", *to_argv(dataclasses.replace(cfg, server=server))]
        env = {k: v for k, v in os.environ.items() if k != WARMUP_KEY_ENV}
        env.update({**self.opts.extra_env, **(self._mps.env if self._mps else {})})
        if name == "gateway":
            env[WARMUP_KEY_ENV] = self._warmup_key
        if name == "vision" and self._mps and self.opts.vision_mps_percent:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(self.opts.vision_mps_percent)
        with signals_held():  # a SIGTERM now must find the child in self.children
            child = Child(name, spawn(cmd, env))
            self.children.append(child)
        return child

    def _llm_config(self) -> LlmConfig:
        """The llm's config with its vision: the address, or for port 0 the host and port file."""
        if self.ports["vision"]:
            return dataclasses.replace(self.opts.llm, vision_target=self.target("vision"))
        host = self.configs["vision"].server.host
        return dataclasses.replace(
            self.opts.llm, vision_target=host, vision_port_file=str(self._run.port_file("vision"))
        )

    def check_alive(self) -> None:
        """MeshError naming the first child that has died."""
        for child in self.children:
            code = child.proc.poll()
            if code is not None:
                why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
                raise MeshError(f"the {child.name} process {why} (its log is above)")

    def _wait_healthy(self, children: list[Child], deadline: float) -> None:
        """Wait until each child has written its port file (it does so once SERVING) and answers health."""
        pending = list(children)
        while pending:
            self.check_alive()
            if time.monotonic() > deadline:
                raise MeshError(
                    f"{', '.join(c.name for c in pending)} not healthy after {self.opts.start_timeout_s:.0f}s"
                )
            for child in list(pending):
                bound = self._run.read(child.name)
                if bound is None:
                    continue
                self.ports[child.name] = bound["port"]
                self.metrics_ports[child.name] = bound["metrics_port"]
                if "http_port" in bound:
                    self.http_port = bound["http_port"]
                if (
                    health_status(self.target(child.name), creds=self.credentials())
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    pending.remove(child)
            time.sleep(0.1)

    def start(self, progress=print) -> None:
        """Start the three and warm up; PortBusy (a MeshError) when a fixed port is taken."""
        o = self.opts
        check_ports({name: cfg.server for name, cfg in self.configs.items()})
        deadline = time.monotonic() + o.start_timeout_s
        if self._mps:
            self._mps.start(progress)
        progress(
            f"starting vision on {self._where('vision')} and llm on {self._where('llm')} (model {o.vision.model.path})"
        )
        vision = self._spawn("vision", o.vision)
        llm = self._spawn("llm", self._llm_config())
        self._wait_healthy([vision, llm], deadline)
        progress(
            f"vision ({self.target('vision')}) and llm ({self.target('llm')}) are healthy; "
            f"starting gateway on {self._where('gateway')}"
        )
        gateway = self._spawn("gateway", self._gateway_config())
        self._wait_healthy([gateway], deadline)
        self.warm_up(progress)

    def _gateway_config(self) -> GatewayConfig:
        gateway = self.opts.gateway
        if self.http_port:  # a restarted gateway keeps its HTTP port too
            gateway = dataclasses.replace(gateway, http=dataclasses.replace(gateway.http, port=self.http_port))
        return dataclasses.replace(gateway, vision_target=self.target("vision"), llm_target=self.target("llm"))

    def respawn(self, child: Child) -> Child:
        """Start a dead child again, on the ports it had, and wait until it serves (MeshError if not)."""
        self.children.remove(child)
        segments.remove_owned_by(child.proc.pid)  # what it could not unlink (killed or stalled)
        configs = {"vision": self.opts.vision, "llm": self._llm_config(), "gateway": self._gateway_config()}
        new = self._spawn(child.name, configs[child.name])
        self._wait_healthy([new], time.monotonic() + self.opts.start_timeout_s)
        return new

    def warm_up(self, progress=print) -> None:
        """--warmup-requests requests through the whole mesh (services/launcher/warmup.py)."""
        pictures = warmup_images(self.opts.warmup_images, self._run.path)
        warm_up(self, pictures, self.opts.warmup_requests, self._warmup_key, progress)

    def credentials(self) -> grpc.ChannelCredentials | None:
        """What the launcher's own calls present and verify with (mTLS; None: plaintext); the
        files are read once, not at every health check."""
        return self._creds

    def wait(self, progress=print) -> None:
        """Serve until SIGINT or SIGTERM (returns), restarting children that die or stall
        (services/launcher/restarts.py); MeshError when one is in trouble with no restart left."""
        watch = Watch(self, self.opts.restarts, self.opts.restart_window_s, progress)
        stop = {"flag": False}

        def on_signal(signum, frame):
            stop["flag"] = True

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while not stop["flag"]:
                watch.poll()
                time.sleep(TICK_S)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM the gateway first (it drains), then vision and llm together; SIGKILL stragglers
        (after --grace-s and 5 s more, unless `timeout_s` says otherwise). Then remove the
        launcher's temporary directory (port files, warm-up picture)."""
        if timeout_s is None:
            timeout_s = self.opts.gateway.server.grace_s + 5.0
        gateway = [c for c in self.children if c.name == "gateway"]
        for batch in (gateway, [c for c in self.children if c.name != "gateway"]):
            running = [child for child in batch if child.proc.poll() is None]
            for child in running:
                child.proc.send_signal(signal.SIGTERM)
            for child in running:
                try:
                    child.proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    child.proc.wait()
        for child in self.children:
            segments.remove_owned_by(child.proc.pid)
        self.children.clear()
        if self._mps:
            self._mps.stop()
        self._run.cleanup()

    def __enter__(self) -> Mesh:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
