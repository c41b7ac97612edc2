"""Names of the POSIX shared-memory segments a process owns, and their removal once it is dead.

A process that is killed (SIGKILL, or stalled and then killed) cannot unlink what it made, and
Python's resource tracker, which would, is itself a process that a slow or busy host may not
run in time, and it warns on every one. So the feature arenas' segments are named after their
owner's pid (`vlmesh-PID-RANDOM`) and left out of the tracker: the owner unlinks them when it
closes, and whoever sees it dead does so otherwise. The launcher after a child exits
(services/launcher/supervisor.py), and a new owner at start for any owner that is gone.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import sys
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "vlmesh-"
SHM_DIR = Path("/dev/shm")
_OWNED = re.compile(rf"{PREFIX}(\d+)-[0-9a-f]+")


def create(size: int) -> shared_memory.SharedMemory:
    """A new segment of `size` bytes named after this process, which alone unlinks it (not the
    resource tracker). First removes the segments of owners that are gone."""
    remove_orphans()
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, create=True, size=size, track=False)
    shm = shared_memory.SharedMemory(name=name, create=True, size=size)
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


def unlink(shm: shared_memory.SharedMemory) -> None:
    """Remove a segment this process made with `create`. Not `shm.unlink()`: before 3.13 it also
    tells the resource tracker, which never had it and prints a KeyError."""
    if sys.version_info >= (3, 13):
        shm.unlink()
    else:
        shared_memory._posixshmem.shm_unlink(shm._name)  # type: ignore[attr-defined]


def attach(name: str) -> shared_memory.SharedMemory:
    """Another process's segment. Before 3.13 the resource tracker adopts an attached segment and
    unlinks it when this process exits, destroying the owner's arena: only the owner unlinks."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    shm = shared_memory.SharedMemory(name=name)
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


def owned_by(pids: set[int], shm_dir: Path = SHM_DIR) -> list[str]:
    """The names of the segments these processes made (another mesh's beside them are not theirs)."""
    return [p.name for p in _segments(shm_dir) if (m := _OWNED.fullmatch(p.name)) and int(m.group(1)) in pids]


def remove_owned_by(pid: int, shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink every segment that process `pid` made (call once it is dead); the names removed."""
    removed = owned_by({pid}, shm_dir)
    for name in removed:
        (shm_dir / name).unlink(missing_ok=True)
    if removed:
        log.info("removed the shared memory of process %d: %s", pid, ", ".join(removed))
    return removed


def remove_orphans(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink the segments whose owner is no longer alive (on this host's pid namespace)."""
    removed = []
    for path in _segments(shm_dir):
        m = _OWNED.fullmatch(path.name)
        if m and not _alive(int(m.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    if removed:
        log.warning("removed shared memory left by processes that are gone: %s", ", ".join(removed))
    return removed


def _segments(shm_dir: Path) -> list[Path]:
    try:
        return [p for p in shm_dir.iterdir() if p.name.startswith(PREFIX)]
    except OSError:  # no /dev/shm (not Linux): nothing to find
        return []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True
