"""The feature cache through the real VisionServicer: a hit is the kept slot itself, keyed by bytes and config."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from services.common import metrics
from services.handoff.producer import Producer
from services.handoff.wire import lease_ids
from services.model.llava import ClipProcessor
from services.vision.feature_cache import FeatureCache, config_salt
from tests.helpers import consumer_info, encode_request, image_bytes, vision_reference, vision_service
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import vision_pb2

SLOTS, KEEP = 4, 3
PICTURES = [image_bytes(30 + i, (40, 48), "PNG") for i in range(KEEP + 2)]


@pytest.fixture
def producer(encoder):
    p = Producer(encoder.feature_bytes, SLOTS, ttl_s=30, device=torch.device("cpu"), ready="sync", keep=KEEP)
    yield p
    p.close()


def lookups(result: str) -> float:
    return metrics.CACHE_LOOKUPS.labels(result)._value.get()


class CountingEncoder:
    """The real encoder, counting the images its ViT saw."""

    def __init__(self, encoder) -> None:
        self._encoder = encoder
        self.images = 0

    def __getattr__(self, name):
        return getattr(self._encoder, name)

    def encode(self, batch):
        self.images += len(batch)
        return self._encoder.encode(batch)


async def encode(stub, consumer, data: bytes):
    resp = await stub.Encode(encode_request(consumer_info(consumer), [data]), timeout=30)
    return resp.features[0], resp.timings


async def release(stub, ref):
    await stub.Release(vision_pb2.ReleaseRequest(lease_ids=lease_ids([ref])), timeout=5)


def test_a_hit_is_the_kept_slot_with_equal_features_and_no_stage_run(encoder, producer, consumer):
    counting = CountingEncoder(encoder)
    hits, misses = lookups("hit"), lookups("miss")

    async def main():
        async with vision_service(counting, producer) as stub:
            first, t1 = await encode(stub, consumer, PICTURES[0])
            a = consumer.open([first]).tensors[0]
            await release(stub, first)
            second, t2 = await encode(stub, consumer, PICTURES[0])
            b = consumer.open([second]).tensors[0]
            await release(stub, second)
            return first, t1, a, second, t2, b

    first, t1, a, second, t2, b = asyncio.run(main())
    assert counting.images == 1
    assert (lookups("hit") - hits, lookups("miss") - misses) == (1, 1)
    assert second.offset == first.offset and second.lease.id == first.lease.id  # the same slot, no write
    assert first.content_key == second.content_key and len(first.content_key) == 16
    assert torch.equal(a, b)
    torch.testing.assert_close(a, vision_reference(encoder, PICTURES[0]), rtol=1e-4, atol=1e-5)
    assert t1.vision_ms > 0 and t2.vision_ms == t2.preprocess_ms == t2.vision_queue_ms == 0
    assert producer.leased == 0


def test_other_bytes_miss_and_the_cache_evicts_the_least_recently_used(encoder, producer, consumer):
    counting = CountingEncoder(encoder)

    async def main():
        async with vision_service(counting, producer) as stub:
            got = {}
            for data in [*PICTURES[: KEEP + 1], PICTURES[1], PICTURES[0]]:  # KEEP+1 images: the first is evicted
                ref, _ = await encode(stub, consumer, data)
                got.setdefault(data, []).append((ref.content_key, consumer.open([ref]).tensors[0]))
                await release(stub, ref)
            return got

    got = asyncio.run(main())
    assert counting.images == KEEP + 2  # PICTURES[1] hit; PICTURES[0] was evicted and encoded again
    keys = {data: runs[0][0] for data, runs in got.items()}
    assert len(set(keys.values())) == KEEP + 1  # one key per distinct picture
    for data, runs in got.items():
        for _, tensor in runs:
            torch.testing.assert_close(tensor, vision_reference(encoder, data), rtol=1e-4, atol=1e-5)
    assert producer.leased == 0


def test_concurrent_requests_for_one_new_image_encode_it_once(encoder, producer, consumer):
    counting = CountingEncoder(encoder)

    async def main():
        async with vision_service(counting, producer) as stub:
            results = await asyncio.gather(*(encode(stub, consumer, PICTURES[2]) for _ in range(6)))
            tensors = [consumer.open([ref]).tensors[0] for ref, _ in results]
            ids = lease_ids(ref for ref, _ in results)
            first = await stub.Release(vision_pb2.ReleaseRequest(lease_ids=ids[:3] + ids[:3]), timeout=5)
            assert producer.leased == 1  # three readers gone, three hold on: a repeated release drops nothing
            rest = await stub.Release(vision_pb2.ReleaseRequest(lease_ids=ids), timeout=5)
            return results, tensors, first.released, rest.released

    results, tensors, first, rest = asyncio.run(main())
    assert (first, rest) == (3, 3)
    assert counting.images == 1
    assert len({ref.lease.id for ref, _ in results}) == 1  # one slot, one lease
    assert len({ref.lease.reader or ref.lease.id for ref, _ in results}) == 6  # six readers
    assert all(torch.equal(t, tensors[0]) for t in tensors)
    assert producer.leased == 0


def test_an_inline_consumer_hits_too_and_gets_the_bytes(encoder, producer, consumer):
    counting = CountingEncoder(encoder)
    elsewhere = pb.ConsumerInfo(host_id="another-host/0000", accept=[pb.TRANSPORT_INLINE])

    async def main():
        async with vision_service(counting, producer) as stub:
            refs = []
            for info in (elsewhere, consumer_info(consumer), elsewhere):
                resp = await stub.Encode(encode_request(info, [PICTURES[3]]), timeout=30)
                refs.append(resp.features[0])
            tensors = [consumer.open([r]).tensors[0] for r in refs]
            await release(stub, refs[1])
            return refs, tensors

    refs, tensors = asyncio.run(main())
    assert counting.images == 1  # the first inline export kept a copy in the host arena
    assert [r.transport for r in refs] == [pb.TRANSPORT_INLINE, pb.TRANSPORT_SHM, pb.TRANSPORT_INLINE]
    assert all(torch.equal(t, tensors[0]) for t in tensors)
    assert producer.leased == 0


def test_no_kept_slots_switch_the_cache_off(encoder, consumer):
    plain = Producer(encoder.feature_bytes, SLOTS, ttl_s=30, device=torch.device("cpu"), ready="sync")
    counting = CountingEncoder(encoder)
    hits, misses = lookups("hit"), lookups("miss")

    async def main():
        async with vision_service(counting, plain) as stub:
            for _ in range(2):
                ref, _ = await encode(stub, consumer, PICTURES[0])
                assert ref.content_key == b""
                await release(stub, ref)

    try:
        asyncio.run(main())
    finally:
        plain.close()
    assert counting.images == 2
    assert (lookups("hit"), lookups("miss")) == (hits, misses)  # nothing looked up, nothing counted


def test_the_key_covers_bytes_model_preprocessing_and_dtype(encoder, producer):
    salt = config_salt(encoder.spec.model_id, encoder.processor, encoder.dtype)
    key = FeatureCache(producer, salt, True).key
    others = [
        config_salt("another/model", encoder.processor, encoder.dtype),
        config_salt(
            encoder.spec.model_id, ClipProcessor(dataclasses.replace(encoder.processor.cfg, resample=0)), encoder.dtype
        ),
        config_salt(encoder.spec.model_id, encoder.processor, torch.bfloat16),
    ]
    data = PICTURES[0]
    assert key(data) == key(bytes(data))
    assert key(data) != key(data + b"\0")  # equal pixels in other bytes miss, by design
    assert all(FeatureCache(producer, other, True).key(data) != key(data) for other in others)


def test_a_picture_repeated_inside_a_request_is_encoded_once_beside_the_others(encoder, producer, consumer):
    """[A, A, B]: the second A waits for the first's encode (leaving the request's batch group, or
    the two would wait for each other), and A and B share one batch."""
    batches: list[int] = []
    counting = CountingEncoder(encoder)
    counting.encode = lambda batch: batches.append(len(batch)) or encoder.encode(batch)  # type: ignore[method-assign]
    a, b = PICTURES[0], PICTURES[1]

    async def main():
        async with vision_service(counting, producer) as stub:
            resp = await stub.Encode(encode_request(consumer_info(consumer), [a, a, b]), timeout=30)
            tensors = consumer.open(resp.features).tensors
            await stub.Release(vision_pb2.ReleaseRequest(lease_ids=lease_ids(resp.features)), timeout=5)
            return resp.features, tensors

    refs, tensors = asyncio.run(main())
    assert batches == [2]
    assert refs[0].lease.id == refs[1].lease.id != refs[2].lease.id
    for data, got in zip([a, a, b], tensors, strict=True):
        torch.testing.assert_close(got, vision_reference(encoder, data), rtol=1e-4, atol=1e-5)
    assert producer.leased == 0
