"""TensorRef: how a tensor made in one process is reached from another.

The producer picks the transport with `choose_transport` (negotiation), the consumer
resolves a reference with `FeatureImporter.load`. Every fallback to inline bytes is
logged and counted; none is silent.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch

from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.shm_arena import ShmReader
from vlmesh.v1 import common_pb2 as pb

log = logging.getLogger(__name__)

TORCH_TO_PB = {
    torch.float32: pb.DTYPE_FLOAT32,
    torch.float16: pb.DTYPE_FLOAT16,
    torch.bfloat16: pb.DTYPE_BFLOAT16,
}
PB_TO_TORCH = {v: k for k, v in TORCH_TO_PB.items()}

# Process-wide transport counters (requests and bytes by transport), read by /metrics later.
HANDOFF_COUNTS: Counter[str] = Counter()
HANDOFF_BYTES: Counter[str] = Counter()


def choose_transport(producer_host: str, offered: tuple[int, ...], consumer: pb.ConsumerInfo) -> int:
    """Pick the best transport both sides support; inline bytes only as the metered last resort."""
    accept = tuple(consumer.accept) or (pb.TRANSPORT_INLINE,)
    same_host = consumer.host_id == producer_host
    for transport in accept:
        if transport == pb.TRANSPORT_INLINE:
            break
        if transport in offered and same_host:
            return transport
    if pb.TRANSPORT_INLINE not in accept:
        raise InvalidArgument(
            f"no common transport: consumer on {consumer.host_id!r} accepts "
            f"{[pb.Transport.Name(t) for t in accept]}, producer on {producer_host!r} offers "
            f"{[pb.Transport.Name(t) for t in offered]} plus inline"
        )
    if accept[0] != pb.TRANSPORT_INLINE:
        why = "another host" if not same_host else "no shared transport"
        log.warning("feature hand-off falls back to inline bytes: consumer is on %s (%s)", consumer.host_id, why)
        HANDOFF_COUNTS["inline_fallback"] += 1
    return pb.TRANSPORT_INLINE


def inline_ref(tensor: torch.Tensor, producer_host: str) -> pb.TensorRef:
    data = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return pb.TensorRef(
        transport=pb.TRANSPORT_INLINE,
        producer_host_id=producer_host,
        nbytes=len(data),
        shape=list(tensor.shape),
        dtype=TORCH_TO_PB[tensor.dtype],
        ready=pb.READY_SIGNAL_PRODUCER_SYNCED,
        inline_data=data,
    )


class FeatureImporter:
    """Consumer side: turns TensorRefs into tensors, caching opened arenas."""

    def __init__(self) -> None:
        self.shm = ShmReader()

    def load(self, ref: pb.TensorRef) -> torch.Tensor:
        dtype = PB_TO_TORCH.get(ref.dtype)
        if dtype is None:
            raise FailedPrecondition(f"tensor reference has unknown dtype {ref.dtype}")
        shape = list(ref.shape)
        if any(d <= 0 for d in shape) or not shape:
            raise FailedPrecondition(f"tensor reference has an invalid shape {shape}")
        name = pb.Transport.Name(ref.transport) if ref.transport in pb.Transport.values() else str(ref.transport)
        if ref.transport == pb.TRANSPORT_SHM:
            out = self.shm.read(ref.arena_id, ref.offset, ref.nbytes, ref.lease.id, dtype, shape)
        elif ref.transport == pb.TRANSPORT_INLINE:
            numel = 1
            for d in shape:
                numel *= d
            if len(ref.inline_data) != numel * torch.empty((), dtype=dtype).element_size():
                raise FailedPrecondition(f"inline tensor of shape {shape} carries {len(ref.inline_data)} bytes")
            out = torch.frombuffer(bytearray(ref.inline_data), dtype=dtype).view(shape)
        else:
            raise FailedPrecondition(f"transport {name} is not available in this process")
        HANDOFF_COUNTS[name] += 1
        HANDOFF_BYTES[name] += ref.nbytes or len(ref.inline_data)
        return out

    def close(self) -> None:
        self.shm.close()
