"""The launcher's children and signals.

Children die with the launcher: each starts through services/common/lifeline.py, which sets
PR_SET_PDEATHSIG(SIGTERM) on Linux before it execs the child, so even a SIGKILLed launcher
leaves none behind. SIGINT and SIGTERM reach the launcher at any stage
(loading weights, warming up, serving) as the exception `Stopped`, so its `finally` stops the
children it started and frees their ports.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence

from services.common import lifeline
from services.common.lifeline import STOP_SIGNALS


class Stopped(BaseException):
    """SIGINT or SIGTERM reached the launcher."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


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
    start children from the thread that lives as long as the mesh (the main one). No
    preexec_fn (lifeline.py says why): Python then starts the child with vfork and exec.
    """
    tied = [sys.executable, "-I", lifeline.__file__, str(os.getpid()), *cmd]
    return subprocess.Popen(tied, env=dict(env), start_new_session=True)


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
