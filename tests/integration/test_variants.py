"""The variant a worker serves: named in every answer's metadata, and a pinned request served only by it."""

from __future__ import annotations

import grpc
import pytest

from services.llm import config as llm_config
from tests.helpers import image_bytes, sample, scrape
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc


@pytest.fixture(scope="module")
def stub(mesh):
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def request() -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        images=[pb.Image(data=image_bytes(3))], prompt="What?", sampling=pb.SamplingParams(max_tokens=2)
    )


def test_answers_name_their_variant_and_a_pin_to_another_is_not_found(stub):
    _, call = stub.GenerateUnary.with_call(request(), timeout=60)
    assert dict(call.initial_metadata())["x-model-variant"] == "full"
    stream = stub.Generate(request(), metadata=(("x-model-variant", "full"),), timeout=60)
    assert list(stream)[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
    assert dict(stream.initial_metadata())["x-model-variant"] == "full"
    with pytest.raises(grpc.RpcError) as err:
        stub.GenerateUnary(request(), metadata=(("x-model-variant", "int4"),), timeout=60)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'int4' is not served here; this worker serves 'full'" in err.value.details()
    info = stub.Info(pb.InfoRequest(), timeout=5)
    assert info.variant == "full"


def test_the_servers_metrics_name_the_model_and_variant(mesh, stub):
    stub.GenerateUnary(request(), timeout=60)
    model = stub.Info(pb.InfoRequest(), timeout=5).model_id
    for name in ("gateway", "llm"):
        series = f'vlmesh_model_info{{model="{model}",service="{name}",variant="full"}}'
        assert sample(scrape(mesh.metrics_ports[name]), series) == 1.0, name


def test_the_variant_name_is_derived_or_given_and_checked():
    assert llm_config.parse(["--model", "m"]).variant == "full"
    assert llm_config.parse(["--model", "m", "--quantize", "int8"]).variant == "int8"
    assert llm_config.parse(["--model", "m", "--quantize", "int8", "--variant", "int8-canary"]).variant == "int8-canary"
    with pytest.raises(ValueError, match="--variant 'Big Model'"):
        llm_config.parse(["--model", "m", "--variant", "Big Model"])
