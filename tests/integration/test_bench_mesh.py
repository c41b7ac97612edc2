"""`vlmesh bench` against a running mesh: it runs, accounts for every request, writes its files."""

from __future__ import annotations

import json
import subprocess
import sys
import time


def test_bench_against_the_mesh(mesh, tiny_model, tmp_path):
    out = tmp_path / "bench"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "bench",
            "--model",
            str(tiny_model),
            "--gateway",
            mesh.target("gateway"),
            "--workload",
            "W1,W3",
            "--rates",
            "3,6",
            "--duration",
            "3",
            "--warmup",
            "0.5",
            "--out",
            str(out),
            "--compare-seeds",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OTHER HARDWARE" in result.stdout and "e2e p50" in result.stdout
    data = json.loads((out / "results.json").read_text())
    assert len(data["runs"]) == 4
    for run in data["runs"]:
        s = run["summary"]
        assert s["sent"] == sum(s["statuses"].values()) and s["lost"] == 0
        assert s["statuses"].get("OK") == s["sent"]
        assert s["e2e_ms"]["p99"] >= s["e2e_ms"]["p50"] > 0
        assert sum(c["sent"] for c in s["by_qos"].values()) == s["sent"]
        if run["workload"] == "W1":  # all distinct, the second rate's too: no cache may hit
            assert s["cache"]["feature_hit_ratio"] == s["cache"]["prefix_hit_ratio"] == 0, s["cache"]
    assert "per QoS class" in result.stdout
    assert (out / "latency-vs-throughput.png").stat().st_size > 1000
    assert (out / "latency-cdf.png").stat().st_size > 1000


def test_a_bench_stopped_midway_keeps_the_runs_it_finished(mesh, tiny_model, tmp_path):
    """results.json is rewritten as each run ends: killed during its second run, the bench
    leaves the first run's figures and requests."""
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "services.cli", "bench", "--model", str(tiny_model)]
    cmd += ["--gateway", mesh.target("gateway"), "--rates", "3,4,5", "--duration", "3", "--warmup", "0.5"]
    proc = subprocess.Popen([*cmd, "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (out / "results.json").exists():
            assert proc.poll() is None, "the bench ended before its first run was written"
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        proc.kill()  # the second run has about 3 s to go
        proc.wait()
    data = json.loads((out / "results.json").read_text())
    assert len(data["runs"]) == 1 and list(data["requests"]) == ["mesh W1 3/s"]
    s = data["runs"][0]["summary"]
    assert s["sent"] == sum(s["statuses"].values()) == len(data["requests"]["mesh W1 3/s"]) > 0
    assert data["env"]["commit"] and not (out / "latency-cdf.png").exists()
