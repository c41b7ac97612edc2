"""glibc's malloc as a service sets it up: the arena cap bounds the heaps of threads alive at once,
and a held heap serves big blocks itself and keeps their memory once they are freed.

Each case runs in a fresh interpreter (the settings are process-wide and cannot be undone) and
reads glibc's own malloc_info report."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from services.common.glibc_malloc import cap_arenas, hold_heap
from tests.helpers import ROOT

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

THREADS = 6
MALLOC_INFO = """
import ctypes, os, tempfile
def malloc_info():
    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes, libc.fclose.argtypes = (ctypes.c_char_p, ctypes.c_char_p), (ctypes.c_void_p,)
    libc.malloc_info.argtypes = (ctypes.c_int, ctypes.c_void_p)
    path = os.path.join(tempfile.mkdtemp(), "info.xml")
    fp = libc.fopen(path.encode(), b"w")
    libc.malloc_info(0, fp)
    libc.fclose(fp)
    return open(path).read()
"""
ARENAS = f"""
import sys, threading
from services.common.glibc_malloc import cap_arenas
capped = cap_arenas(int(sys.argv[1]))
barrier = threading.Barrier({THREADS})
held = []
def work():
    held.append(bytearray(1 << 16))  # 64 KiB: from this thread's arena (under the mmap threshold)
    barrier.wait()  # all alive at once: an exited thread's arena would go to the next one
threads = [threading.Thread(target=work) for _ in range({THREADS})]
[t.start() for t in threads]; [t.join() for t in threads]
print(capped, malloc_info().count("<heap nr="))
"""
# Eight 4 MiB blocks alive, then freed: how many more mappings there are while they live, and
# how much memory the main arena still has from the system once they are gone.
HEAP = """
import re, sys
from services.common.glibc_malloc import hold_heap
held = hold_heap(int(sys.argv[1]))
mappings = lambda: int(re.search(r'<total type="mmap" count="(\\d+)"', malloc_info()).group(1))
before = mappings()
blocks = [bytearray(4 << 20) for _ in range(8)]
mapped = mappings() - before
del blocks
heap = int(re.search(r'<heap nr="0">.*?<system type="current" size="(\\d+)"', malloc_info(), re.S).group(1))
print(held, mapped, heap >> 20)
"""


def probe(script: str, arg: int, env: dict[str, str] | None = None) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", MALLOC_INFO + script, str(arg)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_the_cap_bounds_the_arenas_of_threads_alive_at_once(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert probe(ARENAS, 0) == ["False", str(THREADS + 1)]  # glibc's own limit: an arena per thread, and the main one
    assert probe(ARENAS, 2) == ["True", "2"]


def test_malloc_arena_max_in_the_environment_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "3")
    assert probe(ARENAS, 2) == ["False", "3"]
    assert cap_arenas(2) is False  # and in this process too, without touching it


def test_a_held_heap_serves_big_blocks_and_keeps_their_memory(monkeypatch):
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    held, mapped, heap_mib = probe(HEAP, 64)
    assert held == "True" and int(mapped) == 0 and int(heap_mib) >= 32  # all from the heap, still held
    held, mapped, heap_mib = probe(HEAP, 0)
    assert held == "False" and int(mapped) == 8 and int(heap_mib) < 4  # glibc's: mapped, and given back


def test_glibc_thresholds_in_the_environment_win(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert probe(HEAP, 64)[:2] == ["False", "8"]  # glibc's variable alone: each block mapped
    assert hold_heap(64) is False  # and in this process too, without touching it
