"""The services' logs never hold an API key or a picture's bytes, whatever the request does; and
what `vlmesh up` prints is all its own.

A mesh with tenants and the HTTP door, every service at debug level, takes good requests, a
wrong key, a broken picture and a refused one through both doors; then everything the three
processes wrote is searched for the keys and for the pictures' bytes (raw, base64 and hex).
`vlmesh up --variants` (an int8 worker, Envoy) is started and stopped as a user does it, and
every line it printed must be the launcher's or a JSON record of one of the services' loggers:
a library's or Envoy's own notice is noise to the operator.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys

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


def foreign_lines(stdout: str, stderr: str) -> list[str]:
    """The lines `vlmesh up` printed that are neither the launcher's nor the services' own records."""
    ours = {"gateway", "vision", "llm"}
    foreign = [line for line in stdout.splitlines() if line.strip() and not line.startswith("gateway ready on ")]
    for line in stderr.splitlines():
        if not line.strip() or line.startswith("vlmesh up: "):
            continue
        try:
            logger = json.loads(line)["logger"]
        except (ValueError, KeyError, TypeError):
            logger = None
        if logger not in ours and not str(logger).startswith("services."):
            foreign.append(line)
    return foreign


def test_vlmesh_up_with_variants_prints_only_its_own_lines(tiny_model, tmp_path):
    """torch's pytree deprecation (importing torchao), torchao's extensions that do not load and
    Envoy's warnings (no downstream connection limit; SIGTERM caught) each fail it."""
    cmd = [sys.executable, "-m", "services.cli", "up", "--model", str(tiny_model), "--variants", "full=70,int8=30"]
    cmd += ["--gateway-port", "0", "--envoy-admin-port", "0", "--metrics-ports=-1,-1,-1", "--warmup-requests", "1"]
    cmd += ["--threads", "1"]
    err = tmp_path / "up.err"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with err.open("w") as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
        try:
            ready = proc.stdout.readline()  # the launcher's first line on stdout, once the mesh serves
            assert ready.startswith("gateway ready on "), err.read_text()[-3000:]
            proc.send_signal(signal.SIGINT)
            stdout = ready + proc.stdout.read()
            assert proc.wait(timeout=120) == 0, err.read_text()[-3000:]
        finally:
            proc.kill()
            proc.wait()
    foreign = foreign_lines(stdout, err.read_text())
    assert not foreign, "lines that are not vlmesh's own:\n" + "\n".join(line[:300] for line in foreign)
