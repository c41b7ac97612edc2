"""What crosses the wire: dtype maps, transport names, building and reading TensorRefs, negotiation.

The producer picks the transport with `choose_transport` (negotiation); every fallback from
the consumer's first choice is logged and counted, none is silent. A TensorRef names the
tensor's layout (dtype, shape, byte size), where it lives (a run of arena pages and its lease, or
inline bytes) and who made it (host and GPU).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.metrics import HANDOFF_FALLBACKS
from services.handoff.leases import Lease
from vlmesh.v1 import common_pb2 as pb

log = logging.getLogger(__name__)

CONTENT_KEY_BYTES = 16  # TensorRef.content_key: the features' identity (services/vision/feature_cache.py)

TORCH_TO_PB = {
    torch.float32: pb.DTYPE_FLOAT32,
    torch.float16: pb.DTYPE_FLOAT16,
    torch.bfloat16: pb.DTYPE_BFLOAT16,
}
PB_TO_TORCH = {v: k for k, v in TORCH_TO_PB.items()}


def transport_name(transport: int) -> str:
    """The enum name (e.g. TRANSPORT_SHM), also the metrics' label; the number if unknown."""
    return pb.Transport.Name(transport) if transport in pb.Transport.values() else str(transport)


@dataclass(frozen=True)
class Origin:
    """Who made a reference: the producer's host id and GPU UUID ("" on a CPU)."""

    host: str
    gpu_uuid: str = ""


class Layout(NamedTuple):  # a NamedTuple: made once per tensor handed over, on the hot path
    """A reference's tensor layout, checked: `nbytes` is what `shape` and `dtype` need."""

    dtype: torch.dtype
    shape: list[int]
    nbytes: int


def layout(ref: pb.TensorRef) -> Layout:
    """The layout a reference announces; FAILED_PRECONDITION for an unknown dtype or a bad shape."""
    dtype = PB_TO_TORCH.get(ref.dtype)
    if dtype is None:
        raise FailedPrecondition(f"tensor reference has unknown dtype {ref.dtype}")
    shape = list(ref.shape)
    if not shape or any(d <= 0 for d in shape):
        raise FailedPrecondition(f"tensor reference has an invalid shape {shape}")
    return Layout(dtype, shape, math.prod(shape) * dtype.itemsize)


def arena_ref(
    origin: Origin, transport: int, arena_id: str, lease: Lease, offset: int, tensor: torch.Tensor
) -> pb.TensorRef:
    """A reference to `tensor` written at `offset` of an arena, under `lease`.

    Readiness defaults to producer-synced; the CUDA transport may switch it to an event.
    """
    return pb.TensorRef(
        transport=transport,
        arena_id=arena_id,
        producer_host_id=origin.host,
        gpu_uuid=origin.gpu_uuid,
        offset=offset,
        nbytes=tensor.numel() * tensor.element_size(),
        shape=list(tensor.shape),
        dtype=TORCH_TO_PB[tensor.dtype],
        lease=pb.Lease(id=lease.id, expires_unix_ms=lease.expires_unix_ms),
        ready=pb.READY_SIGNAL_PRODUCER_SYNCED,
    )


def inline_ref(tensor: torch.Tensor, producer_host: str) -> pb.TensorRef:
    """A reference carrying the tensor's bytes itself (no arena, no lease)."""
    data = tensor.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
    return pb.TensorRef(
        transport=pb.TRANSPORT_INLINE,
        producer_host_id=producer_host,
        nbytes=len(data),
        shape=list(tensor.shape),
        dtype=TORCH_TO_PB[tensor.dtype],
        ready=pb.READY_SIGNAL_PRODUCER_SYNCED,
        inline_data=data,
    )


def lease_ids(refs: Iterable[pb.TensorRef]) -> list[int]:
    """What Release takes for a set of references: each one's reader id on its lease (the lease id
    when it has none); inline bytes hold no lease."""
    return [r.lease.reader or r.lease.id for r in refs if r.transport != pb.TRANSPORT_INLINE and r.lease.id]


def choose_transport(producer_host: str, producer_gpu: str, offered: tuple[int, ...], consumer: pb.ConsumerInfo) -> int:
    """The consumer's most preferred transport that works between the two; inline bytes last.

    CUDA IPC needs the same host and the same GPU; its peer form the same host and a consumer
    GPU that reads the producer's directly (`consumer.peer_gpu_uuids`); shared memory the same
    host. INLINE is always possible, offered or not. INVALID_ARGUMENT when nothing the consumer
    accepts works.
    """
    accept = tuple(consumer.accept) or (pb.TRANSPORT_INLINE,)
    same_host = consumer.host_id == producer_host
    same_gpu = bool(producer_gpu) and consumer.gpu_uuid == producer_gpu
    works = {
        pb.TRANSPORT_CUDA_IPC: same_host and same_gpu,
        pb.TRANSPORT_CUDA_IPC_PEER: same_host
        and bool(producer_gpu)
        and not same_gpu
        and producer_gpu in consumer.peer_gpu_uuids,
        pb.TRANSPORT_SHM: same_host,
        pb.TRANSPORT_INLINE: True,
    }
    for transport in accept:
        if transport in (*offered, pb.TRANSPORT_INLINE) and works.get(transport, False):
            if transport != accept[0]:
                why = (
                    "another host"
                    if not same_host
                    else f"GPU {consumer.gpu_uuid or 'none'} vs {producer_gpu or 'none'}"
                )
                log.warning(
                    "feature hand-off falls back from %s to %s (%s)",
                    transport_name(accept[0]),
                    transport_name(transport),
                    why,
                )
                HANDOFF_FALLBACKS.labels(transport_name(transport)).inc()
            return transport
    raise InvalidArgument(
        f"no common transport: consumer on {consumer.host_id!r} accepts {[transport_name(t) for t in accept]}, "
        f"producer on {producer_host!r} offers {[transport_name(t) for t in offered]}"
    )
