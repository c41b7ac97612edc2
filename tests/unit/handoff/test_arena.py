"""Host feature arena: bounds, leases, TTL, liveness, and attaching from another process."""

from __future__ import annotations

import dataclasses
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch

from services.common.errors import FailedPrecondition, ResourceExhausted, Unavailable
from services.handoff import arena as arena_mod
from services.handoff import header
from services.handoff.arena import ArenaView
from services.handoff.leases import LeaseTable
from services.handoff.shm import ShmArena, read_host


@pytest.fixture
def arena():
    a = ShmArena(page_bytes=4 * 64, n_pages=3, ttl_s=30)
    yield a
    a.close()


def read(name, offset, nbytes, lease_id, dtype=torch.float32, shape=(64,)):
    view = ArenaView(name)
    try:
        return read_host(view, offset, nbytes, lease_id, dtype, list(shape))
    finally:
        view.close()


def test_roundtrip_and_release(arena):
    t = torch.arange(64, dtype=torch.float32).view(8, 8)
    lease, offset = arena.write(t)
    assert torch.equal(read(arena.name, offset, 256, lease.id, shape=(8, 8)), t)
    assert arena.release(lease.id) is True
    assert arena.release(lease.id) is False  # idempotent
    with pytest.raises(FailedPrecondition, match="stale"):
        read(arena.name, offset, 256, lease.id)


def test_reused_slot_never_serves_old_reference(arena):
    lease_a, off_a = arena.write(torch.zeros(64))
    arena.release(lease_a.id)
    leases = [arena.write(torch.full((64,), float(i))) for i in range(3)]
    assert off_a in [off for _, off in leases]  # the slot was reused...
    with pytest.raises(FailedPrecondition):  # ...and the old lease cannot read it
        read(arena.name, off_a, 256, lease_a.id)


@pytest.mark.parametrize(
    "offset_delta,nbytes,match",
    [
        (1, 256, "out of bounds"),
        (10**9, 256, "out of bounds"),
        (0, 10**6, "out of bounds"),
        (-(10**6), 256, "out of bounds"),
        (0, 0, "out of bounds"),
    ],
)
def test_forged_references(arena, offset_delta, nbytes, match):
    lease, offset = arena.write(torch.ones(64))
    with pytest.raises(FailedPrecondition, match=match):
        read(arena.name, offset + offset_delta, nbytes, lease.id)


def test_full_arena_is_resource_exhausted(arena):
    for _ in range(3):
        arena.write(torch.ones(64))
    with pytest.raises(ResourceExhausted, match="arena full"):
        arena.write(torch.ones(64))


def test_ttl_reclaims_unreleased_slots():
    arena = ShmArena(page_bytes=256, n_pages=2, ttl_s=0.05)
    try:
        lease, offset = arena.write(torch.ones(64))
        time.sleep(0.1)
        assert arena.reap() == 1
        assert arena.leases.leased == 0
        with pytest.raises(FailedPrecondition):
            read(arena.name, offset, 256, lease.id)
    finally:
        arena.close()


def test_lease_about_to_expire_is_refused():
    arena = ShmArena(page_bytes=256, n_pages=2, ttl_s=0.2)  # under the 0.5 s safety margin
    try:
        lease, offset = arena.write(torch.ones(64))
        with pytest.raises(FailedPrecondition, match="about to expire"):
            read(arena.name, offset, 256, lease.id)
    finally:
        arena.close()


def test_missing_arena_is_unavailable():
    with pytest.raises(Unavailable, match="has stopped"):
        ArenaView("vlmesh-no-such-arena")


def test_dead_producer_is_unavailable(arena, monkeypatch):
    """A producer whose heartbeat stopped may have lost its memory: UNAVAILABLE, not data."""
    lease, offset = arena.write(torch.ones(64))
    monkeypatch.setattr(arena_mod, "HEARTBEAT_STALE_S", 0.6)
    arena._stop.set()  # the heartbeat thread stops, as if the process had died
    time.sleep(1.0)
    with pytest.raises(Unavailable, match="no heartbeat"):
        read(arena.name, offset, 256, lease.id)


def test_dead_producer_fails_fast_after_the_first_watch(arena, monkeypatch):
    """A beat watched once and found still is not watched again on every read."""
    lease, offset = arena.write(torch.ones(64))
    monkeypatch.setattr(arena_mod, "HEARTBEAT_STALE_S", 0.6)
    arena._stop.set()
    time.sleep(1.0)
    view = ArenaView(arena.name)
    try:
        with pytest.raises(Unavailable):
            read_host(view, offset, 256, lease.id, torch.float32, [64])
        t0 = time.monotonic()
        with pytest.raises(Unavailable):
            read_host(view, offset, 256, lease.id, torch.float32, [64])
        assert time.monotonic() - t0 < 0.1
    finally:
        view.close()


def _beat_with(arena, value: float) -> None:
    struct.pack_into("<d", arena.shm.buf, header.HEARTBEAT_OFFSET, value)


def test_a_beat_that_looks_old_but_moves_is_alive(arena):
    """A clock that jumped (a paused VM resumed before the producer's heartbeat thread ran)
    shows an old beat: the consumer watches it move and reads, instead of saying "stopped"."""
    t = torch.arange(64, dtype=torch.float32)
    lease, offset = arena.write(t)
    _beat_with(arena, 0.0)  # as CI once saw: a beat 7,898 s behind the reader's clock
    assert torch.equal(read(arena.name, offset, 256, lease.id), t)


def test_a_producer_whose_clock_differs_is_alive(arena):
    """Expiries and beats are the producer's clock; an offset to the reader's is learned once."""
    arena._stop.set()
    arena._beat.join()
    skew = 7898.0
    stop = threading.Event()

    def beat() -> None:  # the producer's clock runs `skew` behind the reader's
        while not stop.wait(arena_mod.HEARTBEAT_PERIOD_S):
            _beat_with(arena, time.monotonic() - skew)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    time.sleep(2 * arena_mod.HEARTBEAT_PERIOD_S)  # the skewed beat has replaced the last true one
    try:
        t = torch.arange(64, dtype=torch.float32)
        lease, offset = arena.write(t)
        arena.publish(dataclasses.replace(lease, expires_at=time.monotonic() - skew + 30))
        view = ArenaView(arena.name)
        try:
            assert torch.equal(read_host(view, offset, 256, lease.id, torch.float32, [64]), t)
            t0 = time.monotonic()
            read_host(view, offset, 256, lease.id, torch.float32, [64])
            assert time.monotonic() - t0 < 0.1  # learned: no second watch
            # and an expiry is still judged on the producer's clock
            arena.publish(dataclasses.replace(lease, expires_at=time.monotonic() - skew + 0.2))
            with pytest.raises(FailedPrecondition, match="about to expire"):
                read_host(view, offset, 256, lease.id, torch.float32, [64])
        finally:
            view.close()
    finally:
        stop.set()
        thread.join()


def test_another_process_reads_and_does_not_unlink(arena):
    """A consumer process attaches, reads, exits; the owner's segment must survive it."""
    t = torch.arange(64, dtype=torch.float32)
    lease, offset = arena.write(t)
    code = (
        "import torch\n"
        "from services.handoff.arena import ArenaView\n"
        "from services.handoff.shm import read_host\n"
        f"out = read_host(ArenaView({arena.name!r}), {offset}, 256, {lease.id}, torch.float32, [64])\n"
        "print(float(out.sum()))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout) == float(t.sum())
    assert "leaked" not in result.stderr
    # Still there after the consumer exited (the resource tracker did not unlink it).
    assert torch.equal(read(arena.name, offset, 256, lease.id), t)


def test_each_reader_releases_once():
    table = LeaseTable(1, ttl_s=10, keep_limit=1)
    lease = table.acquire()
    table.keep(lease.id, b"k")
    _, second = table.find(b"k")
    assert second != lease.id and lease.refs == 2
    assert table.release(lease.id) == (True, None)
    assert table.release(lease.id) == (False, None)  # the same reader again: nothing, the other still holds
    assert lease.refs == 1
    assert table.release(second) == (True, lease)
    assert table.release(second) == (False, None)
    assert table.leased == 0
