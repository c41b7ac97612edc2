"""The first step of every child of `vlmesh up`: tie it to the launcher, then become the child.

    python -I lifeline.py LAUNCHER_PID CMD [ARG ...]

asks Linux for SIGTERM when the launcher dies (PR_SET_PDEATHSIG, which survives exec), takes
SIGINT and SIGTERM off the blocked mask the launcher spawned it with, and execs CMD in its
place (same pid). If the launcher is already gone, it stops instead of starting CMD.

Why a separate step and not `Popen(preexec_fn=...)`: a preexec_fn makes Python fork() instead
of vfork(), and fork() runs gRPC's fork handlers inside a launcher whose gRPC threads are busy
(health checks, warm-up); they log "skipping fork() handlers" and can leave the child in a
broken state (it may die of SIGABRT at start-up). Python's documentation calls preexec_fn unsafe
with threads for this reason.

Only the standard library, and run by path with -I: it works with any environment, Envoy's
empty one included.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def tie(launcher_pid: int) -> bool:
    """SIGTERM to this process when `launcher_pid` (its parent) dies; False if it already has."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # A launcher that died before prctl took effect left this process to another parent.
    return os.getppid() == launcher_pid


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit():
        print("usage: lifeline.py LAUNCHER_PID CMD [ARG ...]", file=sys.stderr)
        return 2
    if not tie(int(argv[0])):
        return 128 + signal.SIGTERM
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    try:
        os.execvp(argv[1], argv[1:])
    except OSError as err:
        print(f"cannot start {argv[1]}: {err.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
