"""The gateway's access log in a real mesh with --tenants: answered and refused requests each
write one JSON line in the gateway's own log.

The mesh's children inherit the test process's stderr; `capfd` captures it at the file-descriptor
level, so the gateway's lines are read as an operator reads them, from the process's output.
"""

from __future__ import annotations

import json
import time

import grpc
import pytest

from services.launcher import Mesh
from tests.helpers import image_bytes, mesh_options
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc

ACCESS_LOGGER = "services.gateway.access_log"


def access_lines(text: str) -> list[dict]:
    """The gateway's access-log lines among the mesh's stderr lines."""
    out = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("service") == "gateway" and record.get("logger") == ACCESS_LOGGER:
            out.append(record)
    return out


def request(request_id: str) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        request_id=request_id,
        images=[pb.Image(data=image_bytes(4))],
        prompt="What is in the image?",
        sampling=pb.SamplingParams(max_tokens=2),
    )


def test_answered_and_refused_requests_each_write_one_line(tiny_model, tmp_path, capfd):
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": [{"id": "acme", "api_keys": ["sk-acme"], "max_qos": "standard"}]}))
    opts = mesh_options(tiny_model, warmup_requests=0, tenants=str(path), log_level="info")
    with Mesh(opts) as mesh:
        mesh.start(progress=lambda m: None)
        with grpc.insecure_channel(mesh.target("gateway")) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            with pytest.raises(grpc.RpcError) as refused:
                stub.GenerateUnary(request("no-key"), timeout=30)
            answered = stub.GenerateUnary(
                request("with-key"),
                metadata=[("authorization", "Bearer sk-acme")],
                timeout=30,
            )
        seen = ""
        deadline = time.monotonic() + 10
        while len(access_lines(seen)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
            seen += capfd.readouterr().err
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert answered.usage.output_tokens == 2
    found = access_lines(seen + capfd.readouterr().err)  # all of it: the mesh has stopped
    assert sorted(line["request.id"] for line in found) == ["no-key", "with-key"], seen[-4000:]  # one each
    lines = {line["request.id"]: line for line in found}
    assert lines["no-key"]["status"] == "UNAUTHENTICATED"
    assert (lines["no-key"]["tenant.id"], lines["no-key"]["output_tokens"]) == (None, 0)
    assert (lines["with-key"]["status"], lines["with-key"]["tenant.id"]) == ("OK", "acme")
    assert (lines["with-key"]["qos.level"], lines["with-key"]["output_tokens"]) == ("standard", 2)
    for line in lines.values():
        assert line["level"] == "info" and line["method"] == "GenerateUnary" and line["ms"] >= 0
