"""`vlmesh bench` against a running mesh: it runs, accounts for every request, writes its files."""

from __future__ import annotations

import json
import subprocess
import sys


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
