"""POSIX shared-memory feature arena: the CPU-host transport of TensorRef.

Layout of the segment (little endian):
    [0, 64)       header: magic, version, slot_bytes, n_slots, data_offset
    [64, ...)     lease table: n_slots x uint64, the lease id now in each slot (0 = free)
    [data_offset, data_offset + n_slots * slot_bytes)   slot data

The producer (vision) owns and unlinks the segment. A consumer (llm) attaches once per
arena and validates every reference against the segment's own header and lease table:
offset and size are bounds-checked, and the slot's lease id is compared before and
after the copy (a seqlock), so a released, expired, forged or reused slot is refused
with FAILED_PRECONDITION instead of returning another request's data.
"""

from __future__ import annotations

import logging
import struct
import sys
import threading
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch

from services.common.errors import FailedPrecondition, Unavailable
from services.common.leases import Lease, LeaseTable

log = logging.getLogger(__name__)

MAGIC = b"VLMSHM01"
_HEADER = struct.Struct("<8sQQQQ")  # magic, version, slot_bytes, n_slots, data_offset
_TABLE_OFFSET = 64
_ALIGN = 4096


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class ShmArena:
    """Producer side: owns the segment, hands out leased slots, writes features."""

    def __init__(self, slot_bytes: int, n_slots: int, ttl_s: float) -> None:
        self.slot_bytes = _align(slot_bytes)
        self.n_slots = n_slots
        self.data_offset = _align(_TABLE_OFFSET + 8 * n_slots)
        size = self.data_offset + self.n_slots * self.slot_bytes
        self.shm = shared_memory.SharedMemory(create=True, size=size)
        self.name = self.shm.name
        self.leases = LeaseTable(n_slots, ttl_s)
        _HEADER.pack_into(self.shm.buf, 0, MAGIC, 1, self.slot_bytes, n_slots, self.data_offset)
        self._table = np.ndarray((n_slots,), dtype=np.uint64, buffer=self.shm.buf, offset=_TABLE_OFFSET)
        self._table[:] = 0
        self._lock = threading.Lock()

    def slot_offset(self, slot: int) -> int:
        return self.data_offset + slot * self.slot_bytes

    def write(self, tensor: torch.Tensor) -> tuple[Lease, int]:
        """Copy a contiguous CPU tensor into a fresh slot; return its lease and byte offset."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.slot_bytes:
            raise ValueError(f"tensor of {nbytes} bytes exceeds the arena slot of {self.slot_bytes} bytes")
        lease = self.leases.acquire()
        offset = self.slot_offset(lease.slot)
        dst = torch.frombuffer(self.shm.buf, dtype=torch.uint8, count=nbytes, offset=offset)
        dst.copy_(tensor.contiguous().view(-1).view(torch.uint8))
        # Publish only after the data is in place; readers check this id.
        self._table[lease.slot] = lease.id
        return lease, offset

    def release(self, lease_id: int) -> bool:
        slot = self.leases.release(lease_id)
        if slot is None:
            return False
        self._table[slot] = 0
        return True

    def reap(self) -> int:
        slots = self.leases.reap()
        for slot in slots:
            self._table[slot] = 0
        if slots:
            log.warning("reclaimed %d feature slots whose lease expired unreleased", len(slots))
        return len(slots)

    def close(self) -> None:
        self._table = None  # drop the buffer export before closing
        self.shm.close()
        self.shm.unlink()


def _attach(name: str) -> shared_memory.SharedMemory:
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    shm = shared_memory.SharedMemory(name=name)
    # Before 3.13 the resource tracker adopts attached segments and unlinks them when
    # this process exits, destroying the producer's arena. Only the owner unlinks.
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


class ShmReader:
    """Consumer side: attaches each arena once, validates references, copies features out."""

    def __init__(self) -> None:
        self._arenas: dict[str, tuple[shared_memory.SharedMemory, int, int, int]] = {}
        self._lock = threading.Lock()

    def _open(self, name: str) -> tuple[shared_memory.SharedMemory, int, int, int]:
        with self._lock:
            cached = self._arenas.get(name)
            if cached is not None:
                return cached
            try:
                shm = _attach(name)
            except FileNotFoundError as err:
                raise Unavailable(
                    f"feature arena {name!r} does not exist: the vision process that made it has stopped"
                ) from err
            magic, _version, slot_bytes, n_slots, data_offset = _HEADER.unpack_from(shm.buf, 0)
            if magic != MAGIC:
                shm.close()
                raise FailedPrecondition(f"shared-memory segment {name!r} is not a vlmesh feature arena")
            entry = (shm, slot_bytes, n_slots, data_offset)
            self._arenas[name] = entry
            return entry

    def read(self, name: str, offset: int, nbytes: int, lease_id: int, dtype: torch.dtype, shape: list[int]):
        """Copy the referenced bytes out as a tensor of `shape`; FAILED_PRECONDITION if invalid."""
        shm, slot_bytes, n_slots, data_offset = self._open(name)
        rel = offset - data_offset
        if rel < 0 or rel % slot_bytes or rel // slot_bytes >= n_slots or nbytes > slot_bytes:
            raise FailedPrecondition(
                f"tensor reference out of bounds of arena {name!r} (offset {offset}, {nbytes} bytes)"
            )
        expected = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        if expected != nbytes:
            raise FailedPrecondition(f"tensor reference shape {shape} does not match its {nbytes} bytes")
        table = np.ndarray((n_slots,), dtype=np.uint64, buffer=shm.buf, offset=_TABLE_OFFSET)
        slot = rel // slot_bytes

        def check() -> None:
            if lease_id == 0 or int(table[slot]) != lease_id:
                raise FailedPrecondition("tensor reference is stale: its lease was released, expired or never issued")

        check()
        src = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes, offset=offset)
        out = src.clone().view(dtype).view(shape)
        check()  # the slot was not freed (and so not reused) while we copied
        return out

    def close(self) -> None:
        with self._lock:
            for shm, *_ in self._arenas.values():
                try:
                    shm.close()
                except BufferError:
                    pass  # a view is still alive; the mapping goes with the process
            self._arenas.clear()
