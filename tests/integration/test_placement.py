"""`vlmesh up --placement replicate --gpus 0,1` with `--device cpu`: a worker per device (vision,
llm and gateway each) behind a real Envoy, which balances them by least outstanding requests and
moves the traffic to the other worker when one's gateway is gone. On a host with two GPUs the same
code puts each worker on its own GPU; placement's flags are checked in
tests/unit/launcher/test_placement.py."""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from services.launcher.cli import behind_envoy
from tests.helpers import image_bytes, mesh_options
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"


@pytest.fixture(scope="module")
def replicas():
    opts = mesh_options(DEMO, max_llm_batch=4, placement="replicate", gpus="0,1", envoy_admin_port=0)
    with behind_envoy(opts) as mesh:
        mesh.start(progress=lambda m: None)
        yield mesh


def ask(target: str, n: int, clients: int = 6) -> list[str]:
    """n requests from `clients` threads through `target`: each one's status name."""

    def one(i: int) -> str:
        req = gateway_pb2.GenerateRequest(
            images=[pb.Image(data=image_bytes(i, (64, 64), "PNG"))],
            prompt="What shape is this?",
            sampling=pb.SamplingParams(max_tokens=4),
        )
        try:
            stub.GenerateUnary(req, timeout=60)
            return "OK"
        except grpc.RpcError as err:
            return err.code().name

    with grpc.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        with ThreadPoolExecutor(clients) as pool:
            return list(pool.map(one, range(n)))


def requests_per_gateway(mesh) -> dict[str, int]:
    """Envoy's count of requests sent to each gateway of the weighted cluster (health checks aside)."""
    with urllib.request.urlopen(f"http://{mesh.admin[0]}:{mesh.admin[1]}/clusters", timeout=5) as r:
        lines = r.read().decode().splitlines()
    counts = {}
    for line in lines:
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == "variant-full" and parts[2] == "rq_total":
            counts[parts[1]] = int(parts[3])
    return counts


def test_a_worker_per_device_each_on_its_own_device(replicas):
    assert list(replicas.meshes) == ["full-0", "full-1"]
    for mesh in replicas.meshes.values():
        assert mesh.opts.vision.model.device == mesh.opts.llm.model.device == "cpu"
    gateways = {replicas.gateway(name) for name in replicas.meshes}
    assert len(gateways) == 2  # two gateways, each calling its own vision and llm


def test_envoy_spreads_the_requests_over_both_workers(replicas):
    before = requests_per_gateway(replicas)
    assert ask(replicas.target(), 24) == ["OK"] * 24
    after = requests_per_gateway(replicas)
    sent = {host: after[host] - before.get(host, 0) for host in after}
    assert set(sent) == {replicas.gateway(name) for name in replicas.meshes}
    assert sum(sent.values()) == 24 and min(sent.values()) >= 4, sent  # least request: both take a share


def test_a_worker_whose_gateway_is_gone_leaves_the_other_serving(replicas):
    gone = replicas.meshes["full-1"]
    gateway = next(c for c in gone.children if c.name == "gateway")
    os.kill(gateway.proc.pid, signal.SIGKILL)
    time.sleep(0.5)
    statuses = ask(replicas.target(), 12, clients=3)
    assert statuses == ["OK"] * 12, statuses  # refused connections are retried on the other worker
