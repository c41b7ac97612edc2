"""The vision servicer in this process: the tiny model's encoder and batcher, a real CPU Producer, a real
grpc.aio server on a local port, and a Consumer opening what Encode exported."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from services.common.errors import FailedPrecondition
from services.handoff.producer import Producer
from tests.helpers import consumer_info, encode_request, image_bytes, vision_reference, vision_service
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import vision_pb2

SHM, INLINE = pb.TRANSPORT_SHM, pb.TRANSPORT_INLINE
SLOTS = 4
PICTURES = [image_bytes(11, (48, 40), "PNG"), image_bytes(12, (64, 96), "JPEG")]


@pytest.fixture
def producer(encoder):
    p = Producer(page_bytes=encoder.feature_bytes, n_pages=SLOTS, ttl_s=30, device=torch.device("cpu"), ready="sync")
    yield p
    p.close()


def test_encode_exports_each_picture_s_features_into_leased_slots(encoder, producer, consumer):
    async def main():
        async with vision_service(encoder, producer) as stub:
            resp = await stub.Encode(
                encode_request(consumer_info(consumer), PICTURES), metadata=(("qos-level", "realtime"),), timeout=30
            )
            assert producer.leased == 2
            opened = consumer.open(resp.features, shape=(encoder.spec.image_tokens, encoder.spec.text.hidden))
            ids = [r.lease.id for r in resp.features]
            released = await stub.Release(vision_pb2.ReleaseRequest(lease_ids=ids), timeout=5)
            again = await stub.Release(vision_pb2.ReleaseRequest(lease_ids=ids), timeout=5)
            return resp, opened.tensors, released.released, again.released

    resp, tensors, released, again = asyncio.run(main())
    refs = resp.features
    assert [r.transport for r in refs] == [SHM, SHM]
    assert [list(r.shape) for r in refs] == [[encoder.spec.image_tokens, encoder.spec.text.hidden]] * 2
    assert all(r.dtype == pb.DTYPE_FLOAT32 and r.lease.id for r in refs)
    assert refs[0].lease.id != refs[1].lease.id
    expected = [vision_reference(encoder, d) for d in PICTURES]
    assert not torch.allclose(expected[0], expected[1])  # so the order below is checked
    for got, want in zip(tensors, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    t = resp.timings
    assert t.preprocess_ms > 0 and t.vision_ms > 0 and t.handoff_ms > 0 and t.vision_queue_ms >= 0
    assert t.llm_queue_ms == t.prefill_ms == t.decode_ms == t.admission_ms == t.total_ms == 0
    assert (released, again) == (2, 0)
    assert producer.leased == 0
    with pytest.raises(FailedPrecondition, match="stale"):
        consumer.open(refs[:1])


def test_best_effort_is_refused_over_the_memory_watermark_before_any_work(encoder, producer, consumer):
    from services.common.memory import MemoryGuard, Watermarks

    full = MemoryGuard("vision", lambda: (96, 100), Watermarks())  # a GPU 96% full

    async def main():
        async with vision_service(encoder, producer, memory=full) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Encode(
                    encode_request(consumer_info(consumer), PICTURES),
                    metadata=(("qos-level", "best-effort"),),
                    timeout=30,
                )
            served = await stub.Encode(
                encode_request(consumer_info(consumer), PICTURES), metadata=(("qos-level", "standard"),), timeout=30
            )
            return err.value, served

    err, served = asyncio.run(main())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "watermark" in err.details()
    assert len(served.features) == 2  # standard work is served; the refused request leased nothing
    assert producer.leased == 2
    producer.release([r.lease.id for r in served.features])


def test_a_consumer_on_another_host_gets_inline_bytes(encoder, producer, consumer):
    elsewhere = pb.ConsumerInfo(host_id="another-host/0000", accept=[SHM, INLINE])

    async def main():
        async with vision_service(encoder, producer) as stub:
            return await stub.Encode(encode_request(elsewhere, PICTURES[:1]), timeout=30)

    resp = asyncio.run(main())
    (ref,) = resp.features
    assert ref.transport == INLINE and ref.inline_data and not ref.lease.id
    assert producer.leased == 0
    torch.testing.assert_close(
        consumer.open([ref]).tensors[0], vision_reference(encoder, PICTURES[0]), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize(
    "case,details",
    [
        ("no-images", "one image is required"),
        ("not-a-picture", "images[1] (19 bytes) is not a readable image"),
        ("no-common-transport", "no common transport"),
        ("unknown-qos", "unknown qos-level 'urgent'"),
    ],
)
def test_bad_requests_are_invalid_argument_and_lease_nothing(encoder, producer, consumer, case, details):
    request = encode_request(consumer_info(consumer), PICTURES)
    metadata = ()
    if case == "no-images":
        del request.images[:]
    elif case == "not-a-picture":
        request.images[1].data = b"\x89PNG but not really"
    elif case == "no-common-transport":
        request.consumer.CopyFrom(pb.ConsumerInfo(host_id="another-host/0000", accept=[SHM]))
    else:
        metadata = (("qos-level", "urgent"),)

    async def main():
        async with vision_service(encoder, producer) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Encode(request, metadata=metadata, timeout=30)
            return err.value

    err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert details in err.details()
    assert producer.leased == 0


def test_a_full_arena_is_resource_exhausted_and_keeps_no_slot(encoder, producer, consumer):
    """More pictures than slots: RESOURCE_EXHAUSTED, the slots already written go back, the next request fits."""
    many = [image_bytes(20 + i) for i in range(SLOTS + 1)]

    async def main():
        async with vision_service(encoder, producer) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Encode(encode_request(consumer_info(consumer), many), timeout=30)
            assert producer.leased == 0
            ok = await stub.Encode(encode_request(consumer_info(consumer), many[:SLOTS]), timeout=30)
            return err.value, ok

    err, ok = asyncio.run(main())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "arena full" in err.details()
    assert len(ok.features) == SLOTS and producer.leased == SLOTS


def test_info_names_the_model_and_the_transports(encoder, producer):
    async def main():
        async with vision_service(encoder, producer) as stub:
            return await stub.Info(pb.InfoRequest(), timeout=5)

    info = asyncio.run(main())
    assert info.service == "vision"
    assert info.model_id == encoder.spec.model_id
    assert info.host_id == producer.host and info.gpu_uuid == ""
    assert list(info.transports) == [SHM, INLINE]
    assert info.image_tokens == encoder.spec.image_tokens
