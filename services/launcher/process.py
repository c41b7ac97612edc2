"""The launcher's children and signals.

Children die with the launcher: each gets PR_SET_PDEATHSIG(SIGTERM) on Linux, so even a
SIGKILLed launcher leaves none behind. SIGINT and SIGTERM reach the launcher at any stage
(loading weights, warming up, serving) as the exception `Stopped`, so its `finally` stops the
children it started and frees their ports.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class Stopped(BaseException):
    """SIGINT or SIGTERM reached the launcher."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _libc_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()


def _in_child(launcher_pid: int) -> None:
    """Between fork and exec: get SIGTERM when the launcher dies, and take the stop signals again
    (they are blocked in the launcher while it forks, and a signal mask survives exec)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != launcher_pid:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Delay SIGINT and SIGTERM to the end of the block: starting a child and recording it is one
    step, so a Stopped cannot leave a running child the launcher does not know."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def spawn(cmd: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen:
    """Start a child that dies with the launcher; call it inside `signals_held()`.

    Own session: a Ctrl-C at the terminal reaches only the launcher, which stops the children
    in order. PR_SET_PDEATHSIG fires when the launcher's thread that started the child ends, so
    start children from the thread that lives as long as the mesh (the main one).
    """
    return subprocess.Popen(
        list(cmd), env=dict(env), start_new_session=True, preexec_fn=functools.partial(_in_child, os.getpid())
    )


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Inside the block, SIGINT or SIGTERM raises Stopped in the main thread, wherever it is."""

    def raise_stopped(signum, frame):
        raise Stopped(signum)

    old = {s: signal.signal(s, raise_stopped) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """While the mesh stops: a second Ctrl-C must not cut the stop short and leave children."""
    old = {s: signal.signal(s, lambda signum, frame: None) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
