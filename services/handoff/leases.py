"""Page leases of a feature arena: who holds which run of pages, until when, and which runs are kept.

An arena is cut into pages of one size; one picture's features take a run of consecutive pages
(as many as its bytes need: one, where every picture of a model is the same size). A run is
handed out with a lease (an unguessable id, its readers and an expiry). Each reader holds it
through its own unguessable reader id (the first reader's is the lease id itself), and releases
by that id, once: a second release of the same reader id does nothing. The pages return to the
free map when the last reader is gone or when the TTL passes, never earlier, so a reader holding
a valid lease never sees its pages reused under it. Transport-neutral: the host (SHM) and the
CUDA arenas both use it.

A lease can also be *kept* under a content key (the feature cache): when its last
reader releases it, the run keeps its data and its lease, idle (its arena clears the
header entries, so old references fail as for any released lease), and `find` hands the
same lease, published again, to the next reader of that key. Idle kept runs are evicted least
recently used first, when more than `keep_limit` pages would be kept or when `acquire`
finds no free run long enough. A kept run that anyone reads is never evicted.

Runs are placed first fit. Pictures of mixed sizes leave holes, but only pages that readers hold
or that the cache keeps are ever taken, and the cache gives its idle runs back, least recently
used first, until a run fits.
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
    """One run of pages held for a reader: the id travels in the TensorRef, the run stays here."""

    id: int
    page: int  # the run's first page
    pages: int  # how many pages it takes
    readers: set[int]  # reader ids holding it now
    expires_at: float  # time.monotonic()
    expires_unix_ms: int
    key: bytes | None = None  # kept under this content key (see `LeaseTable.keep`)
    meta: object = None  # what the arena's owner keeps beside a kept lease (its reference)

    @property
    def refs(self) -> int:
        return len(self.readers)

    @property
    def last(self) -> int:
        """The run's last page (its header entry carries the lease id as the first page's does)."""
        return self.page + self.pages - 1


class LeaseTable:
    """Thread-safe page allocator with leases, some of them kept under content keys."""

    def __init__(self, n_pages: int, ttl_s: float, keep_limit: int = 0) -> None:
        """`keep_limit`: how many of the `n_pages` pages kept runs may take (the feature cache)."""
        self.n_pages = n_pages
        self.ttl_s = ttl_s
        self.keep_limit = keep_limit
        self._used = bytearray(n_pages)  # 1 where a page is leased or kept
        self._free_pages = n_pages
        self._kept_pages = 0
        self._by_id: dict[int, Lease] = {}
        self._reader: dict[int, Lease] = {}  # reader id -> the lease it holds
        self._keys: dict[bytes, Lease] = {}
        self._idle: OrderedDict[int, Lease] = OrderedDict()  # kept, unread; least recently used first
        self._lock = threading.Lock()
        self.evictions = 0

    def _extend(self, lease: Lease) -> None:
        lease.expires_at = time.monotonic() + self.ttl_s
        lease.expires_unix_ms = int((time.time() + self.ttl_s) * 1000)

    def _fit(self, pages: int) -> int:
        """The first free run of `pages` pages (its first page), or -1."""
        return self._used.find(bytes(pages)) if pages <= self._free_pages else -1

    def acquire(self, pages: int = 1) -> Lease:
        """A free run of `pages` pages under a fresh lease; RESOURCE_EXHAUSTED (with retry info) when
        none is free. Idle kept runs are evicted for it, least recently used first, until one fits.
        """
        if not 0 < pages <= self.n_pages:
            raise ValueError(f"a run of {pages} pages does not fit an arena of {self.n_pages}")  # a sizing bug
        with self._lock:
            page = self._fit(pages)
            while page < 0 and self._idle:
                self._drop(next(iter(self._idle.values())))
                self.evictions += 1
                page = self._fit(pages)
            if page < 0:
                raise ResourceExhausted(
                    f"feature arena full: no {pages} free pages in a row "
                    f"({self._free_pages} of {self.n_pages} free, the rest leased)",
                    retry_after_s=min(self.ttl_s, 1.0),
                )
            self._used[page : page + pages] = b"\x01" * pages
            self._free_pages -= pages
            lease_id = secrets.randbits(63) | 1  # never 0, which marks a free page
            lease = Lease(lease_id, page, pages, {lease_id}, 0.0, 0)  # its first reader's id is its own
            self._extend(lease)
            self._by_id[lease.id] = self._reader[lease.id] = lease
            return lease

    def keep(self, lease_id: int, key: bytes, meta: object = None) -> bool:
        """Keep a held lease under `key` once its readers are done; False when it cannot be kept.

        It cannot when the key is kept already (another run has it), when its pages exceed
        `keep_limit`, or when the limit would be passed and the kept runs that could go are read.
        """
        with self._lock:
            lease = self._by_id.get(lease_id)
            if lease is None or lease.key is not None or key in self._keys or lease.pages > self.keep_limit:
                return False
            while self._kept_pages + lease.pages > self.keep_limit and self._idle:
                self._drop(next(iter(self._idle.values())))
                self.evictions += 1
            if self._kept_pages + lease.pages > self.keep_limit:
                return False
            lease.key, lease.meta = key, meta
            self._keys[key] = lease
            self._kept_pages += lease.pages
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

    def release(self, reader: int) -> tuple[bool, Lease | None]:
        """End one reader's hold: (whether it held one, the lease when nobody reads it any more).

        Its run is free again, or (kept) idle: either way no reference to it may validate now.
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
                return True, lease
            return True, self._drop(lease)

    def reap(self) -> list[Lease]:
        """End every expired lease: free its run, or (kept) make it idle. Return those leases."""
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
                    unread.append(lease)
        return unread

    def _drop(self, lease: Lease) -> Lease:
        del self._by_id[lease.id]
        for reader in lease.readers:
            self._reader.pop(reader, None)
        if lease.key is not None:
            del self._keys[lease.key]
            self._idle.pop(lease.id, None)
            self._kept_pages -= lease.pages
        self._used[lease.page : lease.page + lease.pages] = bytes(lease.pages)
        self._free_pages += lease.pages
        return lease

    @property
    def leased(self) -> int:
        """How many pages readers hold now."""
        with self._lock:
            return self.n_pages - self._free_pages - sum(lease.pages for lease in self._idle.values())

    @property
    def kept(self) -> int:
        """How many pages kept runs take (read or idle)."""
        with self._lock:
            return self._kept_pages
