"""--profile-host (services/common/host_profile.py) and its summary, `python -m bench.host_profile`."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from services.common import host_profile


def _busy(seconds: float) -> int:
    n, end = 0, time.thread_time() + seconds
    while time.thread_time() < end:
        n += 1
    return n


def summarise(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.host_profile", *args], capture_output=True, text=True)


def test_a_profile_names_each_thread_and_ranks_the_function_that_spent_the_cpu(tmp_path):
    path = tmp_path / "full.cuda1" / "vision.pstat"  # a worker's directory behind Envoy
    path.parent.mkdir()
    host_profile.start(str(path))
    worker = threading.Thread(target=_busy, args=(0.3,), name="vit_0")
    worker.start()
    worker.join()
    host_profile.stop()
    host_profile.stop()  # once written, a second stop is a no-op
    threads = path.with_name("vision.pstat.threads").read_text().splitlines()
    seconds = {line.split("\t")[2]: float(line.split("\t")[0]) for line in threads}
    assert seconds["vit_0"] >= 0.2, seconds  # the thread's own name, and its CPU

    done = summarise(str(tmp_path), "--top", "3")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("full.cuda1/vision.pstat: ") and "vit_0" in lines[1], lines
    own, _, _, function = lines[3].split(maxsplit=3)
    assert function.startswith("tests/unit/bench/test_host_profile.py:") and function.endswith(" _busy")
    assert float(own) > 50, lines  # most of what the profile counted


def test_without_a_path_nothing_is_profiled_and_an_empty_directory_is_refused(tmp_path):
    host_profile.check(None)
    host_profile.start(None)
    host_profile.stop()
    assert not list(tmp_path.iterdir())
    done = summarise(str(tmp_path))
    assert done.returncode == 1 and "no .pstat files" in done.stderr
