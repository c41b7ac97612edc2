"""glibc's malloc arenas, capped when a service starts.

glibc gives each thread that allocates an arena of its own, up to 8 per core, and each arena keeps
the chunks its threads freed. A serving process allocates from many threads, so its resident
memory drifts with the free space its arenas happen to hold while its bytes in use stay flat; a
few arenas stop the drift without slowing serving, too few do slow it (docs/PERF.md).
`mallopt(M_ARENA_MAX)` caps the arenas made from then on, so it runs before the servers start
their threads.

MALLOC_ARENA_MAX in the environment wins: glibc has read it, and this leaves it alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

ENV = "MALLOC_ARENA_MAX"
M_ARENA_MAX = -8  # <malloc.h>


def cap_arenas(arenas: int) -> bool:
    """Cap this process's malloc arenas at `arenas` (0: leave glibc's limit); True when it did.

    False, and no change, when the environment sets MALLOC_ARENA_MAX or the C library has no
    mallopt of glibc's (musl, macOS)."""
    if arenas <= 0 or ENV in os.environ or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own symbols: libc's, no library search
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if mallopt(M_ARENA_MAX, arenas) != 1:  # 1 on success (glibc); musl's stub answers 0
        log.warning("malloc: could not cap the arenas at %d (mallopt failed)", arenas)
        return False
    return True
