"""No two servers on one port: a busy port fails at start, in one line that names the service,
the address and the flag to change; ports asked as 0 are bound by each child alone."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
from collections import Counter
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from services.common.config import ServerConfig
from services.common.server import PortInUse, start_server
from tests.helpers import image_bytes, serving, settle
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc

VLMESH = [sys.executable, "-m", "services.cli"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
BUSY = "the port is in use (another mesh?); choose another with"


def listeners() -> Counter[int]:
    """LISTEN sockets per local port, IPv4 and IPv6, as the kernel lists them."""
    count: Counter[int] = Counter()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                count[int(fields[1].rsplit(":", 1)[1], 16)] += 1
    return count


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*VLMESH, *args], capture_output=True, text=True, env=ENV, timeout=timeout)


@pytest.mark.parametrize("busy", ["gateway", "llm", "gateway-metrics"])
def test_a_second_mesh_on_the_ports_of_a_running_one_fails_at_start(mesh, tiny_model, busy):
    ports = {name: "0" for name in ("gateway", "vision", "llm")}
    metrics = "-1,-1,-1"  # the separate spelling of -1 (argparse alone refuses it)
    if busy == "gateway":
        ports = {name: str(port) for name, port in mesh.ports.items()}  # the whole running mesh's
        want = f"the gateway cannot bind 127.0.0.1:{mesh.ports['gateway']}: {BUSY} --gateway-port"
    elif busy == "llm":
        ports["llm"] = str(mesh.ports["llm"])
        want = f"the llm cannot bind 127.0.0.1:{mesh.ports['llm']}: {BUSY} --llm-port"
    else:
        metrics = f"{mesh.metrics_ports['gateway']},-1,-1"
        address = f"127.0.0.1:{mesh.metrics_ports['gateway']}"
        want = f"the gateway cannot bind its metrics port {address}: {BUSY} --metrics-ports"
    flags = [f"--{name}-port={port}" for name, port in ports.items()]
    result = run("up", "--model", str(tiny_model), *flags, "--metrics-ports", metrics, "--threads", "1")
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [f"vlmesh up: error: {want}"]
    assert serving(mesh)  # the running mesh is untouched


@pytest.mark.parametrize("name", ["gateway", "vision", "llm"])
def test_serve_on_a_busy_port_fails_in_one_line(tiny_model, name):
    model = [] if name == "gateway" else ["--model", str(tiny_model)]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run("serve", name, *model, "--port", str(port), "--metrics-port", "-1", timeout=60)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"vlmesh serve {name}: cannot bind 127.0.0.1:{port}: {BUSY} --port"]


def test_serve_on_a_busy_metrics_port_fails_in_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run("serve", "gateway", "--port", "0", "--metrics-port", str(port), "--log-level", "warning")
    assert result.returncode == 2
    want = f"vlmesh serve gateway: cannot bind the metrics port 127.0.0.1:{port}: {BUSY} --metrics-port"
    assert result.stderr.splitlines() == [want]


def test_a_server_refuses_a_port_that_a_sharing_server_holds():
    """grpcio's default server binds with SO_REUSEPORT; ours must not join it on its port."""
    sharer = grpc.server(futures.ThreadPoolExecutor(max_workers=1))  # grpcio's defaults
    port = sharer.add_insecure_port("127.0.0.1:0")
    sharer.start()
    cfg = ServerConfig(host="127.0.0.1", port=port, metrics_port=-1)

    async def start() -> None:
        running = await start_server(cfg, [], [])
        await running.server.stop(None)  # reached only when the port was shared

    try:
        with pytest.raises(PortInUse, match=re.escape(f"cannot bind 127.0.0.1:{port}: {BUSY} --port")):
            asyncio.run(start())
    finally:
        sharer.stop(None)


def test_nothing_listens_twice_on_a_mesh_with_ports_0(mesh):
    ports = [*mesh.ports.values(), *mesh.metrics_ports.values()]
    assert 0 not in ports and len(set(ports)) == 6
    intruder = grpc.server(futures.ThreadPoolExecutor(max_workers=1))  # SO_REUSEPORT, as grpcio defaults
    try:
        try:
            bound = intruder.add_insecure_port(f"127.0.0.1:{mesh.ports['gateway']}")
        except RuntimeError:  # grpcio raises where it used to return 0
            bound = 0
        if bound:
            intruder.start()
        count = listeners()
        assert {port: count[port] for port in ports} == dict.fromkeys(ports, 1)
        assert bound == 0
    finally:
        intruder.stop(None)
    assert serving(mesh)


def test_the_llm_finds_a_vision_on_port_0_through_its_port_file(mesh):
    """The llm starts before the vision's port is known; it releases each feature lease to the
    vision at once (the vision's TTL, 30 s, would reclaim it otherwise)."""
    leased = 'vlmesh_arena_pages{arena="shm",state="leased"}'
    image = pb.Image(data=image_bytes(11))
    req = gateway_pb2.GenerateRequest(images=[image], prompt="Describe it.", sampling=pb.SamplingParams(max_tokens=2))
    with grpc.insecure_channel(mesh.target("gateway")) as ch:
        gateway_pb2_grpc.GatewayStub(ch).GenerateUnary(req, timeout=60)
    assert settle(mesh.metrics_ports["vision"], leased, 0.0, timeout=10) == 0.0
