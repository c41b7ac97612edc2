"""A launcher's child is tied to it without a preexec_fn: it dies with the launcher, starts with
SIGINT/SIGTERM unblocked, and keeps its pid across the lifeline's exec."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from services.launcher.process import signals_held, spawn

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def test_the_child_starts_with_the_stop_signals_unblocked_and_keeps_its_pid(tmp_path):
    out = tmp_path / "out"
    mask = "sorted(signal.pthread_sigmask(signal.SIG_BLOCK, []))"
    code = f"import os, signal; open({str(out)!r}, 'w').write(f'{{os.getpid()}} {{{mask}}}')"
    with signals_held():  # as the supervisor spawns: the launcher's mask blocks them meanwhile
        proc = spawn([sys.executable, "-c", code], {})
    assert proc.wait(timeout=30) == 0
    pid, blocked = out.read_text().split(" ", 1)
    assert int(pid) == proc.pid  # exec'd in place: the launcher's Popen is the child itself
    assert "SIGTERM" not in blocked and "SIGINT" not in blocked and blocked.strip() == "[]"


def test_the_child_dies_when_its_launcher_is_killed(tmp_path):
    pid_file = tmp_path / "child.pid"
    launcher = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.getcwd()!r})
        from services.launcher.process import signals_held, spawn
        with signals_held():
            child = spawn([sys.executable, "-c", "import time; time.sleep(60)"], {{}})
        open({str(pid_file)!r}, "w").write(str(child.pid))
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", launcher])
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the launcher did not start its child"
            time.sleep(0.05)
        child = psutil.Process(int(pid_file.read_text()))
        # The lifeline has exec'd the sleeper once its command line is python -c ...sleep(60).
        deadline = time.monotonic() + 30
        while "time.sleep(60)" not in " ".join(child.cmdline()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        # PR_SET_PDEATHSIG, set before the exec (60 s of sleep otherwise). Not this test's child:
        # no exit code to read, and an unreaped one stays a zombie.
        deadline = time.monotonic() + 10
        while not gone(child):
            assert time.monotonic() < deadline, "the child outlived its launcher"
            time.sleep(0.05)
    finally:
        proc.kill()


def gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_launcher_gone_before_the_tie_starts_nothing():
    from services.common import lifeline

    # A pid that is not this process's parent: the lifeline refuses to exec its command.
    proc = subprocess.run(
        [sys.executable, "-I", lifeline.__file__, "1", sys.executable, "-c", "print('started')"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 128 + signal.SIGTERM and "started" not in proc.stdout


def test_a_command_that_cannot_start_says_so():
    proc = spawn(["/nonexistent/envoy", "-c", "x"], {})
    assert proc.wait(timeout=30) == 127
