"""Kept leases (the feature cache's slots): found by key, idle when unread, evicted LRU, never while read."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch

from services.common.errors import FailedPrecondition, ResourceExhausted
from services.handoff.arena import ArenaView
from services.handoff.leases import LeaseTable
from services.handoff.shm import ShmArena, read_host


def test_a_kept_lease_is_found_by_its_key_and_survives_its_readers():
    table = LeaseTable(3, ttl_s=10, keep_limit=2)
    lease = table.acquire()
    assert table.keep(lease.id, b"a") is True
    assert table.release(lease.id) == (True, lease)  # unread now, but kept: not freed
    assert (table.leased, table.kept) == (0, 1)
    again, reader = table.find(b"a")
    assert again is lease and again.refs == 1 and table.leased == 1 and reader != lease.id
    assert table.find(b"b") is None
    assert table.keep(table.acquire().id, b"a") is False  # one slot per key


def test_idle_kept_slots_are_evicted_least_recently_used_first_and_read_ones_never():
    table = LeaseTable(2, ttl_s=10, keep_limit=2)
    a, b = table.acquire(), table.acquire()
    table.keep(a.id, b"a")
    table.keep(b.id, b"b")
    table.release(a.id)  # a idle; b still read
    fresh = table.acquire()  # no free slot: a (idle) goes, b (read) stays
    assert fresh.page == a.page and table.find(b"a") is None and table.evictions == 1
    with pytest.raises(ResourceExhausted):
        table.acquire()  # b is read, fresh is held: nothing to evict
    table.release(b.id)
    table.release(fresh.id)
    assert table.find(b"b")[0] is b  # b was idle, not evicted by the failed acquire


def test_the_keep_limit_evicts_the_oldest_idle_and_refuses_when_all_are_read():
    table = LeaseTable(4, ttl_s=10, keep_limit=2)
    leases = [table.acquire() for _ in range(3)]
    assert table.keep(leases[0].id, b"0") and table.keep(leases[1].id, b"1")
    assert table.keep(leases[2].id, b"2") is False  # both kept slots are read
    table.release(leases[1].id)
    table.release(leases[0].id)  # idle order: 1, then 0
    assert table.keep(leases[2].id, b"2") is True
    assert table.find(b"1") is None and table.find(b"0") is not None
    assert table.kept == 2


def test_no_keep_limit_keeps_nothing():
    table = LeaseTable(2, ttl_s=10)
    lease = table.acquire()
    assert table.keep(lease.id, b"a") is False
    assert table.release(lease.id) == (True, lease)


def test_an_expired_kept_lease_goes_idle_not_free():
    table = LeaseTable(1, ttl_s=0.05, keep_limit=1)
    lease = table.acquire()  # a reader that never releases
    table.keep(lease.id, b"a")
    time.sleep(0.1)
    assert table.reap() == [lease]  # unread now (its header entry goes), not freed
    assert table.leased == 0 and table.release(lease.id) == (False, None)  # its hold went with the TTL
    assert table.find(b"a")[0] is lease and lease.refs == 1


def test_an_evicted_arena_refuses_its_old_references_before_it_is_overwritten():
    arena = ShmArena(page_bytes=256, n_pages=1, ttl_s=30, keep_limit=1)
    try:
        lease, offset = arena.write(torch.ones(64))
        arena.leases.keep(lease.id, b"a")
        arena.release(lease.id)
        view = ArenaView(arena.name)
        try:
            with pytest.raises(FailedPrecondition, match="stale"):  # released: refused, even though kept
                read_host(view, offset, 256, lease.id, torch.float32, [64])
            shared, reader = arena.share(b"a")
            assert shared is lease  # the next reader of the key: published again
            assert read_host(view, offset, 256, lease.id, torch.float32, [64]).sum() == 64
            assert arena.release(lease.id) is False  # the first reader's hold is gone already
            assert arena.release(reader) is True
            fresh = arena.acquire(256)  # evicts a; its header entry is cleared before any write
            with pytest.raises(FailedPrecondition, match="stale"):
                read_host(view, offset, 256, lease.id, torch.float32, [64])
            assert fresh.page == lease.page
        finally:
            view.close()
    finally:
        arena.close()


def test_a_share_racing_the_last_release_stays_readable(monkeypatch):
    """The last reader's release makes a kept slot idle and clears its header entry; another
    reader's share publishes the entry again. A share that lands between the two must not be
    wiped by the clear: the header changes under the same lock as the table."""
    arena = ShmArena(page_bytes=256, n_pages=1, ttl_s=30, keep_limit=1)
    try:
        lease, offset = arena.write(torch.ones(64))
        arena.leases.keep(lease.id, b"a")
        clear = arena._clear
        readers: list[int] = []
        sharers: list[threading.Thread] = []

        def share_in_the_window(slot: int) -> None:
            # Another thread's share, started after the table let go of the slot and before
            # its entry is cleared; given 0.2 s, it completes in the window unless it must wait.
            t = threading.Thread(target=lambda: readers.append(arena.share(b"a")[1]))
            t.start()
            t.join(timeout=0.2)
            clear(slot)
            monkeypatch.setattr(arena, "_clear", clear)
            sharers.append(t)

        monkeypatch.setattr(arena, "_clear", share_in_the_window)
        assert arena.release(lease.id) is True
        sharers[0].join(timeout=5)
        view = ArenaView(arena.name)
        try:
            assert read_host(view, offset, 256, lease.id, torch.float32, [64]).sum() == 64
        finally:
            view.close()
        assert arena.release(readers[0]) is True
    finally:
        arena.close()


def test_a_slot_freed_and_taken_at_once_keeps_its_new_entry(monkeypatch):
    """A release that frees a slot clears its entry; a write that takes the freed slot at once
    publishes a new one. The new entry must survive the old release's clear."""
    arena = ShmArena(page_bytes=256, n_pages=1, ttl_s=30)
    try:
        old, offset = arena.write(torch.ones(64))
        clear = arena._clear
        fresh: list = []
        writers: list[threading.Thread] = []

        def write_in_the_window(slot: int) -> None:
            # Another request's write, started after the table freed the slot and before its entry
            # is cleared; given 0.2 s, it completes in the window unless it must wait.
            monkeypatch.setattr(arena, "_clear", clear)
            t = threading.Thread(target=lambda: fresh.append(arena.write(torch.full((64,), 2.0))))
            t.start()
            t.join(timeout=0.2)
            clear(slot)
            writers.append(t)

        monkeypatch.setattr(arena, "_clear", write_in_the_window)
        assert arena.release(old.id) is True
        writers[0].join(timeout=5)
        ((new, new_offset),) = fresh
        assert new_offset == offset
        view = ArenaView(arena.name)
        try:
            assert read_host(view, offset, 256, new.id, torch.float32, [64]).sum() == 128
        finally:
            view.close()
    finally:
        arena.close()


READER = """
import sys, time
from services.handoff.arena import ArenaView
view = ArenaView(sys.argv[1])
want, bad, reads, stop = int(sys.argv[2]), 0, 0, time.monotonic() + float(sys.argv[3])
print("ready", flush=True)
while time.monotonic() < stop:
    held, expires = view._words.entry(1)
    reads += 1
    bad += held != want or expires < 1.0
print(reads, bad, flush=True)
view.close()
"""


def test_a_reader_in_another_process_never_sees_a_half_written_entry():
    """A share rewrites a kept slot's entry with the same id and a later expiry, over and over;
    a reader in another process (truly parallel) must see the id and a real expiry every time.
    (struct.pack_into zero-fills a field before writing it: that reader saw id 0 or expiry 0.)"""
    arena = ShmArena(page_bytes=256, n_pages=2, ttl_s=30, keep_limit=2)
    try:
        arena.write(torch.zeros(64))
        lease, _ = arena.write(torch.ones(64))
        assert lease.page == 1
        arena.leases.keep(lease.id, b"a")
        reader = subprocess.Popen(
            [sys.executable, "-c", READER, arena.name, str(lease.id), "1.5"], stdout=subprocess.PIPE, text=True
        )
        assert reader.stdout.readline().strip() == "ready"
        stop = time.monotonic() + 1.5
        while time.monotonic() < stop:
            arena.publish(lease)  # what each share does
            lease.expires_at += 1e-6
        reads, bad = map(int, reader.communicate(timeout=30)[0].split())
        assert reads > 1000 and bad == 0, (reads, bad)
    finally:
        arena.close()
