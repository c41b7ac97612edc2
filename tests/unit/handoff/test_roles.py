"""The producer and consumer roles on the CPU: export, open, verify, release, negotiation."""

from __future__ import annotations

import asyncio
import logging
import threading

import grpc
import pytest
import torch
from prometheus_client import REGISTRY

from services.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from services.handoff.consumer import Consumer, Opened
from services.handoff.producer import Producer
from services.handoff.release import release_leases
from vlmesh.v1 import common_pb2 as pb

SHM, CUDA, INLINE = pb.TRANSPORT_SHM, pb.TRANSPORT_CUDA_IPC, pb.TRANSPORT_INLINE
TOKENS, HIDDEN = 16, 32  # a tiny model's [image_tokens, hidden]


class FakeVision:
    """Stands in for the vision's stub: Release hands the ids to the producer (or fails)."""

    def __init__(self, producer: Producer | None = None, fail: bool = False) -> None:
        self.producer = producer
        self.fail = fail
        self.calls: list[list[int]] = []

    async def Release(self, request, **options):  # options: the call's timeout
        self.calls.append(list(request.lease_ids))
        if self.fail:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "vision is down")
        return len(request.lease_ids) if self.producer is None else self.producer.release(request.lease_ids)


@pytest.fixture
def producer():
    p = Producer(page_bytes=TOKENS * HIDDEN * 4, n_pages=4, ttl_s=30, device=torch.device("cpu"), ready="sync")
    yield p
    p.close()


@pytest.fixture
def consumer():
    c = Consumer()
    yield c
    c.close()


def me(consumer: Consumer, accept=None) -> pb.ConsumerInfo:
    """What the gateway tells the producer about this consumer (from its Info)."""
    return pb.ConsumerInfo(host_id=consumer.host, gpu_uuid=consumer.gpu_uuid, accept=accept or consumer.transports)


def handoffs(transport: str) -> tuple[float, float]:
    """(tensors, bytes) handed over so far through `transport`."""
    labels = {"transport": transport}
    return (
        REGISTRY.get_sample_value("vlmesh_handoffs_total", labels) or 0.0,
        REGISTRY.get_sample_value("vlmesh_handoff_bytes_total", labels) or 0.0,
    )


def fallbacks() -> float:
    return REGISTRY.get_sample_value("vlmesh_handoff_fallbacks_total", {"to": "TRANSPORT_INLINE"}) or 0.0


def test_a_cpu_host_offers_and_accepts_shm_then_inline(producer, consumer):
    assert producer.transports == [SHM, INLINE]
    assert producer.offered == (SHM,)
    assert consumer.transports == [SHM, INLINE]
    assert producer.gpu_uuid == consumer.gpu_uuid == ""
    assert len(producer.arena_names) == 1


@pytest.mark.parametrize("accept,expected", [([SHM, INLINE], SHM), ([INLINE], INLINE)])
def test_roundtrip_through_the_roles(producer, consumer, accept, expected):
    feats = [torch.randn(TOKENS, HIDDEN) * (i + 1) for i in range(3)]
    before = handoffs(pb.Transport.Name(expected))
    refs = producer.export(feats, me(consumer, accept))
    assert [r.transport for r in refs] == [expected] * 3
    assert producer.leased == (3 if expected == SHM else 0)
    opened = consumer.open(refs, shape=(TOKENS, HIDDEN))
    assert len(opened.tensors) == 3
    for f, t in zip(feats, opened.tensors, strict=True):
        assert t.shape == (TOKENS, HIDDEN)
        assert torch.equal(t, f)
    assert handoffs(pb.Transport.Name(expected)) == (before[0] + 3, before[1] + 3 * TOKENS * HIDDEN * 4)
    assert opened.in_place == []  # copies: their leases may go at once
    assert opened.hold() is None
    opened.verify()  # nothing read in place, nothing to check
    # A copy does not change when its slot goes back and is written again.
    assert producer.release([r.lease.id for r in refs]) == (3 if expected == SHM else 0)
    producer.export([torch.zeros(TOKENS, HIDDEN)] * 3, me(consumer, accept))
    for f, t in zip(feats, opened.tensors, strict=True):
        assert torch.equal(t, f)


def test_wrong_shape_is_invalid_argument(producer, consumer):
    refs = producer.export([torch.ones(TOKENS, HIDDEN), torch.ones(TOKENS, HIDDEN - 1)], me(consumer))
    with pytest.raises(InvalidArgument, match=r"image_features\[1\] has shape \(16, 31\); this model needs \(16, 32\)"):
        consumer.open(refs, shape=(TOKENS, HIDDEN), field="image_features")


def test_released_and_forged_refs_are_refused(producer, consumer):
    ref, other = producer.export([torch.ones(TOKENS, HIDDEN), torch.ones(TOKENS, HIDDEN)], me(consumer))
    forged = pb.TensorRef()
    forged.CopyFrom(other)
    forged.lease.id ^= 0x5A5A
    with pytest.raises(FailedPrecondition, match="stale"):
        consumer.open([forged])
    shifted = pb.TensorRef()
    shifted.CopyFrom(other)
    shifted.offset += 8
    with pytest.raises(FailedPrecondition, match="out of bounds"):
        consumer.open([shifted])
    lying = pb.TensorRef()
    lying.CopyFrom(other)
    lying.shape[:] = [TOKENS, HIDDEN * 2]
    with pytest.raises(FailedPrecondition, match="does not match"):
        consumer.open([lying])
    unknown = pb.TensorRef()
    unknown.CopyFrom(other)
    unknown.transport = 99
    with pytest.raises(FailedPrecondition, match="not available in this process"):
        consumer.open([unknown])
    assert consumer.open([ref]).tensors[0].sum() == TOKENS * HIDDEN
    assert producer.release([ref.lease.id]) == 1
    assert producer.release([ref.lease.id]) == 0  # once
    with pytest.raises(FailedPrecondition, match="stale"):
        consumer.open([ref])
    inline = producer.export([torch.ones(TOKENS, HIDDEN)], me(consumer, [INLINE]))[0]
    inline.inline_data = inline.inline_data[:-4]
    with pytest.raises(FailedPrecondition, match="carries"):
        consumer.open([inline])


def test_negotiation_falls_back_to_inline_across_hosts_and_is_counted(producer, consumer, caplog):
    elsewhere = pb.ConsumerInfo(host_id="another-host/0000", accept=[SHM, INLINE])
    before = fallbacks()
    with caplog.at_level(logging.WARNING):
        assert producer.negotiate(elsewhere).kind == INLINE
    assert fallbacks() == before + 1
    assert "falls back from TRANSPORT_SHM to TRANSPORT_INLINE (another host)" in caplog.text
    feats = [torch.randn(TOKENS, HIDDEN).to(torch.bfloat16)]
    refs = producer.export(feats, elsewhere)  # negotiated (and counted) here too
    assert fallbacks() == before + 2
    assert refs[0].transport == INLINE and not refs[0].lease.id
    assert torch.equal(consumer.open(refs).tensors[0].view(torch.uint8), feats[0].view(torch.uint8))
    with pytest.raises(InvalidArgument, match="no common transport"):
        producer.negotiate(pb.ConsumerInfo(host_id="another-host/0000", accept=[SHM]))
    assert fallbacks() == before + 2


def test_a_full_arena_gives_back_what_the_export_wrote(producer, consumer):
    producer.export([torch.ones(TOKENS, HIDDEN)] * 3, me(consumer))
    with pytest.raises(ResourceExhausted, match="arena full"):
        producer.export([torch.ones(TOKENS, HIDDEN)] * 2, me(consumer))  # the first fits, the second not
    assert producer.leased == 3
    assert producer.reap() == 0  # nothing expired


def test_release_leases_skips_inline_and_swallows_rpc_errors(caplog):
    leased = pb.TensorRef(transport=SHM, lease=pb.Lease(id=7))
    inline = pb.TensorRef(transport=INLINE, lease=pb.Lease(id=9))  # inline holds no lease, whatever it says
    vision = FakeVision()
    asyncio.run(release_leases(vision, [leased, inline], timeout_s=1))
    assert vision.calls == [[7]]
    asyncio.run(release_leases(vision, [inline], timeout_s=1))
    asyncio.run(release_leases(None, [leased], timeout_s=1))
    assert vision.calls == [[7]]  # nothing to release, or nobody to ask: no call
    down = FakeVision(fail=True)
    with caplog.at_level(logging.WARNING):
        asyncio.run(release_leases(down, [leased], timeout_s=1))  # logged, not raised
    assert down.calls == [[7]]
    assert "lease release failed" in caplog.text and "UNAVAILABLE" in caplog.text


def test_copies_are_released_at_once_through_the_consumer(producer):
    vision = FakeVision(producer)
    consumer = Consumer(vision=vision)
    try:
        refs = producer.export([torch.ones(TOKENS, HIDDEN)] * 2, me(consumer))
        opened = consumer.open(refs)

        async def main() -> None:
            assert opened.hold() is None
            opened.release_rest()
            await asyncio.sleep(0.05)

        asyncio.run(main())
        assert vision.calls == [[r.lease.id for r in refs]]
        assert producer.leased == 0
        with pytest.raises(FailedPrecondition, match="stale"):
            consumer.open(refs[:1])
        asyncio.run(consumer.release(refs))  # the error path: awaited; nothing held any more
        assert producer.leased == 0
        assert len(vision.calls) == 2
    finally:
        consumer.close()


class InPlace:
    """A transport that read its tensor in place (CUDA IPC's semantics), for the lease bookkeeping."""

    in_place = True

    def __init__(self) -> None:
        self.verified = 0
        self.stale = False

    def verify(self, ref: pb.TensorRef) -> None:
        self.verified += 1
        if self.stale:
            raise FailedPrecondition("tensor reference is stale")


def test_in_place_leases_are_held_until_the_reader_releases_them():
    vision = FakeVision()
    consumer = Consumer(vision=vision)
    held, copied = (
        pb.TensorRef(transport=CUDA, lease=pb.Lease(id=11)),
        pb.TensorRef(transport=SHM, lease=pb.Lease(id=12)),
    )
    transport = InPlace()
    opened = Opened(consumer, [held, copied], [torch.zeros(1), torch.zeros(1)], {0: transport})
    assert opened.in_place == [held]

    async def main() -> None:
        held = opened.hold()
        assert held is not None
        verify, release = held.verify, held.release
        opened.release_rest()  # the copy goes now, the in-place one stays with the reader
        await asyncio.sleep(0.05)
        assert vision.calls == [[12]]
        verify()
        assert transport.verified == 1
        transport.stale = True
        with pytest.raises(FailedPrecondition, match="stale"):
            verify()
        reader = threading.Thread(target=release)  # the engine's thread
        reader.start()
        reader.join()
        await asyncio.sleep(0.05)
        assert vision.calls == [[12], [11]]
        release()  # once: a second call sends nothing
        await asyncio.sleep(0.05)
        assert vision.calls == [[12], [11]]

    asyncio.run(main())


def test_without_a_reader_holding_them_every_lease_goes_after_submit():
    """The vLLM engine copies every feature at submit: no hooks taken, all leases go at once."""
    vision = FakeVision()
    consumer = Consumer(vision=vision)
    held, copied = (
        pb.TensorRef(transport=CUDA, lease=pb.Lease(id=21)),
        pb.TensorRef(transport=SHM, lease=pb.Lease(id=22)),
    )
    opened = Opened(consumer, [held, copied], [torch.zeros(1), torch.zeros(1)], {0: InPlace()})

    async def main() -> None:
        opened.release_rest()
        await asyncio.sleep(0.05)

    asyncio.run(main())
    assert vision.calls == [[21, 22]]
