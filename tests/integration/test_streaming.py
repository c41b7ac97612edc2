"""Streaming shape, cancellation and deadlines through the gateway."""

from __future__ import annotations

import time

import grpc
import pytest

from tests.helpers import image_bytes
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc


def request(max_tokens: int, request_id: str = "", image: int = 11) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        request_id=request_id,
        images=[pb.Image(data=image_bytes(image))],
        prompt="Describe the picture in detail.",
        sampling=pb.SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens),
    )


@pytest.fixture(scope="module")
def stub(mesh):
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def test_stream_then_final_message(stub):
    req = request(24, request_id="my-id-1", image=1101)  # a picture no other test sends: the vision encodes it
    msgs = list(stub.Generate(req, timeout=60))
    assert all(m.request_id == "my-id-1" for m in msgs)
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
    final = msgs[-1]
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert final.usage.output_tokens == 24 == sum(len(m.token_ids) for m in msgs)
    assert final.usage.image_tokens == 16 and final.usage.prompt_tokens > 5
    t = final.timings
    assert t.total_ms >= t.ttft_ms > 0 and t.prefill_ms > 0 and t.decode_ms > 0 and t.vision_ms > 0
    assert final.usage.cached_tokens == 0
    again = list(stub.Generate(request(24, request_id="my-id-2", image=1101), timeout=60))[-1]
    assert again.timings.vision_ms == again.timings.preprocess_ms == 0  # its features were cached
    assert again.usage.cached_tokens > 0  # and its prompt's leading pages
    unary = stub.GenerateUnary(req, timeout=60)
    assert unary.text == "".join(m.text for m in msgs)
    assert list(unary.token_ids) == [i for m in msgs for i in m.token_ids]


def test_request_id_is_made_when_missing(stub):
    a = stub.GenerateUnary(request(2), timeout=60)
    b = stub.GenerateUnary(request(2), timeout=60)
    assert a.request_id and b.request_id and a.request_id != b.request_id


def test_cancelled_and_expired_requests_free_their_slots(mesh, stub):
    """More cancellations and deadline misses than the llm has KV slots (8): if any leaked
    its slot, the request after them would wait forever."""
    for _ in range(10):
        call = stub.Generate(request(400), timeout=60)
        next(call)  # decoding has started
        call.cancel()
    # No min_tokens: admission cannot know these will run long (greedy here reaches 400 tokens,
    # no EOS, in 0.25-0.3 s on an idle host: a deadline of 0.3 s was a race), so they are admitted
    # and their deadline passes mid-decode, or earlier on a busy host. With min_tokens=400
    # admission would refuse them at once (test_qos_admission.py).
    unbounded = request(400)
    unbounded.sampling.min_tokens = 0
    mid_decode = 0
    for _ in range(10):
        tokens = 0
        with pytest.raises(grpc.RpcError) as err:
            for msg in stub.Generate(unbounded, timeout=0.15):
                tokens += len(msg.token_ids)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, tokens
        mid_decode += tokens > 0
    print(f"{mid_decode} of 10 deadlines passed mid-decode")
    start = time.monotonic()
    result = stub.GenerateUnary(request(4), timeout=30)
    assert result.usage.output_tokens == 4
    assert time.monotonic() - start < 10
