"""Bad input gets INVALID_ARGUMENT with an actionable message; the mesh keeps serving."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.handoff.wire import lease_ids
from tests.helpers import image_bytes
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc, llm_pb2, llm_pb2_grpc, vision_pb2, vision_pb2_grpc

GOOD_IMAGE = image_bytes(7)


def request(**kw) -> gateway_pb2.GenerateRequest:
    base = {
        "images": [pb.Image(data=GOOD_IMAGE, mime_type="image/png")],
        "prompt": "What is in the image?",
        "sampling": pb.SamplingParams(max_tokens=4),
    }
    base.update(kw)
    return gateway_pb2.GenerateRequest(**base)


BAD = {
    "not an image": (request(images=[pb.Image(data=b"this is not an image at all")]), "not a readable image"),
    "truncated png": (request(images=[pb.Image(data=GOOD_IMAGE[:60])]), "not a readable image"),
    "empty image": (request(images=[pb.Image(data=b"")]), "images[0].data is empty"),
    "no image": (request(images=[]), "one image is required"),
    "five images": (request(images=[pb.Image(data=GOOD_IMAGE)] * 5), "takes at most 4"),
    "max_pixels on a fixed-size model": (
        request(images=[pb.Image(data=GOOD_IMAGE, max_pixels=50_000)]),
        "(llava) reads every picture at one size; leave it 0",
    ),
    "empty prompt": (request(prompt=""), "prompt is empty"),
    "blank prompt": (request(prompt="   \n"), "prompt is empty"),
    "max_tokens 0": (request(sampling=pb.SamplingParams(max_tokens=0)), "max_tokens=0 is out of range"),
    "max_tokens above context": (request(sampling=pb.SamplingParams(max_tokens=100000)), "context"),
    "max_tokens beyond prompt room": (request(sampling=pb.SamplingParams(max_tokens=500)), "does not fit"),
    "non-image mime type": (request(images=[pb.Image(data=GOOD_IMAGE, mime_type="text/plain")]), "not an image/*"),
    "negative temperature": (request(sampling=pb.SamplingParams(max_tokens=4, temperature=-1)), "temperature"),
    "top_p zero": (request(sampling=pb.SamplingParams(max_tokens=4, top_p=0)), "top_p"),
    "min above max": (request(sampling=pb.SamplingParams(max_tokens=4, min_tokens=9)), "min_tokens"),
    "image placeholder in prompt": (request(prompt="look: <image> what?"), "image placeholders"),
}


@pytest.fixture(scope="module")
def channel(mesh):
    with grpc.insecure_channel(mesh.target("gateway")) as ch:
        yield ch


def good_request_works(stub) -> None:
    result = stub.GenerateUnary(request(), timeout=30)
    assert result.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
    assert result.usage.image_tokens == 16


@pytest.mark.parametrize("case", sorted(BAD))
def test_invalid_argument(mesh, channel, case):
    req, needle = BAD[case]
    stub = gateway_pb2_grpc.GatewayStub(channel)
    for call in (stub.GenerateUnary, lambda r, timeout: list(stub.Generate(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as info:
            call(req, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert needle in info.value.details()
    good_request_works(stub)


def test_an_unknown_model_or_variant_is_not_found(channel):
    """As OpenAI's model_not_found: NOT_FOUND naming what is served (MODEL, or MODEL:VARIANT to pin)."""
    stub = gateway_pb2_grpc.GatewayStub(channel)
    served = stub.Info(pb.InfoRequest(), timeout=10).model_id
    for model, needle in [
        ("gpt-17", f"'gpt-17' does not exist; this mesh serves {served!r} (or '{served}:full')"),
        (f"{served}:int4", "that variant is not served here; this worker serves"),
    ]:
        with pytest.raises(grpc.RpcError) as info:
            stub.GenerateUnary(request(model=model), timeout=30)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value.details()
        assert needle in info.value.details()
    for model in (served, f"{served}:full"):
        assert stub.GenerateUnary(request(model=model), timeout=30).finish_reason


def test_unknown_qos_level(channel):
    stub = gateway_pb2_grpc.GatewayStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.GenerateUnary(request(), metadata=(("qos-level", "platinum"),), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "realtime" in info.value.details()
    for level in ("realtime", "standard", "best-effort"):
        stub.GenerateUnary(request(), metadata=(("qos-level", level),), timeout=30)


def test_bad_requests_do_not_harm_concurrent_good_ones(mesh, channel):
    stub = gateway_pb2_grpc.GatewayStub(channel)

    def send(i: int):
        req = request() if i % 2 else BAD["not an image"][0]
        try:
            return stub.GenerateUnary(req, timeout=60).finish_reason
        except grpc.RpcError as err:
            return err.code()

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(send, range(24)))
    assert results[1::2] == [pb.FINISH_REASON_LENGTH] * 12
    assert results[0::2] == [grpc.StatusCode.INVALID_ARGUMENT] * 12
    for name in ("gateway", "vision", "llm"):
        with grpc.insecure_channel(mesh.target(name)) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING


def test_forged_and_released_refs_are_refused(mesh):
    """The llm gives FAILED_PRECONDITION for a reference it must not read, never other data."""
    with grpc.insecure_channel(mesh.target("vision")) as vch, grpc.insecure_channel(mesh.target("llm")) as lch:
        vision, llm = vision_pb2_grpc.VisionStub(vch), llm_pb2_grpc.LlmStub(lch)
        info = llm.Info(pb.InfoRequest(), timeout=5)

        def encode() -> pb.TensorRef:
            consumer = pb.ConsumerInfo(host_id=info.host_id, accept=info.transports)
            req = vision_pb2.EncodeRequest(images=[pb.Image(data=GOOD_IMAGE)], consumer=consumer)
            ref = vision.Encode(req, timeout=30).features[0]
            assert ref.transport == pb.TRANSPORT_SHM
            return ref

        def refused(ref: pb.TensorRef) -> str:
            req = llm_pb2.LlmGenerateRequest(
                prompt="What?", image_features=[ref], sampling=pb.SamplingParams(max_tokens=2)
            )
            with pytest.raises(grpc.RpcError) as err:
                list(llm.Generate(req, timeout=30))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
            return err.value.details()

        ref = encode()
        forged = pb.TensorRef()
        forged.CopyFrom(ref)
        forged.lease.id ^= 0x5A5A
        assert "stale" in refused(forged)
        shifted = pb.TensorRef()
        shifted.CopyFrom(ref)
        shifted.offset += 4096 * 1024 * 1024
        assert "out of bounds" in refused(shifted)
        # The llm released the lease it was handed, even though the request failed.
        assert vision.Release(vision_pb2.ReleaseRequest(lease_ids=lease_ids([ref])), timeout=5).released == 0

        ref = encode()
        assert vision.Release(vision_pb2.ReleaseRequest(lease_ids=lease_ids([ref])), timeout=5).released == 1
        assert "stale" in refused(ref)
