"""Auth and rate limits at the gateway: the right status, RetryInfo, and the mesh keeps serving."""

from __future__ import annotations

import json

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from services.launcher import Mesh
from tests.helpers import image_bytes, mesh_options, serving
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc


@pytest.fixture(scope="module")
def auth_mesh(tiny_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.json"
    path.write_text(
        json.dumps(
            {
                "tenants": [
                    {
                        "id": "acme",
                        "api_keys": ["sk-acme"],
                        "max_qos": "standard",
                        "requests_per_second": 0.5,
                        "burst": 2,
                    },
                    {
                        "id": "ops",
                        "api_keys": ["sk-ops"],
                        "max_qos": "realtime",
                        "requests_per_second": 100,
                        "burst": 100,
                    },
                ]
            }
        )
    )
    with Mesh(mesh_options(tiny_model, warmup_requests=0, tenants=str(path))) as mesh:
        mesh.start(progress=lambda m: None)
        yield mesh


def call(mesh, key: str | None, qos: str = "standard"):
    md = [("qos-level", qos)] + ([("authorization", f"Bearer {key}")] if key else [])
    req = gateway_pb2.GenerateRequest(
        images=[pb.Image(data=image_bytes(4))], prompt="What is in the image?", sampling=pb.SamplingParams(max_tokens=2)
    )
    with grpc.insecure_channel(mesh.target("gateway")) as ch:
        return gateway_pb2_grpc.GatewayStub(ch).GenerateUnary(req, metadata=md, timeout=30)


def status_of(mesh, *args) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(mesh, *args)
    return info.value


def test_statuses(auth_mesh):
    assert status_of(auth_mesh, None).code() == grpc.StatusCode.UNAUTHENTICATED
    assert status_of(auth_mesh, "sk-wrong").code() == grpc.StatusCode.UNAUTHENTICATED
    denied = status_of(auth_mesh, "sk-acme", "realtime")
    assert denied.code() == grpc.StatusCode.PERMISSION_DENIED and "realtime" in denied.details()
    assert call(auth_mesh, "sk-ops", "realtime").usage.output_tokens == 2
    call(auth_mesh, "sk-acme")
    call(auth_mesh, "sk-acme")  # burst of 2 spent
    limited = status_of(auth_mesh, "sk-acme")
    assert limited.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "request rate" in limited.details()
    status = rpc_status.from_call(limited)
    retry = error_details_pb2.RetryInfo()
    assert status is not None and status.details[0].Unpack(retry)
    assert 0 < retry.retry_delay.ToNanoseconds() <= 2_000_000_000
    assert call(auth_mesh, "sk-ops").usage.output_tokens == 2  # other tenants are unaffected
    assert serving(auth_mesh)
