"""Every documented bench tool that runs on a CPU, run as its users run it, on tiny arguments: a change
to the engine or the mesh that breaks one fails here. The GPU-only tools run in
tests/gpu/test_bench_tools_gpu.py. Run elsewhere already: bench.overload (test_overload.py),
bench.soak (tests/e2e/test_soak.py), bench.schedule_sim and bench.step_trace (unit tests), and
`vlmesh bench` against a running mesh (test_bench_mesh.py, test_bench_peer.py, test_http_api.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from services.launcher import free_port
from tests.helpers import ROOT

DEMO = str(ROOT / "models" / "demo")


def tool(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m ARGS` from the repository root; it must exit 0."""
    result = subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=280, cwd=ROOT, env=env
    )
    assert result.returncode == 0, f"{' '.join(args)}:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


def strict(text: str) -> dict:
    def refuse(constant: str):
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_decode_step_runs_the_engines_own_steps_on_the_cpu(tmp_path):
    out = tmp_path / "decode_step.json"
    result = tool(
        *("bench.decode_step", "--model", DEMO, "--device", "cpu", "--dtype", "float32", "--batches", "1,2"),
        *("--context", "40", "--steps", "2", "--prefill", "24", "--mixed", "2", "--copy-mib", "4", "--out", str(out)),
    )
    data = strict(out.read_text())
    assert [r["batch"] for r in data["results"]] == [1, 2]
    assert all(r["wall_s"] > 0 and r["floor_s"] > 0 and r["device_s"] is None for r in data["results"])
    assert [(p["mode"], p["prompts"], p["decodes"]) for p in data["prefill"]] == [
        ("chunks", 1, 0),
        ("chunks", 3, 0),
        ("chunks", 1, 2),
    ]
    assert "| 2 | 2 | 0.00 |" in result.stdout  # batch 2's row of the decode table


def test_quant_agreement_compares_each_kind_with_fp32_and_bf16(tmp_path):
    out = tmp_path / "agreement.json"
    result = tool(
        *("bench.quant_agreement", "--model", DEMO, "--device", "cpu", "--kinds", "int8,fp8", "--emulate-fp8"),
        *("--sequences", "2", "--tokens", "24", "--out", str(out)),
    )
    figures = strict(out.read_text())
    rows = figures["kinds"]
    assert list(rows) == ["bf16", "int8", "fp8"] and figures["fp8_emulated"] is True
    assert "vs_bf16" in rows["int8"] and "vs_bf16" not in rows["bf16"]
    assert all(0.9 <= rows[k]["vs_fp32"]["agreement"] <= 1 for k in ("bf16", "int8"))
    assert 0.8 <= rows["fp8"]["vs_fp32"]["agreement"] <= 1  # 3 mantissa bits, activations quantized too
    assert all(r["vs_fp32"]["cosine_min"] > 0.99 for r in rows.values())
    assert re.search(r"^int8 +\d+\.\d\d%", result.stdout, re.M) and re.search(r"^fp8 +\d+\.\d\d%", result.stdout, re.M)
    refused = subprocess.run(
        [sys.executable, "-m", "bench.quant_agreement", "--model", DEMO, "--device", "cpu", "--kinds", "fp8"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert refused.returncode == 2 and "fp8 needs a CUDA GPU" in refused.stderr


def test_soak_with_pictures_of_mixed_sizes_through_qwen(tmp_path, tiny_qwen):
    """bench.soak --mixed: 1 to 3 pictures a request, 224x224 to 1280x720, each taking its own count
    of tokens and its own run of arena pages; nothing lost, every request answered."""
    out = tmp_path / "soak.json"
    tool(
        *("bench.soak", "--model", str(tiny_qwen), "--mixed", "--clients", "2", "--duration", "10"),
        *("--warmup", "3", "--sample-s", "1", "--max-growth", "1", "--out", str(out)),
    )
    soak = strict(out.read_text())
    assert soak["sent"] >= 4 and soak["lost"] == 0 and soak["statuses"] == {"OK": soak["sent"]}, soak["statuses"]


def test_engine_host_times_the_engine_thread_with_the_model_taken_out():
    result = tool("bench.engine_host", "--model", DEMO, "--batch", "4", "--tokens", "8")
    line = re.fullmatch(
        r"engine host time per step at batch 4: (\d+\.\d{3}) ms \(median of \d+; "
        r"medians: gap (\d+\.\d{3}), run (\d+\.\d{3}), post (\d+\.\d{3})\)\n",
        result.stdout,
    )
    assert line, result.stdout
    whole, *parts = map(float, line.groups())
    assert whole > 0 and all(p > 0 for p in parts), parts  # a step plans, stages and postprocesses something


def test_grpc_chain_runs_each_variant_of_the_bare_chain(tmp_path):
    out = tmp_path / "chain.json"
    tool("bench.grpc_chain", "--iters", "3", "--warmup", "1", "--out", str(out))
    rows = strict(out.read_text())["rows"]
    assert {(r["hops"], r["transport"]) for r in rows} == {
        ("one call per hop", "tcp loopback"),
        ("one call per hop", "unix sockets"),
        ("persistent streams", "tcp loopback"),
    }
    assert all(r["iters"] == 3 and r["p99_ms"] >= r["p50_ms"] > 0 for r in rows)


def test_accuracy_asks_each_variant_through_envoy(tmp_path):
    out = tmp_path / "accuracy.json"
    tool("bench.accuracy", "--model", DEMO, "--variants", "full=50,int8=50", "--pictures", "1", "--out", str(out))
    accuracy = strict(out.read_text())["accuracy"]
    assert sorted(accuracy) == ["full", "int8"]
    assert all(0 <= share <= 1 for row in accuracy.values() for share in row.values())


def test_tracing_overhead_measures_a_mesh_with_tracing_off_and_on():
    result = tool("bench.tracing_overhead", "--model", DEMO, "--requests", "2", "--repeats", "1")
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines[1:3]] == ["off", "on"]
    assert lines[-1].startswith("change: latency")


def test_vlmesh_bench_starts_its_mesh_and_runs_the_baselines_and_its_traces_make_a_timeline(tmp_path):
    """docs/BENCH.md's sequence: bench.otlp_sink keeps the spans of a `vlmesh bench` run (the mesh it
    starts, then the in-process engine and transformers), and bench.span_timeline sums them up."""
    port, spans, out = free_port("127.0.0.1"), tmp_path / "spans.jsonl", tmp_path / "bench"
    sink = subprocess.Popen(
        [sys.executable, "-m", "bench.otlp_sink", "--port", str(port), "--out", str(spans)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert sink.stdout.readline().startswith(f"OTLP sink on 127.0.0.1:{port}")  # it is listening
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}
        result = tool(
            *("services.cli", "bench", "--model", DEMO, "--target", "mesh,inprocess,hf", "--workload", "W1"),
            *("--rates", "3", "--duration", "2", "--warmup", "0.5", "--out", str(out), "--compare-seeds"),
            env=env,
        )
    finally:
        sink.terminate()
        sink.wait(30)
    data = strict((out / "results.json").read_text())  # figures without samples are null, not NaN
    runs = {r["target"]: r["summary"] for r in data["runs"]}
    assert sorted(runs) == ["hf", "inprocess", "mesh"]
    for target, s in runs.items():
        assert s["statuses"] == {"OK": s["sent"]} and s["sent"] > 0, target
    assert runs["hf"]["outside_stages_ms"]["p50"] is None  # transformers reports no stages
    assert "within theirs" in result.stdout and "per QoS class" in result.stdout
    timeline = tool("bench.span_timeline", str(spans)).stdout
    assert re.search(r"^llm +llm\.decode ", timeline, re.M), timeline
