"""Ports for `vlmesh up`: free ones, reservations held until a child binds, and the port files
through which each child reports the ports it bound."""

from __future__ import annotations

import json
import random
import socket
import tempfile
from pathlib import Path


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


class PortFiles:
    """One private directory of port files: each child writes its bound ports to `path(name)`
    (its --port-file) once it is SERVING, so a file's presence means the child is up."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="vlmesh-ports-")

    def path(self, name: str) -> Path:
        return Path(self._dir.name) / f"{name}.json"

    def read(self, name: str) -> dict[str, int] | None:
        """{"port": N, "metrics_port": M} once the child has written it, else None."""
        path = self.path(name)
        return json.loads(path.read_text()) if path.exists() else None

    def cleanup(self) -> None:
        self._dir.cleanup()
