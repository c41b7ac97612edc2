"""The GPU-only bench tools, run as their users run them, on the demo model and tiny arguments: a
change that breaks one fails `make test-gpu`. (The CPU ones: tests/integration/test_bench_tools.py.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.gpu

DEMO = str(ROOT / "models" / "demo")


def tool(*args: str, timeout: int = 840) -> subprocess.CompletedProcess:
    """`python -m ARGS` from the repository root; it must exit 0."""
    result = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert result.returncode == 0, f"{' '.join(args)}:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


@pytest.mark.timeout(900)
def test_decode_step_times_the_engines_graphs_against_the_floor(tmp_path):
    out = tmp_path / "decode_step.json"
    tool(
        *("bench.decode_step", "--model", DEMO, "--batches", "1,2", "--context", "64", "--steps", "3"),
        *("--prefill", "32", "--mixed", "2", "--copy-mib", "64", "--out", str(out)),
    )
    data = json.loads(out.read_text())
    assert data["device"] == "cuda" and data["copy_bandwidth_Bps"] > 0
    assert all(r["device_s"] > 0 and r["floor_s"] > 0 for r in data["results"])
    assert {p["mode"] for p in data["prefill"]} >= {"packed", "chunks"}
    assert all(p["floor_s"] > 0 for p in data["prefill"])


def test_vision_tower_times_the_captured_tower():
    result = tool("bench.vision_tower", "--model", DEMO, "--batches", "1,2", "--steps", "3")
    assert re.search(r"^\| 2 \| \d+\.\d{3} \|", result.stdout, re.M), result.stdout


@pytest.mark.timeout(900)
def test_flex_attention_probes_every_case():
    result = tool("bench.flex_attention", "--layers", "2", "--pages", "32")
    assert "| decode b=1" in result.stdout and "| prefill n=608" in result.stdout, result.stdout


@pytest.mark.timeout(900)
def test_gemv_sweeps_the_demo_models_linears(tmp_path):
    out = tmp_path / "gemv.json"
    tool("bench.gemv", "--model", DEMO, "--layers", "2", "--out", str(out))
    assert [r["linear"] for r in json.loads(out.read_text())] == ["qkv", "o", "gate_up", "down"]


@pytest.mark.timeout(900)
def test_int8_mm_sweeps_a_decode_row_and_a_batch(tmp_path):
    out = tmp_path / "int8_mm.json"
    tool("bench.int8_mm", "--model", DEMO, "--rows", "1,8", "--layers", "2", "--out", str(out))
    assert sorted({r["m"] for r in json.loads(out.read_text())}) == [1, 8]


@pytest.mark.timeout(900)
def test_quant_agreement_puts_fp8_beside_bf16(tmp_path):
    out = tmp_path / "agreement.json"
    tool("bench.quant_agreement", "--model", DEMO, "--kinds", "int8,fp8", "--sequences", "4", "--tokens", "64",
         "--out", str(out))  # fmt: skip
    rows = json.loads(out.read_text())["kinds"]
    assert list(rows) == ["bf16", "int8", "fp8"]
    assert rows["fp8"]["vs_fp32"]["agreement"] >= rows["bf16"]["vs_fp32"]["agreement"] - 0.05
    assert rows["fp8"]["vs_bf16"]["cosine_mean"] > 0.99


def test_handoff_times_each_transport(tmp_path):
    out = tmp_path / "handoff.json"
    tool("bench.handoff", "--iters", "5", "--warmup", "2", "--out", str(out))
    rows = json.loads(out.read_text())["results"]
    assert [(r["transport"], r["ready"]) for r in rows] == [
        ("CUDA_IPC", "sync"),
        ("CUDA_IPC", "event"),
        ("SHM", "sync"),
        ("INLINE", "sync"),
    ]


@pytest.mark.timeout(900)
def test_the_bench_gives_back_the_in_process_targets_memory_before_the_mesh_starts(tmp_path):
    """The in-process engine sizes its KV pool from --gpu-memory-utilization (0.6 of the device): left
    in this process, the mesh started after it would refuse best-effort work for memory."""
    out = tmp_path / "bench"
    result = tool(
        *("services.cli", "bench", "--model", DEMO, "--device", "cuda", "--target", "inprocess,hf-static,mesh"),
        *("--workload", "W1", "--rates", "2", "--duration", "3", "--warmup", "0.5", "--qos-mix", "0,0,1"),
        *("--out", str(out)),
    )
    held = [float(x) for x in re.findall(r"GPU memory released: this process holds (\d+\.\d+) GiB", result.stderr)]
    assert len(held) == 3 and max(held) < 1.0, result.stderr[-3000:]
    runs = {r["target"]: r["summary"] for r in json.loads((out / "results.json").read_text())["runs"]}
    for target, s in runs.items():
        assert s["statuses"] == {"OK": s["sent"]} and s["sent"] > 0, (target, s["statuses"])


def test_a_memory_refusal_on_the_gpu_says_how_much_this_process_holds():
    import os

    import torch

    from services.common.errors import ResourceExhausted
    from services.common.memory import MemoryGuard, Watermarks
    from services.common.qos import QosLevel

    device = torch.device("cuda")
    block = torch.empty(2**28, dtype=torch.uint8, device=device)  # 256 MiB held through PyTorch
    guard = MemoryGuard.for_device("llm", device, Watermarks(1e-6, 1e-6, 1e-6))  # any use is over the marks
    with pytest.raises(ResourceExhausted) as err:
        guard.admit(QosLevel.BEST_EFFORT)
    held = float(re.search(r"holds (\d+\.\d+) GiB through PyTorch", err.value.message).group(1))
    assert f"this process (llm, pid {os.getpid()})" in err.value.message
    assert held == pytest.approx(torch.cuda.memory_reserved(device) / 2**30, abs=0.01) and held >= 0.25
    del block
