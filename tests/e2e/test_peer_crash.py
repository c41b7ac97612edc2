"""A peer that dies turns into UNAVAILABLE with a clear message; nothing hangs."""

from __future__ import annotations

import signal
import threading

import grpc
import pytest

from services.launcher import Mesh
from tests.helpers import image_bytes, mesh_options
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc


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
