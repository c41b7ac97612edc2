"""The services' logs never hold an API key or a picture's bytes, whatever the request does.

A mesh with tenants and the HTTP door, every service at debug level, takes good requests, a
wrong key, a broken picture and a refused one through both doors; then everything the three
processes wrote is searched for the keys and for the pictures' bytes (raw, base64 and hex).
"""

from __future__ import annotations

import base64
import json

import grpc
import httpx

from services.launcher import Mesh
from tests.helpers import image_bytes, mesh_options
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc

KEY, WRONG = "sk-hygiene-0123456789abcdef", "sk-not-a-tenant-fedcba9876543210"


def test_no_key_and_no_picture_bytes_in_any_log(tiny_model, tmp_path, capfd):
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"tenants": [{"id": "t", "api_keys": [KEY], "max_qos": "realtime"}]}))
    picture, broken = image_bytes(11), image_bytes(12)[:200]
    opts = mesh_options(tiny_model, tenants=str(tenants), http_port=0, log_level="debug", warmup_requests=1)
    with Mesh(opts) as mesh:
        mesh.start(progress=lambda msg: None)
        with grpc.insecure_channel(mesh.target("gateway")) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            for key, data in ((KEY, picture), (WRONG, picture), (KEY, broken)):
                req = gateway_pb2.GenerateRequest(
                    images=[pb.Image(data=data)], prompt="What?", sampling=pb.SamplingParams(max_tokens=2)
                )
                try:
                    stub.GenerateUnary(req, metadata=(("authorization", f"Bearer {key}"),), timeout=30)
                except grpc.RpcError as err:
                    assert err.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT)
        url = f"data:image/png;base64,{base64.b64encode(picture).decode()}"
        body = {
            "model": "m",
            "max_tokens": 2,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "What?"}, {"type": "image_url", "image_url": {"url": url}}],
                }
            ],
        }
        auth = {"authorization": f"Bearer {KEY}"}
        body["model"] = httpx.get(f"{mesh.http_url()}/models", headers=auth, timeout=10).json()["data"][0]["id"]
        for key in (KEY, WRONG):
            got = httpx.post(
                f"{mesh.http_url()}/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=30
            )
            assert got.status_code == (200 if key == KEY else 401), got.text
    out, err = capfd.readouterr()
    logs = out + err
    assert "request.id" in logs  # the services did log, at debug level
    for secret in (KEY, WRONG):
        assert secret not in logs, "an API key reached a log"
    for data in (picture, broken):
        # Bytes 42..: past the PNG header, which every PNG shares; 42 is a multiple of 3, so the
        # base64 of the whole picture holds these characters from position 56 on.
        encoded = base64.b64encode(data).decode()[56:112]
        for form in (encoded, data[42:82].hex(), repr(data[42:72])[2:30]):
            assert form not in logs, f"picture bytes reached a log ({form[:12]}...)"
    assert base64.b64encode(picture).decode()[56:112] in url  # the search would find the data URL's text
