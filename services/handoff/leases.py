"""Slot leases of a feature arena: who holds which slot, until when.

A slot is handed out with a lease (an unguessable id, a reference count and an
expiry). It returns to the free list when the last reference is released or when
the TTL passes, never earlier, so a reader holding a valid lease never sees the
slot reused under it. Transport-neutral: the host (SHM) and the CUDA arenas both use it.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass

from services.common.errors import ResourceExhausted


@dataclass
class Lease:
    """One slot held for a reader: the id travels in the TensorRef, the slot stays here."""

    id: int
    slot: int
    refs: int
    expires_at: float  # time.monotonic()
    expires_unix_ms: int


class LeaseTable:
    """Thread-safe slot allocator with leases."""

    def __init__(self, n_slots: int, ttl_s: float) -> None:
        self.n_slots = n_slots
        self.ttl_s = ttl_s
        self._free = list(range(n_slots - 1, -1, -1))
        self._by_id: dict[int, Lease] = {}
        self._lock = threading.Lock()

    def acquire(self, refs: int = 1) -> Lease:
        """A free slot under a fresh lease; RESOURCE_EXHAUSTED (with retry info) when none is free."""
        with self._lock:
            if not self._free:
                raise ResourceExhausted(
                    f"feature arena full: all {self.n_slots} slots are leased",
                    retry_after_s=min(self.ttl_s, 1.0),
                )
            slot = self._free.pop()
            lease_id = secrets.randbits(63) | 1  # never 0, which marks a free slot
            now = time.monotonic()
            lease = Lease(lease_id, slot, refs, now + self.ttl_s, int((time.time() + self.ttl_s) * 1000))
            self._by_id[lease_id] = lease
            return lease

    def release(self, lease_id: int) -> int | None:
        """Drop one reference; return the freed slot when it was the last, else None."""
        with self._lock:
            lease = self._by_id.get(lease_id)
            if lease is None:
                return None
            lease.refs -= 1
            if lease.refs > 0:
                return None
            return self._drop(lease)

    def reap(self) -> list[int]:
        """Free every expired lease; return their slots."""
        now = time.monotonic()
        with self._lock:
            expired = [lease for lease in self._by_id.values() if lease.expires_at <= now]
            return [self._drop(lease) for lease in expired]

    def _drop(self, lease: Lease) -> int:
        del self._by_id[lease.id]
        self._free.append(lease.slot)
        return lease.slot

    @property
    def leased(self) -> int:
        """How many slots are leased now."""
        with self._lock:
            return len(self._by_id)
