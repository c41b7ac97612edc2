"""Where a request's time goes between the services: the median timeline of its spans.

Reads the JSON lines `python -m bench.otlp_sink --out FILE` wrote while the mesh served
traced requests, keeps the traces that reached the llm's decode, and prints for each
(service, span) the median start and end relative to the trace's first span, and the
median duration. The gaps between one span's end and the next one's start are the time
outside any stage: RPC hops, serialisation, thread wake-ups.

    python -m bench.otlp_sink --port 4399 --out /tmp/spans.jsonl &
    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4399 vlmesh bench --model models/demo --target mesh \\
        --workload W1 --rates 2 --duration 30
    python -m bench.span_timeline /tmp/spans.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict


def timeline(rows: list[dict], complete: str = "llm.decode") -> dict[tuple[str, str], list[tuple[float, float]]]:
    """(service, span) -> [(start_ms, end_ms) relative to the trace's first span] over complete traces."""
    traces: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        traces[row["trace_id"]].append(row)
    out: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for spans in traces.values():
        if not any(s["name"] == complete for s in spans):
            continue
        t0 = min(s["start_ns"] for s in spans)
        seen = set()
        for s in spans:
            key = (s["service"].removeprefix("vlmesh-"), s["name"])
            if key in seen:  # one per trace (a batch span is shared by several traces)
                continue
            seen.add(key)
            out[key].append(((s["start_ns"] - t0) / 1e6, (s["end_ns"] - t0) / 1e6))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spans", help="JSON lines from bench.otlp_sink --out")
    args = p.parse_args()
    with open(args.spans) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    spans = timeline(rows)
    if not spans:
        print("no complete traces in the file", file=sys.stderr)
        return 1
    n = max(len(v) for v in spans.values())
    print(f"median timeline of {n} traces (ms from each trace's first span)")
    print(f"{'service':<9}{'span':<32}{'start':>9}{'end':>9}{'duration':>10}{'n':>6}")
    med = statistics.median
    for (service, name), v in sorted(spans.items(), key=lambda kv: med(x[0] for x in kv[1])):
        start, end = med(x[0] for x in v), med(x[1] for x in v)
        print(f"{service:<9}{name:<32}{start:>9.2f}{end:>9.2f}{med(x[1] - x[0] for x in v):>10.2f}{len(v):>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
