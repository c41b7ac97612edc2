"""Shared-memory arena: bounds, leases, TTL, and attaching from another process."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from services.common.errors import FailedPrecondition, ResourceExhausted, Unavailable
from services.common.leases import LeaseTable
from services.common.shm_arena import ShmArena, ShmReader


@pytest.fixture
def arena():
    a = ShmArena(slot_bytes=4 * 64, n_slots=3, ttl_s=30)
    yield a
    a.close()


def test_roundtrip_and_release(arena):
    reader = ShmReader()
    t = torch.arange(64, dtype=torch.float32).view(8, 8)
    lease, offset = arena.write(t)
    out = reader.read(arena.name, offset, 256, lease.id, torch.float32, [8, 8])
    assert torch.equal(out, t)
    assert arena.release(lease.id) is True
    assert arena.release(lease.id) is False  # idempotent
    with pytest.raises(FailedPrecondition, match="stale"):
        reader.read(arena.name, offset, 256, lease.id, torch.float32, [8, 8])
    reader.close()


def test_reused_slot_never_serves_old_reference(arena):
    reader = ShmReader()
    lease_a, off_a = arena.write(torch.zeros(64))
    arena.release(lease_a.id)
    leases = [arena.write(torch.full((64,), float(i))) for i in range(3)]
    assert off_a in [off for _, off in leases]  # the slot was reused...
    with pytest.raises(FailedPrecondition):  # ...and the old lease cannot read it
        reader.read(arena.name, off_a, 256, lease_a.id, torch.float32, [64])
    reader.close()


@pytest.mark.parametrize(
    "offset_delta,nbytes,shape,match",
    [
        (1, 256, [64], "out of bounds"),
        (10**9, 256, [64], "out of bounds"),
        (0, 10**6, [250000], "out of bounds"),
        (0, 256, [65], "does not match"),
        (-(10**6), 256, [64], "out of bounds"),
    ],
)
def test_forged_references(arena, offset_delta, nbytes, shape, match):
    reader = ShmReader()
    lease, offset = arena.write(torch.ones(64))
    with pytest.raises(FailedPrecondition, match=match):
        reader.read(arena.name, offset + offset_delta, nbytes, lease.id, torch.float32, shape)
    reader.close()


def test_full_arena_is_resource_exhausted(arena):
    for _ in range(3):
        arena.write(torch.ones(64))
    with pytest.raises(ResourceExhausted, match="arena full"):
        arena.write(torch.ones(64))


def test_ttl_reclaims_unreleased_slots():
    arena = ShmArena(slot_bytes=256, n_slots=2, ttl_s=0.05)
    try:
        reader = ShmReader()
        lease, offset = arena.write(torch.ones(64))
        time.sleep(0.1)
        assert arena.reap() == 1
        assert arena.leases.leased == 0
        with pytest.raises(FailedPrecondition):
            reader.read(arena.name, offset, 256, lease.id, torch.float32, [64])
        reader.close()
    finally:
        arena.close()


def test_missing_arena_is_unavailable():
    with pytest.raises(Unavailable, match="has stopped"):
        ShmReader().read("vlmesh-no-such-arena", 4096, 4, 1, torch.float32, [1])


def test_another_process_reads_and_does_not_unlink(arena):
    """A consumer process attaches, reads, exits; the owner's segment must survive it."""
    t = torch.arange(64, dtype=torch.float32)
    lease, offset = arena.write(t)
    code = (
        "import torch, sys\n"
        "from services.common.shm_arena import ShmReader\n"
        f"out = ShmReader().read({arena.name!r}, {offset}, 256, {lease.id}, torch.float32, [64])\n"
        "print(float(out.sum()))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout) == float(t.sum())
    assert "leaked" not in result.stderr
    # Still there after the consumer exited (the resource tracker did not unlink it).
    out = ShmReader().read(arena.name, offset, 256, lease.id, torch.float32, [64])
    assert torch.equal(out, t)


def test_lease_refcount():
    table = LeaseTable(1, ttl_s=10)
    lease = table.acquire(refs=2)
    assert table.release(lease.id) is None
    assert table.release(lease.id) == lease.slot
    assert table.leased == 0
