"""Overload: does realtime keep its latency when 3x the mesh's capacity arrives?

Three phases against one mesh (W1 requests, 16 forced output tokens, open loop):
1. capacity: a closed loop of 2 x --max-llm-batch standard requests for --capacity-s seconds;
   capacity = answered per second;
2. unloaded: realtime requests alone for --unloaded-s seconds, Poisson at the rate they have
   in the overload (20% of it: the mesh carries realtime's own load and nothing else), and
   for --idle-s seconds at 1 req/s (the mesh idle between requests; 0 leaves it out);
3. overload: Poisson at --factor x capacity for --duration seconds, QoS mix 20/60/20.

It prints, per class, what was sent, answered (and of those, degraded), refused
(RESOURCE_EXHAUSTED) and anything else, and the answered requests' latency, then realtime's
P99 against its unloaded P99s.

With `--cheaper int8` (or int4) a cheaper variant of the same checkpoint runs beside it, with
the same admission flags, and the mesh's gateway degrades to it (`--degrade-target`,
services/gateway/degrade.py): best-effort work the mesh would refuse for its queue is served
there, its answers marked `x-vlmesh-degraded`, before anything is refused. Deployed, each
variant has its own hardware; here they share the host's cores, and the cheaper variant's
processes run at the lowest CPU priority (nice 19), so that its work takes the cores the mesh
leaves idle rather than its realtime requests' time.
Every request ends with a result or a status: sent == answered + refused + other, with
nothing lost, by construction of the load generator.

    python -m bench.overload --model models/demo [--duration 30] [--factor 3] [--cheaper int8] [--out overload.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path

from services.bench.load import run_open_loop
from services.bench.stats import percentile
from services.bench.targets import MeshTarget
from services.bench.workloads import WORKLOADS, RequestFactory
from services.common import eventloop
from services.common.qos import QosLevel
from services.launcher import Mesh, MeshOptions
from services.llm import config as llm_config

MIX = (0.2, 0.6, 0.2)  # realtime, standard, best-effort


async def measure_capacity(target: MeshTarget, factory: RequestFactory, concurrency: int, seconds: float) -> float:
    """Answered requests per second with `concurrency` standard requests always in flight."""
    done, stop = 0, time.perf_counter() + seconds
    counter = iter(range(10**9))

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            req = factory.make(next(counter))
            if (await target.send(req)).status == "OK":
                done += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - start)


def lowest_priority(pid: int) -> None:
    """Nice 19 for every thread of a process and of its children (Linux; raising it needs no
    privilege). Threads they start later inherit it."""
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, int(task.name), 19)
            for child in (task / "children").read_text().split():
                lowest_priority(int(child))


def by_class(records) -> dict[str, dict]:
    out = {}
    for level in QosLevel:
        recs = [r for r in records if r.request.qos is level]
        ok = [r.outcome.e2e_s * 1000 for r in recs if r.outcome.status == "OK"]
        degraded = sum(r.outcome.status == "OK" and bool(r.outcome.degraded) for r in recs)
        refused = sum(r.outcome.status == "RESOURCE_EXHAUSTED" for r in recs)
        refusal_ms = [r.outcome.e2e_s * 1000 for r in recs if r.outcome.status == "RESOURCE_EXHAUSTED"]
        other: dict[str, int] = {}
        for r in recs:
            if r.outcome.status not in ("OK", "RESOURCE_EXHAUSTED"):
                other[r.outcome.status] = other.get(r.outcome.status, 0) + 1
        stages = [r.outcome.stages_ms for r in recs if r.outcome.status == "OK"]
        out[level.wire] = {
            "stages_ms_p50": {k: percentile([s[k] for s in stages], 50) for k in stages[0]} if stages else {},
            "sent": len(recs),
            "answered": len(ok),
            "degraded": degraded,
            "refused": refused,
            "other": other,
            "e2e_ms_p50": percentile(ok, 50) if ok else None,
            "e2e_ms_p99": percentile(ok, 99) if ok else None,
            "refusal_ms_p99": percentile(refusal_ms, 99) if refusal_ms else None,
        }
    return out


async def run(args) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)

    def options(**more) -> MeshOptions:
        return MeshOptions.from_flags(
            args.admission,  # gateway admission flags, e.g. --max-in-flight realtime=16
            model=args.model,
            gateway_port=0,
            vision_port=0,
            llm_port=0,
            metrics_ports=(-1, -1, -1),
            device="cpu",
            threads=args.threads,
            max_llm_batch=args.max_llm_batch,
            warmup_requests=4,
            log_level="warning",
            **more,
        )

    def progress(name: str):
        return lambda m: print(f"overload: {name}{m}", file=sys.stderr, flush=True)

    cheaper = Mesh(options(quantize=args.cheaper)) if args.cheaper else None
    if cheaper is not None:
        cheaper.start(progress=progress(f"{args.cheaper}: "))
        # Deployed, each variant has its own hardware; on this host they share the cores, and
        # the cheaper one yields them: its processes run at the lowest CPU priority.
        for child in cheaper.children:
            lowest_priority(child.proc.pid)
    mesh = Mesh(options(degrade_target=cheaper.target("gateway")) if cheaper else options())
    try:
        mesh.start(progress=progress(""))
    except BaseException:
        if cheaper is not None:
            cheaper.stop()
        raise
    target = MeshTarget(mesh.target("gateway"))
    try:
        standard = RequestFactory(WORKLOADS["W1"], tokenizer, args.seed, (0.0, 1.0, 0.0))
        capacity = args.capacity or await measure_capacity(target, standard, 2 * args.max_llm_batch, args.capacity_s)
        print(f"overload: capacity {capacity:.1f} req/s", file=sys.stderr, flush=True)
        rate = args.factor * capacity
        realtime = RequestFactory(WORKLOADS["W1"], tokenizer, args.seed + 1, (1.0, 0.0, 0.0))
        alone = {}
        for name, rt_rate, seconds in (("idle", 1.0, args.idle_s), ("alone", MIX[0] * rate, args.unloaded_s)):
            if seconds > 0:
                label = f"realtime {name}"
                alone[name], _ = await run_open_loop(target, realtime, rt_rate, seconds, args.seed, label)
        mixed = RequestFactory(WORKLOADS["W1"], tokenizer, args.seed + 2, MIX)
        loaded, client = await run_open_loop(target, mixed, rate, args.duration, args.seed, "overload")
    finally:
        await target.close()
        mesh.stop()
        if cheaper is not None:
            cheaper.stop()
    unloaded = {}
    for name, records in alone.items():
        ok = [r.outcome.e2e_s * 1000 for r in records if r.outcome.status == "OK"]
        unloaded[name] = {
            "rate_rps": 1.0 if name == "idle" else MIX[0] * rate,
            "sent": len(records),
            "answered": len(ok),
            "e2e_ms_p50": percentile(ok, 50),
            "e2e_ms_p99": percentile(ok, 99),
        }
    return {
        "capacity_rps": capacity,
        "offered_rps": rate,
        "duration_s": args.duration,
        "unloaded": unloaded,
        "overload": by_class(loaded),
        "client": client,
        "admission": args.admission,
        "cheaper": args.cheaper,
    }


def report(result: dict) -> str:
    lines = [
        f"capacity {result['capacity_rps']:.1f} req/s; offered {result['offered_rps']:.1f} req/s for "
        f"{result['duration_s']:g} s"
    ]
    for name, u in result["unloaded"].items():
        lines.append(
            f"realtime alone ({name}, {u['rate_rps']:.1f} req/s): p50 {u['e2e_ms_p50']:.0f} ms, p99 "
            f"{u['e2e_ms_p99']:.0f} ms ({u['answered']}/{u['sent']} answered)"
        )
    lines += [
        f"{'class':<12}{'sent':>6}{'answered':>10}{'degraded':>10}{'refused':>9}{'other':>8}{'e2e p50':>9}"
        f"{'e2e p99':>9}{'refusal p99':>13}",
    ]
    fmt = lambda v: f"{v:.0f}" if v is not None else "-"  # noqa: E731
    for level, c in result["overload"].items():
        lines.append(
            f"{level:<12}{c['sent']:>6}{c['answered']:>10}{c['degraded']:>10}{c['refused']:>9}"
            f"{sum(c['other'].values()):>8}"
            f"{fmt(c['e2e_ms_p50']):>9}{fmt(c['e2e_ms_p99']):>9}{fmt(c['refusal_ms_p99']):>13}"
        )
    rt = result["overload"]["realtime"]["e2e_ms_p99"]
    for name, u in result["unloaded"].items():
        if rt is not None:
            lines.append(f"realtime p99 under overload / alone ({name}) = {rt / u['e2e_ms_p99']:.2f}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/demo")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of overload (default %(default)s)")
    p.add_argument("--factor", type=float, default=3.0, help="offered load / capacity (default %(default)s)")
    p.add_argument("--capacity", type=float, default=None, help="req/s; measured when not given")
    p.add_argument("--capacity-s", type=float, default=10.0, help="closed-loop seconds to measure it")
    p.add_argument(
        "--unloaded-s",
        type=float,
        default=25.0,
        help="seconds of realtime alone at its overload rate (default %(default)s)",
    )
    p.add_argument(
        "--idle-s", type=float, default=25.0, help="seconds of realtime alone at 1 req/s; 0: none (default %(default)s)"
    )
    p.add_argument("--max-llm-batch", type=int, default=llm_config.DEFAULT_MAX_BATCH)
    p.add_argument("--threads", type=int, default=1, help="torch threads per service (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cheaper",
        choices=("int8", "int4"),
        default=None,
        help="run a cheaper variant beside the mesh, which degrades best-effort work to it (default: none)",
    )
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    p.add_argument("admission", nargs="*", help="gateway admission flags after --, e.g. -- --max-in-flight realtime=16")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = eventloop.run(run(args))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
