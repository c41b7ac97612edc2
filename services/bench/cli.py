"""`vlmesh bench`: drive the mesh (and baselines) with the write-ups' workloads, open loop.

    vlmesh bench --model models/demo --target mesh,inprocess --workload W1,W3 --rates 2,4,8,16 \\
        --duration 20 --warmup 3 --out bench-results/cpu

For every (target, workload, rate) it offers Poisson arrivals for --duration seconds with
the QoS mix, drops the first --warmup seconds from the latency figures, and reports P50,
P90 and P99 of end-to-end latency, time to first token and time per output token, req/s,
output tok/s, the per-stage breakdown and every final status. It writes results.json
(config, environment, every request) and two plots to --out, and prints the table last.

Targets: `mesh` (the three servers; started here on free ports unless --gateway is given),
`inprocess` (the same encoder, batcher and engine in this process: what the mesh costs),
`hf` (transformers' generate, one request at a time: what a user gets without us).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import platform
import subprocess
import sys
from pathlib import Path

from services.bench.load import run_open_loop
from services.bench.report import compare_seeds, plot, summarize_run, table, write_json
from services.bench.workloads import WORKLOADS, RequestFactory

TARGETS = ("mesh", "inprocess", "hf")


def environment(model: str) -> dict:
    import torch

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=5,
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "model": model,
    }


def parse_list(text: str, kind=str) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vlmesh bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        default="models/demo",
        help="checkpoint directory, or preset:llava-7b-shaped for random weights (default %(default)s)",
    )
    p.add_argument("--target", default="mesh", help=f"comma list of {', '.join(TARGETS)} (default %(default)s)")
    p.add_argument("--gateway", default=None, help="HOST:PORT of a running gateway instead of starting a mesh")
    p.add_argument("--workload", default="W1", help=f"comma list of {', '.join(WORKLOADS)} (default %(default)s)")
    p.add_argument("--rates", default="2,4,8,16", help="offered req/s, comma list (default %(default)s)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per rate (default %(default)s)")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds left out of the latencies (default %(default)s)")
    p.add_argument(
        "--qos-mix", default="0.2,0.6,0.2", help="realtime,standard,best-effort shares (default %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="output directory (default bench-results/DATE)")
    p.add_argument("--compare-seeds", action="store_true", help="print the write-ups' table beside ours")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-vision-batch", type=int, default=4)
    p.add_argument("--max-llm-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=0, help="torch threads per service (mesh) or in-process")
    return p


async def run_target(name: str, args, workloads, rates, qos_mix, tokenizer, mesh_target: str | None):
    from services.bench.targets import HfTarget, InprocessTarget, MeshTarget

    if name == "mesh":
        target = MeshTarget(mesh_target)
    elif name == "inprocess":
        target = InprocessTarget(args.model, args.device, args.dtype, args.max_vision_batch, args.max_llm_batch)
    else:
        target = HfTarget(args.model, args.device)
    runs, records = [], {}
    try:
        for wl in workloads:
            factory = RequestFactory(WORKLOADS[wl], tokenizer, args.seed, qos_mix)
            for rate in rates:
                recs, client = await run_open_loop(target, factory, rate, args.duration, args.seed, f"{name} {wl}")
                summary = summarize_run(recs, rate, args.duration, args.warmup, client)
                runs.append(
                    {"target": name, "workload": wl, "prompt_tokens": factory.prompt_tokens, "summary": summary}
                )
                records[f"{name} {wl} {rate:g}/s"] = recs
                s = summary
                print(
                    f"  {name} {wl} {rate:g} req/s: {s['throughput_rps']:.1f} req/s, e2e p50 "
                    f"{s['e2e_ms']['p50']:.1f} ms p99 {s['e2e_ms']['p99']:.1f} ms, statuses {s['statuses']}",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        await target.close()
    return runs, records


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    targets, workloads = parse_list(args.target), parse_list(args.workload)
    rates, qos_mix = parse_list(args.rates, float), tuple(parse_list(args.qos_mix, float))
    bad = [t for t in targets if t not in TARGETS] + [w for w in workloads if w not in WORKLOADS]
    if bad or not rates or any(r <= 0 for r in rates) or len(qos_mix) != 3 or args.warmup >= args.duration:
        print(
            f"vlmesh bench: error: check --target/--workload {bad or ''}, --rates > 0, --qos-mix (3 shares), "
            "and --warmup < --duration",
            file=sys.stderr,
        )
        return 2
    from transformers import AutoTokenizer

    from services.model.presets import resolve_model

    args.model = resolve_model(args.model)  # preset:NAME -> its directory, made once
    if not (Path(args.model) / "config.json").is_file():
        print(f"vlmesh bench: error: --model {args.model}: no config.json", file=sys.stderr)
        return 2

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    out = args.out or Path("bench-results") / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}

    mesh = None
    gateway = args.gateway
    if "mesh" in targets and gateway is None:
        from services.launcher import Mesh, MeshOptions

        mesh = Mesh(
            MeshOptions(
                metrics_ports=(0, 0, 0),
                model=args.model,
                gateway_port=0,
                vision_port=0,
                llm_port=0,
                device=args.device,
                dtype=args.dtype,
                threads=args.threads,
                max_vision_batch=args.max_vision_batch,
                max_llm_batch=args.max_llm_batch,
                warmup_requests=4,
                log_level="warning",
            )
        )
        mesh.start(progress=lambda m: print(f"bench: {m}", file=sys.stderr, flush=True))
        gateway = mesh.target("gateway")
    runs, records = [], {}
    try:
        for name in targets:
            r, rec = asyncio.run(run_target(name, args, workloads, rates, qos_mix, tokenizer, gateway))
            runs += r
            records.update(rec)
    finally:
        if mesh is not None:
            mesh.stop()
    write_json(out / "results.json", config, environment(args.model), runs, records)
    plots = plot(out, runs, records, args.warmup)
    print(f"wrote {out / 'results.json'} and {', '.join(str(p) for p in plots)}", file=sys.stderr)
    if args.compare_seeds:
        print(compare_seeds(runs))
    print(table(runs))
    return 0 if all(r["summary"]["lost"] == 0 for r in runs) else 1
