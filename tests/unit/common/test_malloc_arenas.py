"""The arena cap takes effect: threads alive at once share the capped number of glibc arenas.

Each case runs in a fresh interpreter (the cap is process-wide and cannot be undone), which
starts 6 threads that each allocate from malloc while all are alive, then counts the heaps in
glibc's malloc_info report."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from services.common.malloc_arenas import cap_arenas
from tests.helpers import ROOT

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's arenas only")

THREADS = 6
PROBE = f"""
import ctypes, os, sys, tempfile, threading
from services.common.malloc_arenas import cap_arenas
capped = cap_arenas(int(sys.argv[1]))
barrier = threading.Barrier({THREADS})
held = []
def work():
    held.append(bytearray(1 << 16))  # 64 KiB: from this thread's arena (under the mmap threshold)
    barrier.wait()  # all alive at once: an exited thread's arena would go to the next one
threads = [threading.Thread(target=work) for _ in range({THREADS})]
[t.start() for t in threads]; [t.join() for t in threads]
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes, libc.fclose.argtypes = (ctypes.c_char_p, ctypes.c_char_p), (ctypes.c_void_p,)
libc.malloc_info.argtypes = (ctypes.c_int, ctypes.c_void_p)
path = os.path.join(tempfile.mkdtemp(), "info.xml")
fp = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, fp)
libc.fclose(fp)
print(capped, open(path).read().count("<heap nr="))
"""


def probe(arenas: int, env: dict[str, str] | None = None) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(arenas)], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    capped, heaps = out.stdout.split()
    return capped, int(heaps)


def test_the_cap_bounds_the_arenas_of_threads_alive_at_once(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert probe(0) == ("False", THREADS + 1)  # glibc's own limit: an arena per thread, and the main one
    assert probe(2) == ("True", 2)


def test_malloc_arena_max_in_the_environment_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "3")
    assert probe(2) == ("False", 3)
    assert cap_arenas(2) is False  # and in this process too, without touching it
