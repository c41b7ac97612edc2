"""The feature arena's shared header: page geometry, a lease table and a heartbeat.

Every arena (host memory or GPU memory) publishes this header in a small POSIX
shared-memory segment named by the arena id. Layout (little endian):

    [0, 64)            magic "VLMARENA", version, location (0 host, 1 CUDA), page_bytes,
                       n_pages, data_offset, heartbeat (float64, CLOCK_MONOTONIC seconds)
    [64, 64 + 16 n)    lease table: per page (uint64 lease id, float64 expiry); id 0 = free
                       (these and the heartbeat in the host's byte order: it never leaves the host)
    [data_offset, ...) page data, for host arenas only (CUDA arenas keep it on the device)

One picture's features take a run of consecutive pages (services/handoff/leases.py), and the
entries of the run's first and last pages both carry its lease (the pages between stay 0).
The producer alone writes the header and unlinks the segment. A consumer attaches once
per arena and checks every reference against it: the offset must be a page start, the
size must fit the arena, the first page's and the last page's (the one the size ends in)
lease ids must be the reference's (before and after the copy, a seqlock) with time left
before its expiry, and the heartbeat must be fresh, which tells a live producer from one
that died (its memory may be gone). A size that ends in another page than the run's last
finds an id of 0 or another lease's there, so no reference reads past its own run.

Those 8-byte fields are read and written as whole words (`Words`), never with struct:
`struct.pack_into` zero-fills a field before it writes it, and a reader could see a lease id or
an expiry of 0 while a share rewrites the same values (a spurious "stale" or "about to expire"
on a busy cached run).

The heartbeat and the expiries are the producer's CLOCK_MONOTONIC readings. A consumer
compares them with its own clock only as a fast path: when a beat looks stale it watches for
a few periods whether the beat still moves, and learns the offset between the two clocks if
it does. A clock that jumped (a paused virtual machine resumed: the consumer can look before
the producer's heartbeat thread has run) or that differs from the producer's is then no
false "stopped"; only a beat that stands still is.
"""

from __future__ import annotations

import logging
import threading
import time

from services.common import segments
from services.common.errors import FailedPrecondition, Unavailable
from services.handoff.header import (
    ENTRY,
    EXPIRY_MARGIN_S,
    HEADER,
    HEARTBEAT_PERIOD_S,
    HEARTBEAT_STALE_S,
    HOST,
    MAGIC,
    TABLE_OFFSET,
    VERSION,
    WATCH_S,
    Words,
    align,
    release_words,
)
from services.handoff.leases import Lease, LeaseTable

log = logging.getLogger(__name__)


class ArenaTable:
    """Producer side: owns the header segment, the leases and the heartbeat."""

    def __init__(self, page_bytes: int, n_pages: int, ttl_s: float, location: int, keep_limit: int = 0) -> None:
        """`keep_limit`: how many of the `n_pages` kept runs may take (the feature cache)."""
        self.page_bytes = align(page_bytes)
        self.n_pages = n_pages
        self.location = location
        header_bytes = align(TABLE_OFFSET + 16 * n_pages)
        self.data_offset = header_bytes if location == HOST else 0
        size = header_bytes + (n_pages * self.page_bytes if location == HOST else 0)
        self.shm = segments.create(size)  # named after this process, which alone unlinks it
        self.name = self.shm.name
        self.leases = LeaseTable(n_pages, ttl_s, keep_limit)
        # Held across every lease change and its header write (acquire, share, publish, release,
        # reap), so that the header's entries change in the table's order. Else a release's clear,
        # late, wipes what came after it: the entry published by a share of the run it made idle,
        # or by a write to the pages it freed, and that reader fails as stale.
        self._header_lock = threading.Lock()
        HEADER.pack_into(
            self.shm.buf, 0, MAGIC, VERSION, location, self.page_bytes, n_pages, self.data_offset, time.monotonic()
        )
        self.shm.buf[TABLE_OFFSET : TABLE_OFFSET + ENTRY.size * n_pages] = bytes(ENTRY.size * n_pages)
        self._words = Words(self.shm.buf)
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name=f"arena-heartbeat-{self.name}", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_PERIOD_S):
            self._words.f64[Words.HEARTBEAT] = time.monotonic()

    def page_offset(self, page: int) -> int:
        """Byte offset of a page's data (in the segment for host arenas, in the allocation for CUDA)."""
        return self.data_offset + page * self.page_bytes

    def pages_for(self, nbytes: int) -> int:
        """How many pages a tensor of `nbytes` takes; ValueError when it exceeds the whole arena (a
        sizing bug, not bad input)."""
        pages = max(1, -(-nbytes // self.page_bytes))
        if pages > self.n_pages:
            raise ValueError(f"tensor of {nbytes} bytes exceeds the arena's {self.n_pages} pages of {self.page_bytes}")
        return pages

    def acquire(self, nbytes: int) -> Lease:
        """A fresh lease on a run of pages about to be written with `nbytes`. Its header entries are
        cleared first: the pages may have been kept (evicted just now, or before), and no reference
        to what they held may validate while they are overwritten."""
        pages = self.pages_for(nbytes)
        with self._header_lock:
            lease = self.leases.acquire(pages)
            self._clear(lease)
        return lease

    def share(self, key: bytes) -> tuple[Lease, int] | None:
        """One more reader of the run kept under `key` (the lease, the new reader id), its expiry
        extended in the header; None on a miss."""
        with self._header_lock:
            found = self.leases.find(key)
            if found is not None:
                self._publish(found[0])
        return found

    def publish(self, lease: Lease) -> None:
        """Make a written run readable: its lease id goes in only after the data."""
        with self._header_lock:
            self._publish(lease)

    def _publish(self, lease: Lease) -> None:
        for page in {lease.last, lease.page}:
            i = Words.id_index(page)
            self._words.f64[i + 1] = lease.expires_at  # the expiry first: a reader that sees the id sees it
            self._words.u64[i] = lease.id

    def _clear(self, lease: Lease) -> None:
        for page in {lease.page, lease.last}:
            self._words.u64[Words.id_index(page)] = 0

    def release(self, reader: int) -> bool:
        """Drop one reference to a lease; False when none was held (released, expired, forged, or another arena's)."""
        with self._header_lock:
            held, unread = self.leases.release(reader)
            if unread is not None:
                self._clear(unread)  # free, or kept idle: a released reference must fail either way
        return held

    def reap(self) -> int:
        """Reclaim the runs whose lease expired unreleased (kept ones go idle); return how many."""
        with self._header_lock:
            leases = self.leases.reap()
            for lease in leases:
                self._clear(lease)
        if leases:
            log.warning("arena %s: reclaimed %d leases that expired unreleased", self.name, len(leases))
        return len(leases)

    def close(self) -> None:
        """Stop the heartbeat and unlink the header segment (the owner alone unlinks)."""
        self._stop.set()
        self._beat.join(timeout=2)
        release_words(self)
        self.shm.close()
        segments.unlink(self.shm)

    def __del__(self) -> None:
        release_words(self)


class ArenaView:
    """Consumer side: one attached header segment, and the checks every read goes through."""

    def __init__(self, name: str) -> None:
        try:
            self.shm = segments.attach(name)
        except FileNotFoundError as err:
            raise Unavailable(
                f"feature arena {name!r} does not exist: the vision process that made it has stopped"
            ) from err
        if self.shm.size < TABLE_OFFSET or bytes(self.shm.buf[:8]) != MAGIC:
            self.shm.close()
            raise FailedPrecondition(f"shared-memory segment {name!r} is not a vlmesh feature arena")
        _, version, self.location, self.page_bytes, self.n_pages, self.data_offset, _ = HEADER.unpack_from(self.shm.buf)
        if version != VERSION:
            self.shm.close()
            raise FailedPrecondition(
                f"feature arena {name!r} has layout version {version}, this process reads {VERSION}"
            )
        self.name = name
        self._words = Words(self.shm.buf)
        self._skew = 0.0  # this process's clock minus the producer's, learned from a moving beat
        self._still_beat: float | None = None  # a beat that was watched and did not move

    def _producer_now(self) -> float:
        """The producer's clock, as this process estimates it."""
        return time.monotonic() - self._skew

    def _beat(self) -> float:
        return self._words.f64[Words.HEARTBEAT]

    def check_alive(self) -> None:
        """UNAVAILABLE unless the producer's heartbeat is fresh, or moves while it is watched."""
        beat = self._beat()
        if self._producer_now() - beat <= HEARTBEAT_STALE_S:
            return
        if beat != self._still_beat:
            # Stale by this clock: a dead producer, or clocks that disagree. Watch the beat.
            watch_until = time.monotonic() + WATCH_S
            while time.monotonic() < watch_until:
                time.sleep(HEARTBEAT_PERIOD_S / 5)
                moved = self._beat()
                if moved != beat:
                    self._skew = time.monotonic() - moved
                    return
            self._still_beat = beat  # later checks fail at once until it moves again
        raise Unavailable(
            f"the vision process that owns feature arena {self.name!r} stopped "
            f"(no heartbeat for {self._producer_now() - beat:.1f}s)"
        )

    def pages(self, offset: int, nbytes: int) -> tuple[int, int]:
        """The first and last page a reference covers; FAILED_PRECONDITION unless it starts at a page
        and ends inside the arena."""
        rel = offset - self.data_offset
        first = rel // self.page_bytes
        last = first + (nbytes - 1) // self.page_bytes
        if rel < 0 or rel % self.page_bytes or nbytes <= 0 or last >= self.n_pages:
            raise FailedPrecondition(
                f"tensor reference out of bounds of arena {self.name!r} (offset {offset}, {nbytes} bytes)"
            )
        return first, last

    def check(self, pages: tuple[int, int], lease_id: int, margin_s: float = EXPIRY_MARGIN_S) -> None:
        """The lease holds the run of `pages` (first, last), and it and the producer are live; else
        FAILED_PRECONDITION or UNAVAILABLE."""
        self.check_alive()
        first, last = pages
        held_by, expires = self._words.entry(first)
        if lease_id == 0 or held_by != lease_id or self._words.entry(last)[0] != lease_id:
            raise FailedPrecondition("tensor reference is stale: its lease was released, expired or never issued")
        if expires - self._producer_now() < margin_s:
            raise FailedPrecondition("tensor reference is about to expire: ask the vision service again")

    def close(self) -> None:
        """Detach from the segment (never unlink: the producer owns it)."""
        release_words(self)
        try:
            self.shm.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with the process

    def __del__(self) -> None:
        release_words(self)


class ArenaViews:
    """Consumer side: the arenas this process has attached, one view per arena id, kept for its life.

    Shared by the transports that read arenas (SHM and CUDA IPC): each attaches once.
    """

    def __init__(self) -> None:
        self._views: dict[str, ArenaView] = {}

    def get(self, name: str) -> ArenaView:
        """The view of arena `name`, attached on first use (UNAVAILABLE when it does not exist)."""
        view = self._views.get(name)
        if view is None:
            view = self._views[name] = ArenaView(name)
        return view

    def forget(self, name: str) -> None:
        """Drop an arena whose producer is gone; a new producer makes a new arena."""
        view = self._views.pop(name, None)
        if view is not None:
            view.close()

    def close(self) -> None:
        """Detach from every arena."""
        for name in list(self._views):
            self.forget(name)
