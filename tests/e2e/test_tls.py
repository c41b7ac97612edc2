"""TLS on the public port and mTLS between the services: `vlmesh up --tls-throwaway-ca`.

The gateway answers over TLS (gRPC and its HTTP door) and only over TLS; the vision and the llm
refuse a caller whose certificate the mesh's CA did not sign, and answer one whose it did.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cli import main as cli_main
from services.client import generate
from services.launcher import Mesh
from tests.helpers import image_bytes, mesh_options
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2


@pytest.fixture(scope="module")
def tls_mesh(tiny_model):
    with Mesh(mesh_options(tiny_model, tls_throwaway_ca=True, http_port=0)) as mesh:
        mesh.start(progress=lambda msg: None)
        yield mesh


def request() -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        images=[pb.Image(data=image_bytes(3))], prompt="What is in the image?", sampling=pb.SamplingParams(max_tokens=3)
    )


def health(target: str, creds: grpc.ChannelCredentials | None) -> int:
    channel = grpc.insecure_channel(target) if creds is None else grpc.secure_channel(target, creds)
    with channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_the_gateway_answers_over_tls_and_only_over_tls(tls_mesh, tmp_path):
    server = tls_mesh.opts.gateway.server
    assert server.tls_cert and server.tls_ca  # the launcher made them for this run
    out = tmp_path / "answer.txt"
    with out.open("w") as f:
        final = generate(tls_mesh.target("gateway"), request(), "standard", 30, out=f, tls_ca=server.tls_ca)
    assert final.usage.output_tokens == 3
    with pytest.raises(grpc.RpcError) as info:
        health(tls_mesh.target("gateway"), None)  # plaintext to a TLS port
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_vlmesh_generate_without_tls_ca_hints_at_tls(tls_mesh, tmp_path, capsys):
    """A plaintext `vlmesh generate` against the TLS gateway: one line, the status and a hint."""
    picture = tmp_path / "p.png"
    picture.write_bytes(image_bytes(3))
    argv = ["generate", "--image", str(picture), "--prompt", "What?", "--target", tls_mesh.target("gateway")]
    assert cli_main([*argv, "--timeout", "30"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("vlmesh generate: error: UNAVAILABLE: ") and "\n" not in err, err
    assert err.endswith("(is the gateway serving TLS? pass --tls-ca CA.pem)"), err
    ca = tls_mesh.opts.gateway.server.tls_ca
    assert cli_main([*argv, "--timeout", "30", "--tls-ca", ca, "--max-tokens", "2"]) == 0  # the hint's advice works


def test_the_http_door_serves_https(tls_mesh):
    import httpx

    url = tls_mesh.http_url()
    assert url.startswith("https://")
    ca = tls_mesh.opts.gateway.server.tls_ca
    got = httpx.get(f"{url}/models", verify=ca, timeout=10)
    assert got.status_code == 200 and got.json()["data"]


@pytest.mark.parametrize("name", ["vision", "llm"])
def test_vision_and_llm_refuse_a_caller_without_the_mesh_certificate(tls_mesh, name):
    server = tls_mesh.opts.gateway.server
    ca = Path(server.tls_ca).read_bytes()
    with pytest.raises(grpc.RpcError) as info:
        health(tls_mesh.target(name), grpc.ssl_channel_credentials(ca))  # TLS, but no client certificate
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError):
        health(tls_mesh.target(name), None)  # plaintext
    mesh_cert = grpc.ssl_channel_credentials(ca, Path(server.tls_key).read_bytes(), Path(server.tls_cert).read_bytes())
    assert health(tls_mesh.target(name), mesh_cert) == health_pb2.HealthCheckResponse.SERVING


def test_bad_tls_flags_are_refused_before_anything_starts(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        mesh_options(tiny_model, tls_cert=str(tmp_path / "x.pem"))
    with pytest.raises(ValueError, match=r"--tls-key .*cannot read it"):
        (tmp_path / "c.pem").write_text("-----BEGIN CERTIFICATE-----\n")
        mesh_options(tiny_model, tls_cert=str(tmp_path / "c.pem"), tls_key=str(tmp_path / "missing.pem"))
