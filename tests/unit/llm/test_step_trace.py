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


def test_step_trace_summary_splits_each_lane_by_what_the_other_lane_was_doing(tmp_path):
    """A --lanes split trace: each lane's steps with the other lane idle and busy."""
    lanes = tmp_path / "lanes.jsonl"
    steps = [("prefill", 0.0, 20.0, 1), ("prefill", 0.11, 28.0, 1)]  # (lane, start s, device ms, prompts)
    steps += [("decode", 0.11 + 0.007 * i, 7.0, 0) for i in range(4)]  # inside the second prefill
    steps += [("decode", 0.30 + 0.005 * i, 5.0, 0) for i in range(5)]  # no prefill running
    lines = []
    for lane, t, ms, prompts in sorted(steps, key=lambda x: x[1]):
        row = {"t": t, "gap_ms": 0.0, "run_ms": ms, "post_ms": 0.0, "decodes": 2, "prompts": prompts}
        timed = {"stage_ms": 0.0, "device_ms": ms, "wake_ms": 0.0}
        lines.append(json.dumps(row | {"prompt_rows": 600 * prompts, "lane": lane} | timed))
    lanes.write_text("\n".join(lines) + "\n")
    out = summed_up(lanes)
    assert (
        "one-prompt prefill steps, p50 with the decode lane decode idle: 20.00 (n 1), decode busy: 28.00 (n 1)" in out
    )
    assert "decode steps, p50 with the prefill lane prefill idle: 5.00 (n 5), prefill busy: 7.00 (n 4)" in out
