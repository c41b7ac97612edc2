"""Feature arenas in pages: a picture's features take a run of consecutive pages, as many as they need.

What a serving system needs of it: runs never overlap while held; a reference reads exactly its
own run (a size that ends in another page, or an offset inside a run, is refused); the cache keeps
runs within its pages and gives idle ones back until a new run fits; and pictures of mixed sizes do
not wear the arena into holes that refuse work it has room for.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.errors import FailedPrecondition, ResourceExhausted
from services.handoff.arena import ArenaView
from services.handoff.header import ALIGN, align, pages_in
from services.handoff.leases import LeaseTable
from services.handoff.shm import ShmArena, read_host

PAGE = ALIGN  # bytes: the smallest page an arena has
FLOATS = PAGE // 4


def test_a_tensor_takes_the_pages_its_bytes_need_and_reads_back_exactly():
    arena = ShmArena(page_bytes=PAGE, n_pages=8, ttl_s=30)
    view = ArenaView(arena.name)
    try:
        small = torch.arange(FLOATS // 2, dtype=torch.float32)  # half a page
        large = torch.arange(FLOATS * 3 + 5, dtype=torch.float32)  # three pages and a bit
        (a, a_off), (b, b_off) = arena.write(small), arena.write(large)
        assert (a.pages, b.pages) == (1, 4) and b.page == a.page + 1 and arena.leases.leased == 5
        assert torch.equal(read_host(view, a_off, small.numel() * 4, a.id, torch.float32, [small.numel()]), small)
        assert torch.equal(read_host(view, b_off, large.numel() * 4, b.id, torch.float32, [large.numel()]), large)
        arena.release(b.id)
        assert arena.leases.leased == 1
        with pytest.raises(FailedPrecondition, match="stale"):
            read_host(view, b_off, large.numel() * 4, b.id, torch.float32, [large.numel()])
    finally:
        view.close()
        arena.close()


def test_a_reference_reads_its_own_run_and_nothing_past_it():
    arena = ShmArena(page_bytes=PAGE, n_pages=8, ttl_s=30)
    view = ArenaView(arena.name)
    try:
        run, offset = arena.write(torch.ones(FLOATS * 3, dtype=torch.float32))  # pages 0-2
        nxt, _ = arena.write(torch.ones(FLOATS, dtype=torch.float32))  # page 3
        whole = 3 * PAGE
        assert read_host(view, offset, whole, run.id, torch.float32, [3 * FLOATS]).sum() == 3 * FLOATS
        for nbytes in (2 * PAGE, 4 * PAGE):  # ends in page 1 (no id there) or in 3 (the next lease's)
            with pytest.raises(FailedPrecondition, match="stale"):
                read_host(view, offset, nbytes, run.id, torch.uint8, [nbytes])
        with pytest.raises(FailedPrecondition, match="stale"):  # inside the run, not its start
            read_host(view, offset + PAGE, PAGE, run.id, torch.uint8, [PAGE])
        with pytest.raises(FailedPrecondition, match="out of bounds"):  # past the arena's last page
            read_host(view, offset, 9 * PAGE, run.id, torch.uint8, [9 * PAGE])
        with pytest.raises(FailedPrecondition, match="out of bounds"):  # not a page start
            read_host(view, offset + 64, 64, run.id, torch.uint8, [64])
        assert nxt.page == 3
    finally:
        view.close()
        arena.close()


def test_no_run_long_enough_is_refused_with_the_arena_named_full_and_the_free_pages():
    table = LeaseTable(6, ttl_s=30)
    held = [table.acquire(1) for _ in range(6)]
    for lease in held[::2]:  # pages 0, 2, 4 free: three pages, no two in a row
        table.release(lease.id)
    with pytest.raises(ResourceExhausted, match=r"no 2 free pages in a row \(3 of 6 free"):
        table.acquire(2)
    table.release(held[1].id)  # 0-2 free now
    assert table.acquire(3).page == 0


def test_idle_kept_runs_go_least_recently_used_first_until_a_new_run_fits():
    table = LeaseTable(8, ttl_s=30, keep_limit=6)
    a, b = table.acquire(3), table.acquire(3)  # pages 0-2 and 3-5
    assert table.keep(a.id, b"a") and table.keep(b.id, b"b") and table.kept == 6
    table.release(a.id)
    table.release(b.id)  # both idle, a the least recently used
    with pytest.raises(ValueError, match="does not fit an arena of 8"):
        table.acquire(9)  # more than the arena: a sizing bug, and nothing was evicted for it
    assert table.kept == 6
    fresh = table.acquire(4)  # 6-7 free: a goes (0-2, 6-7: still no 4 in a row), then b
    assert fresh.page == 0 and table.evictions == 2 and table.kept == 0
    assert table.find(b"a") is None and table.find(b"b") is None


def test_kept_pages_never_pass_the_limit_and_a_run_larger_than_it_is_not_kept():
    table = LeaseTable(16, ttl_s=30, keep_limit=4)
    big = table.acquire(5)
    assert table.keep(big.id, b"big") is False  # it alone passes the limit
    a = table.acquire(3)
    assert table.keep(a.id, b"a") and table.kept == 3
    b = table.acquire(2)
    assert table.keep(b.id, b"b") is False  # a is read: it cannot go, and 5 pages would pass 4
    table.release(a.id)  # idle now
    assert table.keep(b.id, b"b") and table.kept == 2 and table.find(b"a") is None  # a went for b


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 6), st.integers(0, 50)), max_size=80))
def test_held_runs_never_overlap_and_the_counts_add_up(ops):
    table = LeaseTable(24, ttl_s=30, keep_limit=8)
    held = []
    for acquire, pages, pick in ops:
        if acquire or not held:
            try:
                lease = table.acquire(pages)
            except ResourceExhausted:
                continue
            held.append(lease)
            if pick % 3 == 0:
                table.keep(lease.id, bytes([pick, len(held)]))
        else:
            table.release(held.pop(pick % len(held)).id)
        pages_held = sorted(p for lease in held for p in range(lease.page, lease.page + lease.pages))
        assert len(pages_held) == len(set(pages_held))  # no page in two held runs
        assert table.leased == len(pages_held) and table.kept <= 8


def test_mixed_sizes_do_not_wear_the_arena_into_holes():
    """Pictures of 1 to 80 pages (Qwen2.5-VL's 4 to 1,280 tokens in pages of 16), a few hundred held
    at a time in an arena of 64 of the largest: 20,000 leases, none refused while the pages held
    and asked for fit in two thirds of the arena."""
    rng = random.Random(43)
    table = LeaseTable(64 * 80, ttl_s=30)
    held: list = []
    refused = 0
    for _ in range(20_000):
        pages = rng.choice([4, 4, 4, 4, 20, 40, 80]) if rng.random() < 0.9 else rng.randint(1, 80)
        while held and (sum(lease.pages for lease in held) + pages > table.n_pages * 2 // 3 or rng.random() < 0.45):
            table.release(held.pop(rng.randrange(len(held))).id)
        try:
            held.append(table.acquire(pages))
        except ResourceExhausted:
            refused += 1
    assert refused == 0


def test_the_feature_cache_mib_hold_aligned_pages():
    assert pages_in(1, 4096) == 256
    assert pages_in(1, 5000) == 2**20 // align(5000) == 128
    assert pages_in(0, 4096) == 0
    assert pages_in(0.25, 4096) == 64
