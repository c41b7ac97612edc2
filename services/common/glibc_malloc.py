"""glibc's malloc, set up when a service starts: its arenas capped, its heap held.

Arenas. glibc gives each thread that allocates an arena of its own, up to 8 per core, and each
arena keeps the chunks its threads freed. A serving process allocates from many threads, so its
resident memory drifts with the free space its arenas happen to hold while its bytes in use stay
flat; a few arenas stop the drift without slowing serving, too few do slow it (docs/PERF.md).
`mallopt(M_ARENA_MAX)` caps the arenas made from then on, so it runs before the servers start
their threads.

The heap. By default glibc serves a block above a moving threshold (128 KiB at first) from a
mapping of its own, unmapped when freed, and returns the heap's free top to the system past
128 KiB. Each batch's tensors then fault their pages in again, and private memory swings by a
few percent from one second to the next as the heap grows and is trimmed: noise that hides a
leak's rise. Held, blocks up to 32 MiB come from the heap and up to `hold_mib` of its free top
stays: memory rises to its working set and stays there (docs/PERF.md).

Variables of glibc's in the environment win (MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_,
MALLOC_TRIM_THRESHOLD_): glibc has read them, and this leaves them alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

ARENA_ENV = "MALLOC_ARENA_MAX"
HEAP_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
# <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit hosts (HEAP_MAX_SIZE / 2)


def _mallopt():
    """glibc's mallopt, or None where the C library has none (musl, macOS)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own symbols: libc's, no library search
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt


def cap_arenas(arenas: int) -> bool:
    """Cap this process's malloc arenas at `arenas` (0: leave glibc's limit); True when it did.

    False, and no change, when the environment sets MALLOC_ARENA_MAX or the C library has no
    mallopt of glibc's."""
    if arenas <= 0 or ARENA_ENV in os.environ or (mallopt := _mallopt()) is None:
        return False
    if mallopt(M_ARENA_MAX, arenas) != 1:  # 1 on success (glibc); musl's stub answers 0
        log.warning("malloc: could not cap the arenas at %d (mallopt failed)", arenas)
        return False
    return True


def hold_heap(hold_mib: int) -> bool:
    """Serve blocks up to 32 MiB from the heap and keep up to `hold_mib` MiB of its free top
    (0: leave glibc's moving thresholds); True when it did.

    False, and no change, when the environment sets either threshold or the C library has no
    mallopt of glibc's. Setting a threshold turns glibc's moving one off, so both are set."""
    if hold_mib <= 0 or any(v in os.environ for v in HEAP_ENV) or (mallopt := _mallopt()) is None:
        return False
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(M_TRIM_THRESHOLD, hold_mib << 20) != 1:
        log.warning("malloc: could not hold the heap (mallopt failed)")
        return False
    return True
