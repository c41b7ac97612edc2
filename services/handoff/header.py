"""The feature arena's header, field by field (the layout is in services/handoff/arena.py), and
whole-word access to its 8-byte fields."""

from __future__ import annotations

import struct

MAGIC = b"VLMARENA"
VERSION = 3  # 3: a lease holds a run of pages, its first and last entries carry it
HOST, CUDA = 0, 1  # where the pages are: host memory, or a GPU's
HEADER = struct.Struct("<8sQQQQQd")  # magic, version, location, page_bytes, n_pages, data_offset, heartbeat
HEARTBEAT_OFFSET = HEADER.size - 8
TABLE_OFFSET = 64
ALIGN = 4096
HEARTBEAT_PERIOD_S = 0.25
HEARTBEAT_STALE_S = 3.0  # no heartbeat for this long: the producer is gone
WATCH_S = 2 * HEARTBEAT_PERIOD_S + 0.1  # how long a stale-looking beat is watched for a move
EXPIRY_MARGIN_S = 0.5  # refuse a lease this close to expiry: its pages could be reclaimed mid-copy


def align(n: int) -> int:
    """`n` rounded up to 4096 bytes (arena pages start on such boundaries)."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def pages_in(mib: float, page_bytes: int) -> int:
    """How many arena pages of `page_bytes` (aligned) `mib` MiB hold."""
    return int(mib * 2**20) // align(page_bytes)


ENTRY = struct.Struct("<Qd")  # one lease-table entry: lease id, expiry (its size and layout)


def _entry_offset(page: int) -> int:
    return TABLE_OFFSET + ENTRY.size * page


class Words:
    """The header's 8-byte fields as whole words: each load and store is one copy of 8 aligned
    bytes (memoryview items), so a reader sees a field's old value or its new one."""

    HEARTBEAT = HEARTBEAT_OFFSET // 8

    def __init__(self, buf: memoryview) -> None:
        self.u64 = buf.cast("Q")
        self.f64 = buf.cast("d")

    @staticmethod
    def id_index(page: int) -> int:
        return _entry_offset(page) // 8

    def entry(self, page: int) -> tuple[int, float]:
        """(lease id, expiry) of a page: the id first, as the writer's order needs."""
        i = self.id_index(page)
        return self.u64[i], self.f64[i + 1]

    def release(self) -> None:
        self.u64.release()
        self.f64.release()


def release_words(owner: object) -> None:
    """Before an owner's segment closes (or is collected): the words' exports hold it open."""
    words = getattr(owner, "_words", None)
    if words is not None:
        words.release()
