"""Sum up an engine step trace (`--step-trace PATH`, services/llm/step_trace.py).

The trace is cut into segments wherever the engine went `--pause` seconds without a step (a
bench's rates run one after another on one mesh); each segment gets one row:

- `steps/s`, and `busy`: the share of the segment's wall time spent inside steps (launch to
  the host sync);
- host time per step, p50 and p99: `gap` (scheduling, before the launch) and `post`
  (postprocess, after the sync): the device idles through both;
- decode-only steps: count, mean batch, step p50; steps with prompt rows: count, prompts and
  rows per step, step p50 and p99;
- on CUDA, each step split in three, p50 over all steps: `stage` (host staging before the step's
  first device work), `device` (the device's span) and `wake` (the rest: the device starting
  the step late, and the engine thread's wake-up after the sync).

With `--detail`, each segment also gets step p50 (and the device's part, on CUDA) by decode
batch, for decode-only steps and for steps of one prompt with decodes riding (what a riding
decode costs a prompt step), and on CUDA the split's p50 for each of the two kinds (the host
staging of a prompt step is several times a decode step's, and the p50 over all steps hides it).

    python -m bench.step_trace PATH[.gz] [--pause 1.0] [--detail]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path

from services.bench.stats import percentile

PARTS = ("stage", "device", "wake")  # a CUDA step's run time, split (services/llm/step_trace.py)


def segments(rows: list[dict], pause_s: float) -> list[list[dict]]:
    out: list[list[dict]] = []
    for row in rows:
        if not out or row["t"] - out[-1][-1]["t"] > pause_s:
            out.append([])
        out[-1].append(row)
    return out


def summary(seg: list[dict]) -> dict[str, float]:
    last = seg[-1]
    wall = last["t"] + (last["run_ms"] + last["post_ms"]) / 1e3 - seg[0]["t"] + seg[0]["gap_ms"] / 1e3
    pure = [r for r in seg if not r["prompts"]]
    mixed = [r for r in seg if r["prompts"]]
    mean = lambda xs: statistics.fmean(xs) if xs else float("nan")  # noqa: E731
    return {
        "wall_s": wall,
        "steps": len(seg),
        "steps_per_s": len(seg) / wall if wall > 0 else float("nan"),
        "busy": sum(r["run_ms"] for r in seg) / 1e3 / wall if wall > 0 else float("nan"),
        "gap_p50": percentile([r["gap_ms"] for r in seg], 50),
        "gap_p99": percentile([r["gap_ms"] for r in seg], 99),
        "post_p50": percentile([r["post_ms"] for r in seg], 50),
        "post_p99": percentile([r["post_ms"] for r in seg], 99),
        "decode_steps": len(pure),
        "decode_batch": mean([r["decodes"] for r in pure]),
        "decode_p50": percentile([r["run_ms"] for r in pure], 50),
        "prompt_steps": len(mixed),
        "prompts_per_step": mean([r["prompts"] for r in mixed]),
        "rows_per_step": mean([r["prompt_rows"] for r in mixed]),
        "riding": mean([r["decodes"] for r in mixed]),
        "prompt_p50": percentile([r["run_ms"] for r in mixed], 50),
        "prompt_p99": percentile([r["run_ms"] for r in mixed], 99),
        **{f"{part}_p50": percentile([r[f"{part}_ms"] for r in seg if f"{part}_ms" in r], 50) for part in PARTS},
    }


COLUMNS = (
    ("wall_s", "wall s", ".1f"),
    ("steps_per_s", "steps/s", ".0f"),
    ("busy", "busy", ".2f"),
    ("gap_p50", "gap p50", ".2f"),
    ("gap_p99", "p99", ".2f"),
    ("post_p50", "post p50", ".2f"),
    ("post_p99", "p99", ".2f"),
    ("decode_steps", "dec steps", "d"),
    ("decode_batch", "batch", ".1f"),
    ("decode_p50", "dec p50", ".2f"),
    ("prompt_steps", "pf steps", "d"),
    ("prompts_per_step", "prompts", ".2f"),
    ("rows_per_step", "rows", ".0f"),
    ("riding", "riding", ".1f"),
    ("prompt_p50", "pf p50", ".2f"),
    ("prompt_p99", "p99", ".2f"),
    ("stage_p50", "stage p50", ".2f"),
    ("device_p50", "device p50", ".2f"),
    ("wake_p50", "wake p50", ".2f"),
)


BANDS = ((1, 4), (5, 8), (9, 12), (13, 16), (17, 24), (25, 32), (33, 10**6))


def detail(seg: list[dict]) -> str:
    """Step p50 (and count) by decode batch: decode-only steps, and one-prompt steps with decodes riding."""
    lines = []
    for title, keep in (
        ("decode-only", lambda r: not r["prompts"]),
        ("one prompt + riding", lambda r: r["prompts"] == 1),
    ):
        cells = []
        for lo, hi in BANDS:
            band = [r for r in seg if keep(r) and lo <= r["decodes"] <= hi]
            if band:
                run = percentile([r["run_ms"] for r in band], 50)
                device = [r["device_ms"] for r in band if "device_ms" in r]
                on_device = f", device {percentile(device, 50):.2f}" if device else ""
                cells.append(f"{lo}-{hi if hi < 10**6 else '':}: {run:.2f}{on_device} (n {len(band)})")
        lines.append(f"  {title}, by decodes: " + ", ".join(cells))
    for title, kind in (
        ("decode-only", [r for r in seg if not r["prompts"]]),
        ("prompt", [r for r in seg if r["prompts"]]),
    ):
        timed = [r for r in kind if "device_ms" in r]
        if timed:
            split = ", ".join(f"{part} {percentile([r[f'{part}_ms'] for r in timed], 50):.2f}" for part in PARTS)
            lines.append(f"  {title} steps, split p50: {split} (n {len(timed)})")
    return "\n".join(lines)


def table(summaries: list[dict[str, float]]) -> str:
    lines = ["  ".join(f"{title:>9}" for _, title, _ in COLUMNS)]
    for s in summaries:
        lines.append("  ".join(f"{format(s[key], fmt):>9}" for key, _, fmt in COLUMNS))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_trace", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="the engine's --step-trace file")
    parser.add_argument("--pause", type=float, default=1.0, help="seconds without a step that end a segment")
    parser.add_argument("--detail", action="store_true", help="step p50 by decode batch, per segment")
    parser.add_argument("--min-steps", type=int, default=50, help="leave out shorter segments (warm-ups)")
    args = parser.parse_args(argv)
    opener = gzip.open if args.path.suffix == ".gz" else open
    with opener(args.path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        parser.error(f"{args.path}: no steps recorded")
    segs = [s for s in segments(rows, args.pause) if len(s) >= args.min_steps]
    print(f"{len(rows)} steps; {len(segs)} segments of >= {args.min_steps} steps (ms unless named)")
    print(table([summary(s) for s in segs]))
    if args.detail:
        for i, seg in enumerate(segs, 1):
            print(f"segment {i}:\n{detail(seg)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
