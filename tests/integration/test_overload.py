"""3x the measured capacity for 30 s, 20% realtime, 60% standard, 20% best-effort (bench/overload.py).

The mesh runs the latency-protection profile of docs/PERF.md (--max-in-flight
realtime=24,standard=2,best-effort=1). Every request ends answered or refused, realtime is
never refused and keeps its P99 within 2x of its P99 when it has the mesh to itself,
best-effort absorbs the most refusals, and refusals come back at once. With a cheaper variant
beside it, best-effort is degraded to that variant before it is refused (issue 19).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers import ROOT

# A run waits for another's turn at the host (our_turn); `make test` runs these alone (serial).
pytestmark = [pytest.mark.timeout(900), pytest.mark.serial]

PROFILE = ["--max-in-flight", "realtime=24,standard=2,best-effort=1"]


# The latencies compared here are the mesh's own, alone and at 3x its capacity. On a host that also
# runs other work (another test run beside this one), that work's share of the 2 cores would count
# as the mesh's latency, so the benchmark and the mesh it starts run at a higher CPU priority where
# this process may raise it (root, as in CI), as a deployment gives the mesh its own cores; and two
# test runs on one host take turns at it (a lock file), since equal priorities would share again.
AHEAD = ["nice", "-n", "-10"] if os.geteuid() == 0 and shutil.which("nice") else []
TURNS = Path(tempfile.gettempdir()) / "vlmesh-overload-test.lock"


@contextlib.contextmanager
def our_turn():
    with TURNS.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, or the process ends
        yield


def overload(tmp_path, *flags: str) -> dict:
    """Runs the benchmark as its users do (tests and bench/ never import each other)."""
    out = tmp_path / "overload.json"
    cmd = [*AHEAD, sys.executable, "-m", "bench.overload", "--model", str(ROOT / "models" / "demo")]
    # Realtime's P99 is compared with its P99 alone at its own rate: the idle run is not needed.
    cmd += ["--duration", "30", "--idle-s", "0", *flags, "--out", str(out), "--", *PROFILE]
    with our_turn():
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    print(run.stdout)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


def test_realtime_keeps_its_latency_at_three_times_capacity(tmp_path):
    result = overload(tmp_path)
    classes = result["overload"]
    for level, c in classes.items():
        assert c["other"] == {}, f"{level}: statuses other than OK and RESOURCE_EXHAUSTED: {c['other']}"
        assert c["sent"] == c["answered"] + c["refused"] > 0, level  # nothing lost
    refused = {level: c["refused"] / c["sent"] for level, c in classes.items()}
    assert refused["realtime"] == 0
    assert refused["best-effort"] >= refused["standard"] > 0  # the overload lands on the lower classes
    assert refused["best-effort"] >= 0.8
    for level in ("standard", "best-effort"):
        assert classes[level]["refusal_ms_p99"] < 500, "refusals must be quick, not after a wait"
    alone = result["unloaded"]["alone"]["e2e_ms_p99"]
    assert classes["realtime"]["e2e_ms_p99"] <= 2 * alone
    assert all(c["degraded"] == 0 for c in classes.values())  # nowhere to degrade to


def test_with_a_cheaper_variant_best_effort_degrades_before_it_is_refused(tmp_path):
    """The same overload, an int8 variant beside the mesh (its own workers, the same profile, at
    the lowest CPU priority): best-effort work the mesh would refuse is served by int8 first,
    marked degraded; realtime and standard are never degraded, realtime never refused.

    Realtime's P99 is held to 4x its P99 alone here, not the 2x above: on a 2-core host the int8
    variant's inference (a third of the host's capacity) and the gateway's relays share the
    cores that a deployment gives each variant separately (docs/PERF.md has the figures)."""
    result = overload(tmp_path, "--cheaper", "int8")
    classes = result["overload"]
    for level, c in classes.items():
        assert c["other"] == {}, f"{level}: statuses other than OK and RESOURCE_EXHAUSTED: {c['other']}"
        assert c["sent"] == c["answered"] + c["refused"] > 0, level
    best = classes["best-effort"]
    assert best["degraded"] >= 0.1 * best["sent"], best  # served by int8 instead of refused
    assert classes["realtime"]["refused"] == 0
    assert classes["realtime"]["degraded"] == classes["standard"]["degraded"] == 0
    assert classes["realtime"]["e2e_ms_p99"] <= 4 * result["unloaded"]["alone"]["e2e_ms_p99"]
