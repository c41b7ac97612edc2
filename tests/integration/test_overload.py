"""3x the measured capacity for 30 s, 20% realtime, 60% standard, 20% best-effort (bench/overload.py).

The mesh runs the latency-protection profile of docs/PERF.md (--max-in-flight
realtime=24,standard=4,best-effort=2). Every request ends answered or refused, realtime is
never refused and keeps its P99 within 2x of its P99 when it has the mesh to itself,
best-effort absorbs the most refusals, and refusals come back at once.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import ROOT


def test_realtime_keeps_its_latency_at_three_times_capacity(tmp_path):
    """Runs the benchmark as its users do (tests and bench/ never import each other)."""
    profile = ["--max-in-flight", "realtime=24,standard=4,best-effort=2"]
    out = tmp_path / "overload.json"
    cmd = [sys.executable, "-m", "bench.overload", "--model", str(ROOT / "models" / "demo"), "--duration", "30"]
    run = subprocess.run([*cmd, "--out", str(out), "--", *profile], cwd=ROOT, capture_output=True, text=True)
    print(run.stdout)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
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
