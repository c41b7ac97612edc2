"""Ports for `vlmesh up`: the check that its fixed ports are free before anything starts, free
ports for servers outside the mesh, and the private directory where each child reports the
ports it bound.

No reservations: a child given port 0 binds a free one itself and writes it to its port file.
Nothing here shares a port (SO_REUSEPORT), so a busy port fails instead of being split.
"""

from __future__ import annotations

import json
import random
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path

from services.common.config import ServerConfig
from services.common.server import PortInUse, port_in_use


class MeshError(RuntimeError):
    """The mesh could not start or a child died."""


class PortBusy(MeshError):
    """A port the mesh was told to use is taken (`vlmesh up` exits 2)."""


def check_ports(servers: Mapping[str, ServerConfig], http_port: int = -1) -> None:
    """Raise PortBusy, naming the service, the address and `vlmesh up`'s flag, for the first fixed
    port (gRPC, metrics, the gateway's HTTP) that some other process listens on. Port 0 and -1
    are skipped."""
    for name, cfg in servers.items():
        if port_in_use(cfg.host, cfg.port):
            raise PortBusy(f"the {name} {PortInUse(f'{cfg.host}:{cfg.port}', f'--{name}-port')}")
    for name, cfg in servers.items():
        if cfg.metrics_port > 0 and port_in_use(cfg.host, cfg.metrics_port):
            busy = PortInUse(f"{cfg.host}:{cfg.metrics_port}", "--metrics-ports", what="its metrics port ")
            raise PortBusy(f"the {name} {busy}")
    host = servers["gateway"].host if "gateway" in servers else "127.0.0.1"
    if http_port > 0 and port_in_use(host, http_port):
        raise PortBusy(f"the gateway {PortInUse(f'{host}:{http_port}', '--http-port', what='its HTTP port ')}")


def free_port(host: str) -> int:
    """A port that is free now, for a server outside the mesh that cannot report the port it
    bound (Prometheus, Phoenix, vLLM's server in tests and benchmarks).

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


class RunDir:
    """The launcher's private temporary directory, removed on stop: each child writes its bound
    ports to `port_file(name)` (its --port-file) once it is SERVING, so a file's presence means the
    child is up; the synthetic warm-up picture goes here too."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="vlmesh-")
        self.path = Path(self._dir.name)

    def port_file(self, name: str) -> Path:
        return self.path / f"{name}.ports.json"

    def read(self, name: str) -> dict[str, int] | None:
        """{"port": N, "metrics_port": M} once the child has written it, else None."""
        path = self.port_file(name)
        return json.loads(path.read_text()) if path.exists() else None

    def cleanup(self) -> None:
        self._dir.cleanup()
