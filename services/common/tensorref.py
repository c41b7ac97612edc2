"""TensorRef: how a tensor made in one process is reached from another.

The producer picks the transport with `choose_transport` (negotiation), the consumer
resolves a reference with `FeatureImporter.load`. Every fallback is logged and counted;
none is silent.
"""

from __future__ import annotations

import logging
import math

import torch

from services.common.arena import ArenaView
from services.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from services.common.metrics import HANDOFF_BYTES, HANDOFF_FALLBACKS, HANDOFFS
from services.common.shm_arena import read_host
from vlmesh.v1 import common_pb2 as pb

log = logging.getLogger(__name__)

TORCH_TO_PB = {
    torch.float32: pb.DTYPE_FLOAT32,
    torch.float16: pb.DTYPE_FLOAT16,
    torch.bfloat16: pb.DTYPE_BFLOAT16,
}
PB_TO_TORCH = {v: k for k, v in TORCH_TO_PB.items()}


def transport_name(transport: int) -> str:
    return pb.Transport.Name(transport) if transport in pb.Transport.values() else str(transport)


def choose_transport(producer_host: str, producer_gpu: str, offered: tuple[int, ...], consumer: pb.ConsumerInfo) -> int:
    """The consumer's most preferred transport that works between the two; inline bytes last.

    CUDA IPC needs the same host and the same GPU; shared memory the same host.
    """
    accept = tuple(consumer.accept) or (pb.TRANSPORT_INLINE,)
    same_host = consumer.host_id == producer_host
    works = {
        pb.TRANSPORT_CUDA_IPC: same_host and bool(producer_gpu) and consumer.gpu_uuid == producer_gpu,
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


def inline_ref(tensor: torch.Tensor, producer_host: str) -> pb.TensorRef:
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


def holds_lease(ref: pb.TensorRef) -> bool:
    """Whether `FeatureImporter.load` returned the producer's memory itself, not a copy.

    Such a tensor is valid only while its lease holds: the consumer releases the lease
    once its kernels have read the tensor, and calls `FeatureImporter.verify` after
    reading, before trusting what it read. Host slots and inline bytes are copied on load,
    so their leases may go at once.
    """
    return ref.transport == pb.TRANSPORT_CUDA_IPC


class FeatureImporter:
    """Consumer side: turns TensorRefs into tensors, caching opened arenas."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        self._views: dict[str, ArenaView] = {}
        self._counters: dict[int, tuple] = {}  # per transport: (hand-offs, bytes) metric children
        self._cuda = None
        if self.device.type == "cuda":
            from services.common.cuda_arena import CudaImports

            self._cuda = CudaImports(self.device)

    @property
    def transports(self) -> list[int]:
        """What this process can open, best first."""
        return ([pb.TRANSPORT_CUDA_IPC] if self._cuda else []) + [pb.TRANSPORT_SHM, pb.TRANSPORT_INLINE]

    def _view(self, name: str) -> ArenaView:
        view = self._views.get(name)
        if view is None:
            view = self._views[name] = ArenaView(name)
        return view

    def load(self, ref: pb.TensorRef) -> torch.Tensor:
        dtype = PB_TO_TORCH.get(ref.dtype)
        if dtype is None:
            raise FailedPrecondition(f"tensor reference has unknown dtype {ref.dtype}")
        shape = list(ref.shape)
        if not shape or any(d <= 0 for d in shape):
            raise FailedPrecondition(f"tensor reference has an invalid shape {shape}")
        nbytes = math.prod(shape) * dtype.itemsize
        name = transport_name(ref.transport)
        if ref.transport == pb.TRANSPORT_INLINE:
            if len(ref.inline_data) != nbytes:
                raise FailedPrecondition(f"inline tensor of shape {shape} carries {len(ref.inline_data)} bytes")
            out = torch.frombuffer(bytearray(ref.inline_data), dtype=dtype).view(shape)
        elif ref.transport in (pb.TRANSPORT_SHM, pb.TRANSPORT_CUDA_IPC):
            if ref.nbytes != nbytes:
                raise FailedPrecondition(f"tensor reference shape {shape} does not match its {ref.nbytes} bytes")
            try:
                view = self._view(ref.arena_id)
                if ref.transport == pb.TRANSPORT_SHM:
                    out = read_host(view, ref.offset, ref.nbytes, ref.lease.id, dtype, shape)
                elif self._cuda is not None:
                    out = self._cuda.open(view, ref, dtype, tuple(shape))
                else:
                    raise FailedPrecondition("this process has no GPU: it cannot open CUDA_IPC references")
            except Unavailable:
                self._forget(ref.arena_id)  # the producer died; a new one makes a new arena
                raise
        else:
            raise FailedPrecondition(f"transport {name} is not available in this process")
        count, size = self._counters.get(ref.transport) or self._counters.setdefault(
            ref.transport, (HANDOFFS.labels(name), HANDOFF_BYTES.labels(name))
        )
        count.inc()
        size.inc(nbytes)
        return out

    def verify(self, ref: pb.TensorRef) -> None:
        """FAILED_PRECONDITION unless the reference's lease still holds (the producer cannot have reused it)."""
        if holds_lease(ref):
            view = self._view(ref.arena_id)
            view.check(view.slot(ref.offset, ref.nbytes), ref.lease.id, margin_s=0.0)

    def _forget(self, name: str) -> None:
        view = self._views.pop(name, None)
        if view is not None:
            view.close()
        if self._cuda is not None:
            self._cuda.forget(name)

    def close(self) -> None:
        for name in list(self._views):
            self._forget(name)
