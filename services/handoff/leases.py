"""Slot leases of a feature arena: who holds which slot, until when, and which slots are kept.

A slot is handed out with a lease (an unguessable id, its readers and an expiry). Each
reader holds it through its own unguessable reader id (the first reader's is the lease
id itself), and releases by that id, once: a second release of the same reader id does
nothing. The slot returns to the free list when the last reader is gone or when the TTL
passes, never earlier, so a reader holding a valid lease never sees the slot reused
under it. Transport-neutral: the host (SHM) and the CUDA arenas both use it.

A lease can also be *kept* under a content key (the feature cache): when its last
reader releases it, the slot keeps its data and its lease, idle (its arena clears the
header entry, so old references fail as for any released lease), and `find` hands the
same lease, published again, to the next reader of that key. Idle kept slots are evicted least
recently used first, when more than `keep_limit` would be kept or when `acquire`
finds no free slot. A kept slot that anyone reads is never evicted.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from services.common.errors import ResourceExhausted


@dataclass
class Lease:
    """One slot held for a reader: the id travels in the TensorRef, the slot stays here."""

    id: int
    slot: int
    readers: set[int]  # reader ids holding it now
    expires_at: float  # time.monotonic()
    expires_unix_ms: int
    key: bytes | None = None  # kept under this content key (see `LeaseTable.keep`)
    meta: object = None  # what the arena's owner keeps beside a kept lease (its reference)

    @property
    def refs(self) -> int:
        return len(self.readers)


class LeaseTable:
    """Thread-safe slot allocator with leases, some of them kept under content keys."""

    def __init__(self, n_slots: int, ttl_s: float, keep_limit: int = 0) -> None:
        self.n_slots = n_slots
        self.ttl_s = ttl_s
        self.keep_limit = keep_limit
        self._free = list(range(n_slots - 1, -1, -1))
        self._by_id: dict[int, Lease] = {}
        self._reader: dict[int, Lease] = {}  # reader id -> the lease it holds
        self._keys: dict[bytes, Lease] = {}
        self._idle: OrderedDict[int, Lease] = OrderedDict()  # kept, unread; least recently used first
        self._lock = threading.Lock()
        self.evictions = 0

    def _extend(self, lease: Lease) -> None:
        lease.expires_at = time.monotonic() + self.ttl_s
        lease.expires_unix_ms = int((time.time() + self.ttl_s) * 1000)

    def acquire(self) -> Lease:
        """A free slot under a fresh lease; RESOURCE_EXHAUSTED (with retry info) when none is free.

        With no slot free, the least recently used idle kept slot is evicted for it.
        """
        with self._lock:
            if not self._free and self._idle:
                self._drop(next(iter(self._idle.values())))
                self.evictions += 1
            if not self._free:
                raise ResourceExhausted(
                    f"feature arena full: all {self.n_slots} slots are leased",
                    retry_after_s=min(self.ttl_s, 1.0),
                )
            slot = self._free.pop()
            lease_id = secrets.randbits(63) | 1  # never 0, which marks a free slot
            lease = Lease(lease_id, slot, {lease_id}, 0.0, 0)  # its first reader's id is its own
            self._extend(lease)
            self._by_id[lease.id] = self._reader[lease.id] = lease
            return lease

    def keep(self, lease_id: int, key: bytes, meta: object = None) -> bool:
        """Keep a held lease under `key` once its readers are done; False when it cannot be kept.

        It cannot when the key is kept already (another slot has it), when `keep_limit`
        is 0, or when the limit is reached and every kept slot is being read.
        """
        with self._lock:
            lease = self._by_id.get(lease_id)
            if lease is None or lease.key is not None or key in self._keys or self.keep_limit <= 0:
                return False
            if len(self._keys) >= self.keep_limit:
                if not self._idle:
                    return False
                self._drop(next(iter(self._idle.values())))
                self.evictions += 1
            lease.key, lease.meta = key, meta
            self._keys[key] = lease
            return True

    def find(self, key: bytes) -> tuple[Lease, int] | None:
        """The lease kept under `key` and a new reader id on it, with a fresh expiry; None on a miss."""
        with self._lock:
            lease = self._keys.get(key)
            if lease is None:
                return None
            self._idle.pop(lease.id, None)
            reader = secrets.randbits(63) | 1
            lease.readers.add(reader)
            self._reader[reader] = lease
            self._extend(lease)
            return lease, reader

    def release(self, reader: int) -> tuple[bool, int | None]:
        """End one reader's hold: (whether it held one, the slot when nobody reads it any more).

        That slot is free again, or (kept) idle: either way no reference to it may validate now.
        """
        with self._lock:
            lease = self._reader.pop(reader, None)
            if lease is None:
                return False, None
            lease.readers.discard(reader)
            if lease.readers:
                return True, None
            if lease.key is not None:
                self._idle[lease.id] = lease  # kept: most recently used last
                return True, lease.slot
            return True, self._drop(lease)

    def reap(self) -> list[int]:
        """End every expired lease: free its slot, or (kept) make it idle. Return those slots."""
        now = time.monotonic()
        unread = []
        with self._lock:
            for lease in [lease for lease in self._by_id.values() if lease.expires_at <= now and lease.refs > 0]:
                for reader in lease.readers:
                    del self._reader[reader]
                lease.readers.clear()
                if lease.key is None:
                    unread.append(self._drop(lease))
                else:
                    self._idle[lease.id] = lease
                    unread.append(lease.slot)
        return unread

    def _drop(self, lease: Lease) -> int:
        del self._by_id[lease.id]
        for reader in lease.readers:
            self._reader.pop(reader, None)
        if lease.key is not None:
            del self._keys[lease.key]
            self._idle.pop(lease.id, None)
        self._free.append(lease.slot)
        return lease.slot

    @property
    def leased(self) -> int:
        """How many slots readers hold now."""
        with self._lock:
            return len(self._by_id) - len(self._idle)

    @property
    def kept(self) -> int:
        """How many slots are kept under a content key (read or idle)."""
        with self._lock:
            return len(self._keys)
