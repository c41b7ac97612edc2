"""The host-memory feature arena: slot data lives in the header's shared-memory segment.

This is the transport on a CPU host (and between any two processes of one host).
"""

from __future__ import annotations

import torch

from services.common.arena import HOST, ArenaTable, ArenaView
from services.common.errors import FailedPrecondition
from services.common.leases import Lease


class ShmArena(ArenaTable):
    def __init__(self, slot_bytes: int, n_slots: int, ttl_s: float) -> None:
        super().__init__(slot_bytes, n_slots, ttl_s, HOST)

    def write(self, tensor: torch.Tensor) -> tuple[Lease, int]:
        """Copy a tensor (any device) into a fresh slot; return its lease and byte offset."""
        nbytes = tensor.numel() * tensor.element_size()
        self.check_fits(nbytes)
        lease = self.leases.acquire()
        offset = self.slot_offset(lease.slot)
        dst = torch.frombuffer(self.shm.buf, dtype=torch.uint8, count=nbytes, offset=offset)
        dst.copy_(tensor.contiguous().view(-1).view(torch.uint8))  # from a GPU: a synchronous D2H copy
        self.publish(lease)
        return lease, offset


def read_host(view: ArenaView, offset: int, nbytes: int, lease_id: int, dtype: torch.dtype, shape: list[int]):
    """Copy a host-arena slot out as a tensor of `shape`, validated before and after the copy."""
    if view.location != HOST:
        raise FailedPrecondition(f"arena {view.name!r} is not a host-memory arena")
    slot = view.slot(offset, nbytes)
    view.check(slot, lease_id)
    src = torch.frombuffer(view.shm.buf, dtype=torch.uint8, count=nbytes, offset=offset)
    out = src.clone().view(dtype).view(shape)
    view.check(slot, lease_id, margin_s=0.0)  # not freed (and so not reused) while we copied
    return out
