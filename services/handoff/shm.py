"""SHM: the host-memory feature arena, whose pages live in the header's shared-memory segment.

This is the transport on a CPU host (and between any two processes of one host). The
consumer copies a run of pages out, checking the lease before and after the copy, so the lease
may go as soon as `open` returns.
"""

from __future__ import annotations

import torch

from services.common.errors import FailedPrecondition
from services.handoff.arena import ArenaTable, ArenaView, ArenaViews
from services.handoff.header import HOST
from services.handoff.leases import Lease
from services.handoff.transport import ArenaTransport
from services.handoff.wire import Layout, Origin
from vlmesh.v1 import common_pb2 as pb


class ShmArena(ArenaTable):
    """A host arena: `n_pages` pages of `page_bytes` in one POSIX shared-memory segment."""

    def __init__(self, page_bytes: int, n_pages: int, ttl_s: float, keep_limit: int = 0) -> None:
        super().__init__(page_bytes, n_pages, ttl_s, HOST, keep_limit)

    def tensor(self, offset: int, layout: Layout) -> torch.Tensor:
        """The producer's own view of a written run (no copy)."""
        src = torch.frombuffer(self.shm.buf, dtype=torch.uint8, count=layout.nbytes, offset=offset)
        return src.view(layout.dtype).view(layout.shape)

    def write(self, tensor: torch.Tensor) -> tuple[Lease, int]:
        """Copy a tensor (any device) into a fresh run of pages; return its lease and byte offset."""
        nbytes = tensor.numel() * tensor.element_size()
        lease = self.acquire(nbytes)
        offset = self.page_offset(lease.page)
        dst = torch.frombuffer(self.shm.buf, dtype=torch.uint8, count=nbytes, offset=offset)
        dst.copy_(tensor.contiguous().view(-1).view(torch.uint8))  # from a GPU: a synchronous D2H copy
        self.publish(lease)
        return lease, offset


def read_host(view: ArenaView, offset: int, nbytes: int, lease_id: int, dtype: torch.dtype, shape: list[int]):
    """Copy a host-arena run out as a tensor of `shape`, validated before and after the copy."""
    if view.location != HOST:
        raise FailedPrecondition(f"arena {view.name!r} is not a host-memory arena")
    pages = view.pages(offset, nbytes)
    view.check(pages, lease_id)
    src = torch.frombuffer(view.shm.buf, dtype=torch.uint8, count=nbytes, offset=offset)
    out = src.clone().view(dtype).view(shape)
    view.check(pages, lease_id, margin_s=0.0)  # not freed (and so not reused) while we copied
    return out


class ShmTransport(ArenaTransport):
    """TRANSPORT_SHM: leased pages of a host arena; the consumer copies them out (not in place)."""

    kind = pb.TRANSPORT_SHM
    label = "shm"
    in_place = False
    arena: ShmArena | None

    @classmethod
    def producer(cls, origin: Origin, page_bytes: int, n_pages: int, ttl_s: float, keep: int = 0) -> ShmTransport:
        """The producer's end: owns a fresh host arena (`keep` of its pages may be kept, see leases.py)."""
        return cls(arena=ShmArena(page_bytes, n_pages, ttl_s, keep), origin=origin)

    @classmethod
    def consumer(cls, views: ArenaViews) -> ShmTransport:
        """The consumer's end: reads arenas through the process's shared views."""
        return cls(views=views)

    def _write(self, tensor: torch.Tensor) -> tuple[Lease, int]:
        arena = self._producer_arena()
        assert isinstance(arena, ShmArena)
        return arena.write(tensor)  # published on write: readable at once

    def run_tensor(self, ref: pb.TensorRef, layout: Layout) -> torch.Tensor:
        arena = self._producer_arena()
        assert isinstance(arena, ShmArena)
        return arena.tensor(ref.offset, layout)

    def _read(self, view: ArenaView, ref: pb.TensorRef, layout: Layout) -> torch.Tensor:
        return read_host(view, ref.offset, ref.nbytes, ref.lease.id, layout.dtype, layout.shape)
