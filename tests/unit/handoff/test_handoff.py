"""Transport negotiation, and the shared-memory and inline paths end to end in-process."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import REGISTRY

from services.common.errors import FailedPrecondition, InvalidArgument
from services.handoff.consumer import Consumer
from services.handoff.producer import Producer
from services.handoff.wire import choose_transport
from vlmesh.v1 import common_pb2 as pb

SHM, CUDA, INLINE, PEER = pb.TRANSPORT_SHM, pb.TRANSPORT_CUDA_IPC, pb.TRANSPORT_INLINE, pb.TRANSPORT_CUDA_IPC_PEER
ALL = [CUDA, PEER, SHM, INLINE]  # a GPU consumer's order


@pytest.mark.parametrize(
    "consumer,offered,producer_gpu,expected",
    [
        (pb.ConsumerInfo(host_id="h", gpu_uuid="G", accept=[CUDA, SHM, INLINE]), (CUDA, SHM), "G", CUDA),
        (pb.ConsumerInfo(host_id="h", gpu_uuid="G2", accept=[CUDA, SHM, INLINE]), (CUDA, SHM), "G", SHM),
        (pb.ConsumerInfo(host_id="h", accept=[SHM, INLINE]), (CUDA, SHM), "G", SHM),
        (pb.ConsumerInfo(host_id="h", gpu_uuid="G", accept=[CUDA, SHM, INLINE]), (SHM,), "", SHM),
        (pb.ConsumerInfo(host_id="other", gpu_uuid="G", accept=[CUDA, SHM, INLINE]), (CUDA, SHM), "G", INLINE),
        (pb.ConsumerInfo(host_id="h", accept=[INLINE]), (SHM,), "", INLINE),
        (pb.ConsumerInfo(), (SHM,), "", INLINE),  # a consumer that says nothing gets bytes
        # Another GPU of the host: over the peer link where the consumer's GPU reads the producer's.
        (pb.ConsumerInfo(host_id="h", gpu_uuid="G1", accept=ALL, peer_gpu_uuids=["G"]), (CUDA, PEER, SHM), "G", PEER),
        (pb.ConsumerInfo(host_id="h", gpu_uuid="G1", accept=ALL, peer_gpu_uuids=["G2"]), (CUDA, PEER, SHM), "G", SHM),
        (pb.ConsumerInfo(host_id="h", gpu_uuid="G", accept=ALL, peer_gpu_uuids=["G"]), (CUDA, PEER, SHM), "G", CUDA),
        (pb.ConsumerInfo(host_id="x", gpu_uuid="G1", accept=ALL, peer_gpu_uuids=["G"]), (CUDA, PEER, SHM), "G", INLINE),
        (pb.ConsumerInfo(host_id="h", gpu_uuid="G1", accept=ALL, peer_gpu_uuids=["G"]), (SHM,), "", SHM),
    ],
)
def test_negotiation(consumer, offered, producer_gpu, expected):
    assert choose_transport("h", producer_gpu, offered, consumer) == expected


def test_fallbacks_are_counted_and_logged(caplog):
    def count() -> float:
        return REGISTRY.get_sample_value("vlmesh_handoff_fallbacks_total", {"to": "TRANSPORT_INLINE"}) or 0.0

    before = count()
    consumer = pb.ConsumerInfo(host_id="elsewhere", accept=[SHM, INLINE])
    assert choose_transport("h", "", (SHM,), consumer) == INLINE
    assert count() == before + 1
    assert "falls back" in caplog.text


def test_no_common_transport():
    with pytest.raises(InvalidArgument, match="no common transport"):
        choose_transport("h", "", (SHM,), pb.ConsumerInfo(host_id="x", accept=[SHM]))


@pytest.mark.parametrize("transport", [SHM, INLINE])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_roundtrip_bit_exact(transport, dtype):
    producer = Producer(page_bytes=16 * 32 * 4, n_pages=4, ttl_s=30, device=torch.device("cpu"), ready="sync")
    consumer = Consumer()
    try:
        feats = [torch.randn(16, 32).to(dtype) for _ in range(3)]
        refs = producer.export(feats, producer.transport(transport))
        assert [r.transport for r in refs] == [transport] * 3
        for f, ref in zip(feats, refs, strict=True):
            assert torch.equal(consumer.open([ref]).tensors[0].view(torch.uint8), f.view(torch.uint8))
        if transport == SHM:
            assert producer.leased == 3
            assert producer.release([r.lease.id for r in refs]) == 3
            assert producer.leased == 0
            with pytest.raises(FailedPrecondition, match="stale"):
                consumer.open([refs[0]])
    finally:
        consumer.close()
        producer.close()


def test_cuda_reference_on_a_cpu_consumer_is_refused():
    producer = Producer(page_bytes=256, n_pages=2, ttl_s=30, device=torch.device("cpu"), ready="sync")
    try:
        ref = producer.export([torch.ones(8, 8)], producer.transport(SHM))[0]
        ref.transport = CUDA
        with pytest.raises(FailedPrecondition, match=r"no GPU"):
            Consumer().open([ref])
    finally:
        producer.close()
