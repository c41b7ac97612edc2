"""Discovery as grpcurl does it: reflection names the services, health says SERVING."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

EXPECTED = {"gateway": "vlmesh.v1.Gateway", "vision": "vlmesh.v1.Vision", "llm": "vlmesh.v1.Llm"}


def list_services(target: str) -> set[str]:
    with grpc.insecure_channel(target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        return {s.name for r in responses for s in r.list_services_response.service}


def file_containing(target: str, symbol: str) -> list[bytes]:
    with grpc.insecure_channel(target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        req = reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)
        return [
            fd
            for r in stub.ServerReflectionInfo(iter([req]))
            for fd in r.file_descriptor_response.file_descriptor_proto
        ]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_reflection_and_health(mesh, name):
    target = mesh.target(name)
    services = list_services(target)
    assert EXPECTED[name] in services
    assert "grpc.health.v1.Health" in services
    assert file_containing(target, EXPECTED[name]), "reflection must serve the service's descriptor"
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", EXPECTED[name]):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_request_fields_are_discoverable(mesh):
    """A client built from reflection finds images/prompt/sampling and the streamed `text`."""
    from google.protobuf import descriptor_pb2

    protos = [
        descriptor_pb2.FileDescriptorProto.FromString(b)
        for b in file_containing(mesh.target("gateway"), "vlmesh.v1.Gateway")
    ]
    messages = {f"{p.package}.{m.name}": {f.name for f in m.field} for p in protos for m in p.message_type}
    assert {"images", "prompt", "sampling"} <= messages["vlmesh.v1.GenerateRequest"]
    assert "text" in messages["vlmesh.v1.GenerateResponse"]
    assert {"data", "mime_type"} <= messages["vlmesh.v1.Image"]
    assert {"max_tokens", "temperature", "top_p", "seed", "stop"} <= messages["vlmesh.v1.SamplingParams"]
