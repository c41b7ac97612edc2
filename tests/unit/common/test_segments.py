"""Shared-memory segments named after their owner (services/common/segments.py): a killed owner's
are removed by whoever sees it dead, and Python's resource tracker neither removes nor warns."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from services.common import segments

MAKE = (
    "import sys, time\n"
    "from services.common import segments\n"
    "shm = segments.create(4096)\n"
    "print(shm.name, flush=True)\n"
    "time.sleep(60)\n"
)


def owner() -> tuple[subprocess.Popen, str]:
    """A process that made a segment and waits; (it, the segment's name)."""
    proc = subprocess.Popen([sys.executable, "-c", MAKE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip().lstrip("/")


def test_a_killed_owners_segment_stays_until_removed_by_pid_and_nothing_warns():
    proc, name = owner()
    assert name.startswith(f"vlmesh-{proc.pid}-") and (segments.SHM_DIR / name).exists()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # Not the tracker's: it is still there, and no "leaked shared_memory" warning was printed.
    assert (segments.SHM_DIR / name).exists()
    assert "leaked" not in proc.stderr.read()
    assert segments.remove_owned_by(proc.pid + 1) == []  # another pid's are not touched
    assert segments.remove_owned_by(proc.pid) == [name] and not (segments.SHM_DIR / name).exists()


def test_a_new_owner_removes_the_segments_of_owners_that_are_gone_and_keeps_live_ones():
    dead, dead_name = owner()
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    live, live_name = owner()
    try:
        mine = segments.create(4096)  # sweeps first
        assert not (segments.SHM_DIR / dead_name).exists()
        assert (segments.SHM_DIR / live_name).exists()
        mine.close()
        segments.unlink(mine)
    finally:
        live.send_signal(signal.SIGKILL)
        live.wait()
        segments.remove_owned_by(live.pid)


def test_attaching_does_not_adopt_the_segment():
    """A consumer that attaches and exits leaves the owner's segment in place."""
    mine = segments.create(4096)
    try:
        code = f"from services.common import segments\nsegments.attach({mine.name.lstrip('/')!r}).close()\n"
        subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ})
        assert (segments.SHM_DIR / mine.name.lstrip("/")).exists()
    finally:
        mine.close()
        segments.unlink(mine)


def test_an_owner_that_closes_its_segment_leaves_nothing_and_prints_nothing():
    """Neither the segment nor a word from the resource tracker (it never had the segment)."""
    code = (
        "from services.common import segments\n"
        "shm = segments.create(4096)\n"
        "print(shm.name, flush=True)\n"
        "shm.close()\n"
        "segments.unlink(shm)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stderr == "" and not (segments.SHM_DIR / done.stdout.strip().lstrip("/")).exists()
