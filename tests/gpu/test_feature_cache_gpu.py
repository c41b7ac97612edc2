"""The feature cache over the CUDA arena (producer side, in one process): a hit is the kept device
slot itself, and a consumer of another transport gets a copy of it."""

from __future__ import annotations

import pytest
import torch

from services.handoff.consumer import Consumer
from services.handoff.producer import Producer
from services.handoff.wire import layout, lease_ids
from vlmesh.v1 import common_pb2 as pb

pytestmark = pytest.mark.gpu


def test_a_hit_on_the_gpu_is_the_kept_device_slot_and_a_host_consumer_gets_a_copy():
    features = torch.randn(576, 1024, device="cuda", dtype=torch.bfloat16)
    nbytes = features.numel() * features.element_size()
    producer = Producer(nbytes, 4, ttl_s=30, device=torch.device("cuda"), ready="sync", keep=2)
    consumer = Consumer()  # a CPU-side reader: it opens SHM references
    try:
        cuda = producer.transport(pb.TRANSPORT_CUDA_IPC)
        shm = producer.transport(pb.TRANSPORT_SHM)
        (first,) = producer.export([features], cuda, [b"k" * 16])
        assert producer.release([first.lease.id]) == 1
        hit = producer.lookup(b"k" * 16, cuda)
        assert hit is not None and (hit.offset, hit.lease.id) == (first.offset, first.lease.id)
        assert hit.content_key == b"k" * 16
        assert torch.equal(cuda.run_tensor(hit, layout(hit)), features)  # the slot holds them, unchanged
        copied = producer.lookup(b"k" * 16, shm)  # a consumer on another GPU: a host copy of the slot
        assert copied is not None and copied.transport == pb.TRANSPORT_SHM
        assert torch.equal(consumer.open([copied]).tensors[0], features.cpu())
        producer.release(lease_ids([hit, copied]))
        assert producer.leased == 0 and producer.lookup(b"x" * 16, cuda) is None
    finally:
        consumer.close()
        producer.close()
