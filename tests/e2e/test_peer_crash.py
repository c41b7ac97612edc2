"""A peer that dies turns into UNAVAILABLE with a clear message; nothing hangs."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.launcher import Mesh
from tests.helpers import image_bytes, mesh_options
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc

GATEWAY = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name


def request(n: int, picture: int = 3) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        images=[pb.Image(data=image_bytes(picture))],
        prompt="What is in the image?",
        sampling=pb.SamplingParams(max_tokens=n, min_tokens=n),
    )


@pytest.fixture
def mesh(tiny_model):
    with Mesh(mesh_options(tiny_model, warmup_requests=0, log_level="error")) as running:
        running.start(progress=lambda m: None)
        yield running


def kill(mesh: Mesh, name: str) -> None:
    child = next(c for c in mesh.children if c.name == name)
    child.proc.send_signal(signal.SIGKILL)
    child.proc.wait(10)


def test_vision_down(mesh):
    with grpc.insecure_channel(mesh.target("gateway")) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        assert stub.GenerateUnary(request(2), timeout=30).usage.output_tokens == 2
        kill(mesh, "vision")
        with pytest.raises(grpc.RpcError) as err:
            stub.GenerateUnary(request(2, picture=4), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "vision" in err.value.details()
        # The picture the llm still holds needs no vision (services/gateway/image_keys.py).
        assert stub.GenerateUnary(request(2), timeout=30).usage.output_tokens == 2


def test_llm_dies_mid_stream(mesh):
    with grpc.insecure_channel(mesh.target("gateway")) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        call = stub.Generate(request(450), timeout=60)
        got_first = threading.Event()
        outcome: dict = {}

        def consume():
            try:
                for _ in call:
                    got_first.set()
                outcome["code"] = grpc.StatusCode.OK
            except grpc.RpcError as err:
                outcome["code"], outcome["details"] = err.code(), err.details()
            got_first.set()

        t = threading.Thread(target=consume)
        t.start()
        assert got_first.wait(30)
        kill(mesh, "llm")
        t.join(30)
        assert outcome["code"] == grpc.StatusCode.UNAVAILABLE, outcome
        assert "llm" in outcome["details"]
        with pytest.raises(grpc.RpcError) as err:
            stub.GenerateUnary(request(2), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def gateway_health(mesh: Mesh, service: str) -> int:
    with grpc.insecure_channel(mesh.target("gateway")) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def wait_for(condition, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.05)


@pytest.mark.parametrize("peer", ["llm", "vision"])
def test_the_gateway_is_not_ready_while_a_peer_is_down_and_ready_once_it_is_back(tiny_model, peer):
    """Readiness (the gateway's own service name, and the HTTP door's /health) follows its vision and
    llm; liveness (service "") stays SERVING, so the launcher does not restart a healthy gateway."""
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    opts = mesh_options(tiny_model, warmup_requests=0, log_level="error", http_port=0)
    with Mesh(opts) as mesh:
        mesh.start(progress=lambda m: None)
        health = f"http://{mesh.configs['gateway'].server.host}:{mesh.http_port}/health"
        assert gateway_health(mesh, GATEWAY) == serving and httpx.get(health).status_code == 200
        killed_at = time.monotonic()
        kill(mesh, peer)
        wait_for(lambda: gateway_health(mesh, GATEWAY) == not_serving)
        print(f"not ready {time.monotonic() - killed_at:.2f} s after the {peer} was killed")
        assert gateway_health(mesh, "") == serving
        reply = httpx.get(health)
        assert reply.status_code == 503 and reply.json() == {"status": "no worker reachable"}
        mesh.respawn(next(c for c in mesh.children if c.name == peer))
        wait_for(lambda: gateway_health(mesh, GATEWAY) == serving)
        assert httpx.get(health).status_code == 200
        with grpc.insecure_channel(mesh.target("gateway")) as ch:
            assert gateway_pb2_grpc.GatewayStub(ch).GenerateUnary(request(2), timeout=30).usage.output_tokens == 2
