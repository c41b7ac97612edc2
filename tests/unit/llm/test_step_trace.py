"""--step-trace (services/llm/step_trace.py) and its summary, `python -m bench.step_trace`."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import PROMPTS, Parts


def test_step_trace_records_every_step(tiny_model, tmp_path):
    """--step-trace: a line per step, whose prompt rows and decodes account for every token made."""
    from services.llm.config import NativeEngineConfig

    trace = tmp_path / "steps.jsonl"
    p = Parts(tiny_model, max_batch=3, native=NativeEngineConfig(step_trace=str(trace), max_prefill_tokens=64))
    try:
        pairs = [p.request(i, prompt, max_tokens=6, min_tokens=6) for i, prompt in enumerate(PROMPTS[:3])]
        p.run(*pairs)
    finally:
        p.engine.stop()  # flushes the trace
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    prompt_len = sum(req.prompt_len for req, _ in pairs)
    assert sum(r["prompt_rows"] for r in rows) == prompt_len  # chunks of 64 rows: several steps each
    assert max(r["prompt_rows"] for r in rows) <= 64
    # Each request's first token comes from its last chunk, the other five from decode rows.
    assert sum(r["decodes"] for r in rows) == 3 * 5
    assert all(r["run_ms"] > 0 and r["gap_ms"] >= 0 and r["post_ms"] >= 0 for r in rows)
    packed = tmp_path / "steps.jsonl.gz"
    packed.write_bytes(gzip.compress(trace.read_bytes()))
    summary = summed_up(packed)
    assert summary.startswith(f"{len(rows)} steps; 1 segments")
    assert "one prompt + riding, by decodes:" in summary
    assert "split p50" not in summary  # the CPU times no device span
    # A CUDA trace's rows carry the split: --detail gives its p50 per kind of step.
    cuda = tmp_path / "cuda.jsonl"
    split = {"decode": (0.1, 5.0, 0.2), "prompt": (0.9, 16.0, 0.3)}
    lines = []
    for i in range(20):
        kind = "prompt" if i % 4 == 0 else "decode"
        stage, device, wake = split[kind]
        row = {"t": i * 0.01, "gap_ms": 0.1, "run_ms": stage + device + wake, "post_ms": 0.1, "decodes": 2}
        row |= {"prompts": int(kind == "prompt"), "prompt_rows": 600 * (kind == "prompt")}
        lines.append(json.dumps(row | {"stage_ms": stage, "device_ms": device, "wake_ms": wake}))
    cuda.write_text("\n".join(lines) + "\n")
    summary = summed_up(cuda)
    assert "decode-only steps, split p50: stage 0.10, device 5.00, wake 0.20 (n 15)" in summary
    assert "prompt steps, split p50: stage 0.90, device 16.00, wake 0.30 (n 5)" in summary


def summed_up(trace: Path) -> str:
    """What `python -m bench.step_trace TRACE --detail` prints (as its users run it)."""
    args = [sys.executable, "-m", "bench.step_trace", str(trace), "--min-steps", "1", "--detail"]
    done = subprocess.run(args, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout
