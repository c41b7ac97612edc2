"""Summaries, the printed table, the JSON file and the plots of a benchmark run."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

from services.bench.load import Record
from services.bench.stats import summarize
from services.bench.targets import STAGES
from services.common.qos import QosLevel

# The write-ups' headline table (their hardware: 2x A10), for --compare-seeds: each row is one
# P99 at one throughput, so ours is the throughput at which our P99 stays within theirs.
SEEDS = {
    "W1": {"p99_ms": 387.0, "rps": 24.1, "what": "224x224, 32 text tokens"},
    "W2": {"p99_ms": 412.0, "rps": 18.9, "what": "384x384, 128 text tokens"},
}
# Below this many samples a P99 is little more than the slowest of them: the QoS table marks it.
FEW_SAMPLES = 20


def cell(value: float | None, spec: str = ".1f") -> str:
    """A figure for a table, or - where there was no sample to give one (None)."""
    return "-" if value is None else format(value, spec)


def p99_cell(summary: dict) -> str:
    """A summary's P99, marked * when it rests on fewer than FEW_SAMPLES samples."""
    return cell(summary["p99"]) + ("*" if 0 < summary["n"] < FEW_SAMPLES else "")


def summarize_run(records: list[Record], rate: float, duration_s: float, warmup_s: float, client: dict) -> dict:
    """Latency over requests scheduled after the warm-up; statuses over every request sent."""
    measured = [r for r in records if r.scheduled_s >= warmup_s]
    ok = [r.outcome for r in measured if r.outcome.status == "OK"]
    window = max(duration_s - warmup_s, 1e-9)
    statuses = Counter(r.outcome.status for r in records)
    lag = [max(0.0, r.sent_s - r.scheduled_s) * 1000 for r in records]
    return {
        "offered_rps": rate,
        "sent": len(records),
        "statuses": dict(statuses),
        "lost": len(records) - sum(statuses.values()),
        "measured": len(measured),
        "throughput_rps": len(ok) / window,
        "output_tok_s": sum(o.output_tokens for o in ok) / window,
        "e2e_ms": summarize([o.e2e_s * 1000 for o in ok]),
        "ttft_ms": summarize([o.ttft_s * 1000 for o in ok if o.ttft_s is not None]),
        "tpot_ms": summarize([o.tpot_s * 1000 for o in ok if o.tpot_s is not None]),
        "stages_ms_p50": {s: summarize([o.stages_ms.get(s, 0.0) for o in ok])["p50"] for s in STAGES},
        # Time outside every stage (RPCs, serialisation, relaying, thread wake-ups): what the
        # mesh's plumbing costs a request, comparable with --target inprocess.
        "outside_stages_ms": summarize([o.e2e_s * 1000 - sum(o.stages_ms.values()) for o in ok if o.stages_ms]),
        "client": {**client, "send_lag_ms": summarize(lag)},
        "cache": {**cache_summary(ok), "repeat_ratio": repeat_ratio(records, warmup_s)},
        "by_qos": qos_summary(records, warmup_s),
    }


def qos_summary(records: list[Record], warmup_s: float) -> dict:
    """Per QoS class: the statuses of every request sent, e2e and TTFT of the measured OK ones.
    The run's P99 is mostly the slowest class's; this says which class that was."""
    out = {}
    for level in QosLevel:
        recs = [r for r in records if r.request.qos == level]
        if not recs:
            continue
        ok = [r.outcome for r in recs if r.scheduled_s >= warmup_s and r.outcome.status == "OK"]
        out[level.wire] = {
            "sent": len(recs),
            "statuses": dict(Counter(r.outcome.status for r in recs)),
            "e2e_ms": summarize([o.e2e_s * 1000 for o in ok]),
            "ttft_ms": summarize([o.ttft_s * 1000 for o in ok if o.ttft_s is not None]),
        }
    return out


def qos_table(runs: list[dict]) -> str:
    """One line per run and QoS class, for runs that sent more than one class; else ''.

    A class's P99 over fewer than FEW_SAMPLES requests is marked *, with a note under the table."""
    lines = [
        f"{'target':<10}{'wl':<4}{'load':>6}  {'qos':<12}{'sent':>6}{'e2e p50':>9}{'p99':>9}{'ttft p99':>10}  statuses"
    ]
    few = False
    for r in runs:
        by_qos = r["summary"].get("by_qos", {})
        if len(by_qos) < 2:
            continue
        for wire, c in by_qos.items():
            e, t = c["e2e_ms"], c["ttft_ms"]
            few |= any(0 < x["n"] < FEW_SAMPLES for x in (e, t))
            statuses = ",".join(f"{k}={v}" for k, v in sorted(c["statuses"].items()))
            lines.append(
                f"{r['target']:<10}{r['workload']:<4}{_load(r['summary']):>6}  {wire:<12}{c['sent']:6d}"
                f"{cell(e['p50']):>9}{p99_cell(e):>9}{p99_cell(t):>10}  {statuses}"
            )
    if len(lines) == 1:
        return ""
    lines.append("per QoS class: latencies in ms over the measured OK requests, statuses over every request sent")
    if few:
        lines.append(
            f"* a P99 over fewer than {FEW_SAMPLES} requests: little more than the slowest of them, not a percentile"
        )
    return "\n".join(lines)


def repeat_ratio(records: list[Record], warmup_s: float) -> float:
    """Share of the measured requests whose image an earlier request (warm-up included) sent:
    the hit ratio an unbounded feature cache would reach on this very sequence."""
    seen: set[int] = set()
    repeats = measured = 0
    for r in sorted(records, key=lambda r: r.scheduled_s):
        key = r.request.image_key
        if r.scheduled_s >= warmup_s:
            measured += 1
            repeats += key in seen
        seen.add(key)
    return repeats / measured if measured else 0.0


def cache_summary(ok: list) -> dict:
    """Feature-cache hits (the vision ran no stage) and prefix-cache hits, and TTFT for each side."""
    hits = [o for o in ok if o.feature_hit]
    misses = [o for o in ok if o.feature_hit is False]
    return {
        "feature_hit_ratio": len(hits) / len(ok) if ok else 0.0,
        "prefix_hit_ratio": sum(1 for o in ok if o.cached_tokens) / len(ok) if ok else 0.0,
        "cached_tokens_p50": summarize([o.cached_tokens for o in ok])["p50"],
        "ttft_ms_hit": summarize([o.ttft_s * 1000 for o in hits if o.ttft_s is not None]),
        "ttft_ms_miss": summarize([o.ttft_s * 1000 for o in misses if o.ttft_s is not None]),
    }


def cache_table(runs: list[dict]) -> str:
    """One line per run that saw cache hits: hit ratios and TTFT p50 of hits against misses."""
    lines = [
        f"{'target':<10}{'wl':<4}{'load':>6}{'feat hit':>9}{'at most':>8}{'kv hit':>8}{'cached p50':>11}"
        f"{'ttft hit':>10}{'miss':>8}{'ratio':>7}"
    ]
    for r in runs:
        c = r["summary"].get("cache")
        if not c or not (c["feature_hit_ratio"] or c["prefix_hit_ratio"]):
            continue
        hit, miss = c["ttft_ms_hit"], c["ttft_ms_miss"]
        ratio = hit["p50"] / miss["p50"] if hit["n"] and miss["n"] and miss["p50"] else None
        lines.append(
            f"{r['target']:<10}{r['workload']:<4}{_load(r['summary']):>6}{c['feature_hit_ratio']:9.1%}"
            f"{cell(c.get('repeat_ratio'), '.1%'):>8}{c['prefix_hit_ratio']:8.1%}"
            f"{cell(c['cached_tokens_p50'], '.0f'):>11}{cell(hit['p50']):>10}{cell(miss['p50']):>8}"
            f"{cell(ratio, '.2f'):>7}"
        )
    if len(lines) == 1:
        return ""
    lines.append(
        "feat hit: requests that ran no vision stage (features from the vision's cache, or none needed: the "
        "llm held the image's KV, services/gateway/image_keys.py); at most: requests whose image an "
        "earlier request sent (an unbounded cache's ratio on this sequence); kv hit: requests whose prompt "
        "began with cached KV pages; ttft p50 in ms of feature hits and misses, and their ratio"
    )
    return "\n".join(lines)


def cpu_table(runs: list[dict]) -> str:
    """One line per run of the servers' CPU use by service, in cores: a process near one core is
    held by its own host work (Python under one GIL), whatever its GPU could do."""
    names = sorted({name for r in runs for name in r["summary"].get("service_cpu_cores", {})})
    if not names:
        return ""
    lines = [f"{'target':<10}{'wl':<4}{'load':>6}" + "".join(f"{n[:9]:>10}" for n in names)]
    for r in runs:
        cores = r["summary"].get("service_cpu_cores")
        if cores:
            lines.append(
                f"{r['target']:<10}{r['workload']:<4}{_load(r['summary']):>6}"
                + "".join(f"{cell(cores.get(n), '.2f'):>10}" for n in names)
            )
    lines.append("CPU use in cores by server process (its children included) over each run")
    return "\n".join(lines)


def _load(summary: dict) -> str:
    return f"x{summary['concurrency']}" if "concurrency" in summary else f"{summary['offered_rps']:g}"


def table(runs: list[dict]) -> str:
    head = (
        f"{'target':<10}{'wl':<4}{'load':>6}{'req/s':>7}{'tok/s':>8}{'e2e p50':>9}{'p90':>8}{'p99':>8}"
        f"{'ttft p50':>9}{'p99':>8}{'tpot p50':>9}{'p99':>7}  "
        + " ".join(f"{s[:7]:>7}" for s in STAGES)
        + f"{'outside':>8}{'lag99':>7}{'cpu':>6}  statuses"
    )
    lines = [head]
    for r in runs:
        s = r["summary"]
        e, t, p = s["e2e_ms"], s["ttft_ms"], s["tpot_ms"]
        stages = " ".join(f"{cell(s['stages_ms_p50'][k]):>7}" for k in STAGES)
        stages += f"{cell(s.get('outside_stages_ms', {}).get('p50')):>8}"
        statuses = ",".join(f"{k}={v}" for k, v in sorted(s["statuses"].items()))
        load = _load(s)
        cpu = f"{cell(s.get('server_cpu_cores'), '.2f'):>6}"
        lines.append(
            f"{r['target']:<10}{r['workload']:<4}{load:>6}{s['throughput_rps']:7.1f}{s['output_tok_s']:8.0f}"
            f"{cell(e['p50']):>9}{cell(e['p90']):>8}{cell(e['p99']):>8}{cell(t['p50']):>9}{cell(t['p99']):>8}"
            f"{cell(p['p50'], '.2f'):>9}{cell(p['p99'], '.2f'):>7}"
            f"  {stages}{cell(s['client']['send_lag_ms']['p99']):>7}{cpu}  {statuses}"
        )
    lines.append(
        "latencies in ms; stages are p50 ms of queue, preprocess, vision, hand-off, prefill, decode; "
        "outside is the p50 of e2e minus those stages (RPCs, relaying, wake-ups); "
        "lag99 is the client's own p99 delay in sending (its overhead); cpu is the servers' CPU use in cores; "
        "load is the offered req/s, or xN for a closed loop of N"
    )
    return "\n".join(lines)


def compare_seeds(runs: list[dict]) -> str:
    """The write-ups' headline P99 and throughput beside ours, like with like: for each target that
    ran their workload, its highest throughput whose e2e P99 is within their P99 (n/a: no run was)."""
    lines = [
        "write-ups (OTHER HARDWARE: 2x A10) vs this run (this machine):",
        f"{'workload':<30}{'theirs p99':>12}{'theirs req/s':>14}   {'ours (target)':<16}{'p99':>9}{'req/s':>8}",
    ]
    for wl, seed in SEEDS.items():
        ran = [r for r in runs if r["workload"] == wl]
        for target in sorted({r["target"] for r in ran}) or ["-"]:
            p99s = [(r, r["summary"]["e2e_ms"]["p99"]) for r in ran if r["target"] == target]
            within = [r for r, p99 in p99s if p99 is not None and p99 <= seed["p99_ms"]]
            best = max(within, key=lambda r: r["summary"]["throughput_rps"], default=None)
            mine = (
                f"{best['summary']['e2e_ms']['p99']:9.1f}{best['summary']['throughput_rps']:8.1f}"
                if best
                else f"{'n/a':>9}{'n/a':>8}"
            )
            lines.append(f"{wl + ' ' + seed['what']:<30}{seed['p99_ms']:12.0f}{seed['rps']:14.1f}   {target:<16}{mine}")
    lines.append("ours: the highest throughput whose e2e p99 is within theirs (their p99 is at their throughput)")
    return "\n".join(lines)


def write_json(path: Path, config: dict, env: dict, runs: list[dict], records: dict[str, list[Record]]) -> None:
    raw = {
        key: [
            {
                "i": r.request.index,
                "qos": r.request.qos.wire,
                "image_key": r.request.image_key,
                "scheduled_s": r.scheduled_s,
                "sent_s": r.sent_s,
                "status": r.outcome.status,
                "e2e_ms": r.outcome.e2e_s * 1000,
                "ttft_ms": None if r.outcome.ttft_s is None else r.outcome.ttft_s * 1000,
                "tokens": r.outcome.output_tokens,
                "stages_ms": r.outcome.stages_ms,
                "cached_tokens": r.outcome.cached_tokens,
                "feature_hit": r.outcome.feature_hit,
            }
            for r in recs
        ]
        for key, recs in records.items()
    }
    # Strict JSON: a figure without a sample is null (stats.summarize), never NaN. Written whole
    # and then renamed, so a reader (or a bench stopped midway) never sees half a file.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"config": config, "env": env, "runs": runs, "requests": raw}, indent=1, allow_nan=False))
    tmp.replace(path)


def plot(out_dir: Path, runs: list[dict], records: dict[str, list[Record]], warmup_s: float) -> list[Path]:
    """latency-vs-throughput.png and latency-cdf.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def save(fig, ax, name: str, title: str, xlabel: str, ylabel: str) -> Path:
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=120)
        plt.close(fig)
        return out_dir / name

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(r["target"], r["workload"]) for r in runs}):
        rs = sorted((r for r in runs if (r["target"], r["workload"]) == key), key=lambda r: r["summary"]["offered_rps"])
        x = [r["summary"]["throughput_rps"] for r in rs]
        for q, style in (("p50", "-o"), ("p99", "--^")):
            y = [r["summary"]["e2e_ms"][q] for r in rs]
            ax.plot(x, [math.nan if v is None else v for v in y], style, label=f"{key[0]} {key[1]} {q}")  # a gap
    ax.set_yscale("log")
    throughput = save(
        fig,
        ax,
        "latency-vs-throughput.png",
        "latency against throughput (open loop, Poisson)",
        "throughput (req/s)",
        "end-to-end latency (ms)",
    )

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, recs in records.items():
        xs = sorted(r.outcome.e2e_s * 1000 for r in recs if r.outcome.status == "OK" and r.scheduled_s >= warmup_s)
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=key)
    ax.set_xscale("log")
    cdf = save(fig, ax, "latency-cdf.png", "latency CDF per run", "end-to-end latency (ms)", "fraction of requests")
    return [throughput, cdf]
