"""Soak: a QoS mix at a share of the mesh's measured capacity for a long time, and what it leaves.

    python -m bench.soak --model models/demo --duration 1800 --load 0.7 --out soak.json

It starts a mesh, measures its capacity (a closed loop of `--concurrency` for `--probe-s`),
then offers Poisson arrivals at `--load` of that rate (or, with `--clients N`, keeps N requests in
flight, a closed loop that a slower host slows too), as realtime, standard and best-effort
requests (`--mix`), each a fresh picture (or, with `--pool N`, one of N drawn as W3 draws them; or,
with `--mixed`, 1 to 3 fresh pictures of sizes from 224x224 to 1280x720, for models that read a
picture at its own size: their features take arena runs of every length), for `--duration` seconds.
Every `--sample-s` it records each service's memory (RSS, and the private part: RSS minus pages
shared with other processes, such as the feature arenas), open file descriptors and threads, and
the shared-memory segments the services made.

On a GPU (`--device cuda`) each sample also holds each service's GPU memory: its PyTorch
allocator's reserved and allocated bytes, read from its /metrics (`vlmesh_gpu_memory_bytes`),
and the device's memory in use as nvidia-smi reports it. Flags after `--` go to the mesh as
`vlmesh up` takes them:

    python -m bench.soak --model preset:llava-7b-shaped --device cuda --duration 600 -- --max-llm-batch 32

It reports lost requests (sent - answered - refused with a status: must be 0), the statuses,
e2e percentiles per class, and each service's memory growth after `--warmup` (`growth_of`: the
robust trend of each figure over the samples). It
exits 1 when a request was lost, or a service's private memory or reserved GPU memory grew by
more than `--max-growth` (a share: 0.01 is 1%); with `--extend-to S`, growth past it at
`--duration` first keeps the load on until S seconds, and then the samples from `--duration` on
must hold the bound and the whole series after the warm-up twice it (`verdict`).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import shutil
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import psutil
from prometheus_client.parser import text_string_to_metric_families

from services.common import segments
from services.launcher import Mesh, MeshOptions
from services.model.shapes import PROMPTS, encode, render
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc

SEED = 5151  # not the tests', training's or the accuracy bench's
CLASSES = ("realtime", "standard", "best-effort")
MAX_FIT_SAMPLES = 2000  # growth_of's line through at most this many samples (2 million pairs)


def rendered(stream: tuple[int, ...]) -> bytes:
    return encode(render(np.random.default_rng(list(stream))).image, "JPEG", 90)


pooled = functools.lru_cache(maxsize=1024)(rendered)  # a pool's pictures, encoded once


# --mixed: W1's and W2's sizes, a photo's, W4's 1280x720, and a tall page.
MIXED_SIZES = ((224, 224), (384, 384), (640, 480), (1280, 720), (448, 1344))


def mixed_pictures(i: int) -> tuple[list[bytes], str]:
    """Request i's pictures with --mixed: 1 to 3 fresh ones, each of a size from MIXED_SIZES."""
    rng = np.random.default_rng([SEED, 29, i])
    datas = []
    for j in range(int(rng.integers(1, 4))):
        size = MIXED_SIZES[int(rng.integers(len(MIXED_SIZES)))]
        img = render(np.random.default_rng([SEED, i, j])).image.resize(size)
        datas.append(encode(img, "JPEG", 90))
    return datas, list(PROMPTS)[i % len(PROMPTS)]


def picture(i: int, pool: int = 0, zipf_s: float = 1.1) -> tuple[bytes, str]:
    """Request i's picture and prompt: a fresh picture, or with `pool`, one of that many drawn
    Zipf(zipf_s) as W3 draws them (the prompts cycle, so a picture comes back with other questions too)."""
    prompt = list(PROMPTS)[i % len(PROMPTS)]
    if not pool:
        return rendered((SEED, i)), prompt
    ranks = np.arange(1, pool + 1, dtype=np.float64) ** -zipf_s
    key = int(np.random.default_rng([SEED, 7, i]).choice(pool, p=ranks / ranks.sum()))
    return pooled((SEED, 17, key)), prompt


class Load:
    """Requests through the gateway; every one ends counted (a status, or lost)."""

    def __init__(self, target: str, max_tokens: int, pool: int = 0, mixed: bool = False) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        self.max_tokens, self.pool, self.mixed = max_tokens, pool, mixed
        self.statuses: Counter = Counter()
        self.e2e: dict[str, list[float]] = {c: [] for c in CLASSES}
        self.sent = 0
        self.pending: set[asyncio.Task] = set()

    async def one(self, i: int, qos: str, record: bool = True) -> None:
        loop = asyncio.get_running_loop()  # pictures are made off the loop
        if self.mixed:
            datas, prompt = await loop.run_in_executor(None, mixed_pictures, i)
        else:
            data, prompt = await loop.run_in_executor(None, picture, i, self.pool)
            datas = [data]
        req = gateway_pb2.GenerateRequest(
            images=[pb.Image(data=d) for d in datas],
            prompt=prompt,
            sampling=pb.SamplingParams(max_tokens=self.max_tokens),
        )
        start = time.perf_counter()
        try:
            await self.stub.GenerateUnary(req, metadata=(("qos-level", qos),), timeout=60)
            code = "OK"
        except grpc.aio.AioRpcError as err:
            code = err.code().name
        if record:
            self.statuses[code] += 1
            if code == "OK":
                self.e2e[qos].append((time.perf_counter() - start) * 1000)

    def launch(self, i: int, qos: str) -> None:
        self.sent += 1
        task = asyncio.create_task(self.one(i, qos))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)


async def capacity(load: Load, concurrency: int, seconds: float) -> float:
    """Requests per second that a closed loop of `concurrency` gets."""
    done, stop, counter = 0, time.monotonic() + seconds, iter(range(10**9, 2 * 10**9))

    async def worker() -> None:
        nonlocal done
        while time.monotonic() < stop:
            await load.one(next(counter), "standard", record=False)
            done += 1

    start = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.monotonic() - start)


def gpu_memory(url: str) -> dict[str, float]:
    """A service's allocator on its GPU, from its /metrics: {"gpu_reserved_mib", "gpu_allocated_mib"}."""
    with urllib.request.urlopen(url, timeout=5) as answer:
        text = answer.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == "vlmesh_gpu_memory_bytes":
            for s in family.samples:
                out[f"gpu_{s.labels['kind']}_mib"] = round(s.value / 2**20, 2)
    return out


def device_used_mib() -> float | None:
    """The GPU's memory in use by every process, as nvidia-smi reports it (None without it)."""
    if shutil.which("nvidia-smi") is None:
        return None
    cmd = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "--id=0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    return float(out.stdout.strip()) if out.returncode == 0 else None


def sample(procs: dict[str, psutil.Process], t0: float, metrics: dict[str, str]) -> dict:
    """Each service's memory, descriptors and threads, and the shared-memory segments the services
    made (services/common/segments.py: not another mesh's on the host); `metrics`: the /metrics URL
    of each service on a GPU."""
    shm = len(segments.owned_by({p.pid for p in procs.values()}))
    row: dict = {"t_s": round(time.monotonic() - t0, 1), "shm_segments": shm}
    for name, p in procs.items():
        mem = p.memory_info()
        row[name] = {
            "rss_mib": round(mem.rss / 2**20, 2),
            "private_mib": round((mem.rss - getattr(mem, "shared", 0)) / 2**20, 2),
            "fds": p.num_fds(),
            "threads": p.num_threads(),
        }
        if name in metrics:
            row[name] |= gpu_memory(metrics[name])
    if metrics:
        row["device_used_mib"] = device_used_mib()
    return row


def growth_of(samples: list[dict], name: str) -> dict:
    """One service's memory growth over these samples: the Theil-Sen line through each figure against
    time (the median of the slopes between every two samples), its rise from the first sample's time
    to the last's as a share of where it starts. A leak raises the whole series. On the CPU single
    samples swing by a few MiB either way: a step's activations, and glibc trimming the top of a heap
    and growing it again (the llm's private memory by about 2 of 287 MiB). Those moved the peak of the
    last third of a 2-minute run against the first by +-1.2%, and tilt a least-squares line; the
    median slope leaves them out. Over 16 two-minute runs its standard deviation across runs was
    0.31% for the vision and 0.37% for the llm, against 0.49% and 0.48% for least squares
    (docs/PERF.md). RSS also counts the feature arenas' shared pages, which fill up to
    --feature-cache-mib by design; `private` leaves them out. On a GPU, `gpu_reserved` too: what the
    allocator holds of the device. `fds`: the most open in the last third against the most in the
    first."""
    samples = samples[:: max(1, -(-len(samples) // MAX_FIT_SAMPLES))]  # every k-th: the pairs grow as n squared
    times = np.array([s["t_s"] for s in samples], dtype=np.float64)
    rows = [s[name] for s in samples]
    first, second = np.triu_indices(len(times), 1)
    apart = times[second] - times[first]
    pairs = apart > 0

    def rise(key: str) -> float:
        values = np.array([r[key] for r in rows], dtype=np.float64)
        if not pairs.any():
            return 0.0
        slope = float(np.median((values[second] - values[first])[pairs] / apart[pairs]))
        intercept = float(np.median(values - slope * times))
        return round(float(slope * (times[-1] - times[0]) / (slope * times[0] + intercept)), 4)

    third = max(1, len(rows) // 3)
    growth = {
        "rss": rise("rss_mib"),
        "private": rise("private_mib"),
        "fds": max(r["fds"] for r in rows[-third:]) - max(r["fds"] for r in rows[:third]),
    }
    if all("gpu_reserved_mib" in r for r in rows):
        growth["gpu_reserved"] = rise("gpu_reserved_mib")
    return growth


def judged_growth(samples: list[dict], names, warmup: float, duration: float, extended: bool, end: float):
    """(growth after the warm-up, growth from `duration` on or None) of each service in `names`,
    over the samples taken under load (up to `end`: the drain's sample is not the load's)."""

    def growth(since: float) -> dict:
        return {n: growth_of([s for s in samples if since <= s["t_s"] <= end], n) for n in names}

    return growth(warmup), growth(duration) if extended else None


def verdict(result: dict, max_growth: float, memory: tuple[str, ...] = ("private", "gpu_reserved")) -> list[str]:
    """What failed in a soak's result (empty: it passed): a lost request, or memory growth.

    Judged once, each service's `memory` figures (growth_of's keys; RSS also counts the feature
    arenas' shared pages, which fill by design) after the warm-up hold `max_growth`, its
    descriptors at most 2 more. Extended (`--extend-to`), the fresh samples from
    `--duration` on hold `max_growth` and the whole series after the warm-up twice it: a step the
    held heap took once (CI's llm: +2.04% over 60-180 s, +1.04% over 60-300, -0.03% over
    180-300) passes, while a leak rises in the fresh window and over the whole series alike."""
    problems = [f"{result['lost']} requests lost"] if result["lost"] else []
    whole, fresh = result["growth_after_warmup"], result.get("growth_fresh")
    checks = [(whole, max_growth, "after the warm-up")]
    if fresh is not None:
        checks = [(fresh, max_growth, "from --duration on"), (whole, 2 * max_growth, "after the warm-up")]
    for growth, bound, when in checks:
        for name, g in growth.items():
            over = {k: g[k] for k in memory if k in g and g[k] > bound}
            if over:
                problems.append(f"{name}: memory grew {over} {when}, bound {bound:.2%}")
            if g["fds"] > 2:
                problems.append(f"{name}: {g['fds']} more open descriptors {when}")
    return problems


def device_span(samples: list[dict], warmup: float) -> dict | None:
    """The device's memory in use after warm-up: its lowest and highest sample (None off a GPU)."""
    used = [s["device_used_mib"] for s in samples if s["t_s"] >= warmup and s.get("device_used_mib") is not None]
    return {"min": min(used), "max": max(used)} if used else None


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


async def poisson(load: Load, rate: float, until: float, rng: random.Random, weights: list[float]) -> None:
    """Open loop: Poisson arrivals at `rate`, each class drawn by `weights`, until `until`; request i's
    picture follows the ones sent before, so a second call sends fresh pictures too."""
    at = time.monotonic()
    while at < until:
        at += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        load.launch(load.sent, rng.choices(CLASSES, weights)[0])


async def closed_loop(load: Load, clients: int, until: float, rng: random.Random, weights: list[float]) -> None:
    """Closed loop: `clients` each send a request when the last ended, until `until`. The mesh is as
    busy as the clients keep it, whatever the host's speed: no queue builds up when the host slows."""

    async def client() -> None:
        while time.monotonic() < until:
            i = load.sent
            load.sent += 1
            await load.one(i, rng.choices(CLASSES, weights)[0])

    await asyncio.gather(*(client() for _ in range(clients)))


async def sample_every(samples: list[dict], every_s: float, procs, t0: float, metrics: dict[str, str]) -> None:
    while True:
        await asyncio.sleep(every_s)
        samples.append(sample(procs, t0, metrics))


async def soak(mesh: Mesh, args, memory: tuple[str, ...]) -> dict:
    """The soak's figures and samples; `memory`: the figures `verdict` holds to --max-growth."""
    load = Load(mesh.target("gateway"), args.max_tokens, args.pool, args.mixed)
    procs = {c.name: psutil.Process(c.proc.pid) for c in mesh.children}
    metrics = {}
    if args.device.startswith("cuda"):
        metrics = {n: f"http://127.0.0.1:{p}/metrics" for n, p in mesh.metrics_ports.items() if n != "gateway"}
    rng = random.Random(SEED)
    weights = [float(x) for x in args.mix.split(",")]
    if args.clients:
        cap, rate = None, None
        print(f"soak: {args.clients} clients, each sending its next request at the last's end", file=sys.stderr)
    else:
        cap = await capacity(load, args.concurrency, args.probe_s)
        rate = args.load * cap
        print(f"soak: capacity {cap:.1f} req/s; offering {rate:.1f} req/s for {args.duration:g} s", file=sys.stderr)
    t0 = time.monotonic()
    samples = [sample(procs, t0, metrics)]
    sampler = asyncio.create_task(sample_every(samples, args.sample_s, procs, t0, metrics))

    async def drive(until: float) -> None:
        if args.clients:
            await closed_loop(load, args.clients, until, rng, weights)
        else:
            await poisson(load, rate, until, rng, weights)

    await drive(t0 + args.duration)
    # A sequential test: growth past the bound after --duration may be a leak, a noisy stretch, or a
    # step that a held heap took once on its way to its working set (CI saw one 170 s into the load).
    # The load goes on to --extend-to and the fresh samples are judged too (`verdict`): a leak keeps
    # rising in them, a step already taken does not.
    at_duration, _ = judged_growth(samples, procs, args.warmup, args.duration, False, time.monotonic() - t0)
    over = verdict({"lost": 0, "growth_after_warmup": at_duration}, args.max_growth, memory)
    extended = args.extend_to > args.duration and bool(over)
    if extended:
        print(f"soak: at {args.duration:g} s {over[0]}; going on to {args.extend_to:g} s", file=sys.stderr)
        await drive(t0 + args.extend_to)
    load_end = time.monotonic() - t0
    whole, fresh = judged_growth(samples, procs, args.warmup, args.duration, extended, load_end)
    # Drain: every request sent must end, with an answer or a status, within its deadline.
    if load.pending:
        await asyncio.wait(set(load.pending), timeout=90)
    sampler.cancel()
    samples.append(sample(procs, t0, metrics))
    await load.channel.close()
    answered = load.statuses["OK"]
    refused = sum(n for code, n in load.statuses.items() if code != "OK")
    return {
        "capacity_rps": round(cap, 2) if cap else None,
        "offered_rps": round(rate, 2) if rate else round(load.sent / (samples[-1]["t_s"] or 1.0), 2),
        "sent": load.sent,
        "answered": answered,
        "refused_with_status": refused,
        "lost": load.sent - answered - refused,
        "statuses": dict(load.statuses),
        "e2e_ms": {c: {"p50": percentile(v, 50), "p99": percentile(v, 99), "n": len(v)} for c, v in load.e2e.items()},
        "growth_after_warmup": whole,
        "growth_fresh": fresh,  # from --duration on, when extended
        "load_end_s": round(load_end, 3),
        "extended": {"growth_at_duration": at_duration, "to_s": args.extend_to} if extended else None,
        "shm_segments": {"start": samples[0]["shm_segments"], "end": samples[-1]["shm_segments"]},
        "device_used_mib": device_span(samples, args.warmup),
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.soak [flags] [-- mesh flags]",
        description=__doc__.split("\n\n")[0],
        epilog="Flags after -- go to the mesh as `vlmesh up` takes them, e.g. -- --max-llm-batch 32 --cuda-mps.",
    )
    p.add_argument("--model", default="models/demo")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load (default %(default)s)")
    p.add_argument("--warmup", type=float, default=20.0, help="seconds before memory is compared (default %(default)s)")
    p.add_argument("--load", type=float, default=0.7, help="share of the measured capacity (default %(default)s)")
    p.add_argument(
        "--clients",
        type=int,
        default=0,
        help="instead of --load: this many clients in a closed loop, each sending its next request when the "
        "last ended, so the load follows the host's speed (default 0: open loop at --load)",
    )
    p.add_argument("--mix", default="2,5,3", help="realtime,standard,best-effort weights (default %(default)s)")
    p.add_argument("--concurrency", type=int, default=8, help="the capacity probe's closed loop (default %(default)s)")
    p.add_argument("--probe-s", type=float, default=10.0, help="the capacity probe's length (default %(default)s)")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument(
        "--pool",
        type=int,
        default=0,
        help="draw pictures Zipf(1.1) from a pool of this many, as W3 does (default: fresh)",
    )
    p.add_argument(
        "--mixed",
        action="store_true",
        help="1 to 3 fresh pictures a request, of sizes from 224x224 to 1280x720 (models that read a picture "
        "at its own size, e.g. Qwen2.5-VL)",
    )
    p.add_argument(
        "--max-growth", type=float, default=0.01, help="private (and reserved GPU) memory growth allowed (default 1%%)"
    )
    p.add_argument(
        "--extend-to",
        type=float,
        default=0.0,
        help="when a service's growth after --duration passes --max-growth, keep the load on until this many "
        "seconds; then the samples from --duration on must hold the bound and the whole series twice it (a "
        "leak rises in both, a step the heap took once does not). At least --duration minus --warmup past "
        "--duration (default 0: judge once)",
    )
    p.add_argument(
        "--judge-memory",
        default="private,gpu_reserved",
        help="the memory figures held to --max-growth: private, rss (which also counts the feature arenas' "
        "shared pages), gpu_reserved (default %(default)s)",
    )
    p.add_argument("--device", default="cpu", help="cpu, or cuda: GPU memory is sampled too (default %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="write the figures, samples and verdict as JSON here")
    p.add_argument(
        "--judge",
        type=Path,
        default=None,
        metavar="FILE",
        help="start no mesh: judge the soak saved in FILE (--out's JSON) again, with these --max-growth and "
        "--judge-memory, and exit as that run would have",
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    memory = tuple(m for m in args.judge_memory.split(",") if m)
    if not memory or set(memory) - {"private", "rss", "gpu_reserved"}:
        p.error(f"--judge-memory {args.judge_memory!r}: give some of private, rss, gpu_reserved")
    if args.judge:
        return judge_file(args.judge, args.max_growth, memory)
    if args.extend_to and args.extend_to - args.duration < args.duration - args.warmup:
        p.error(
            "--extend-to: give at least --duration plus (--duration minus --warmup): the fresh window is judged alone"
        )
    metrics_ports = (0, 0, 0) if args.device.startswith("cuda") else (-1, -1, -1)  # GPU memory comes from /metrics
    opts = MeshOptions.from_flags(
        argv[cut + 1 :],
        model=args.model,
        device=args.device,
        gateway_port=0,
        vision_port=0,
        llm_port=0,
        metrics_ports=metrics_ports,
    )
    with Mesh(opts) as mesh:
        mesh.start(progress=lambda m: print(f"soak: {m}", file=sys.stderr, flush=True))
        result = asyncio.run(soak(mesh, args, memory))
    result["problems"] = verdict(result, args.max_growth, memory)
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary, indent=1))
    if args.out:
        saved = vars(args) | {"out": str(args.out), "judge": None}
        args.out.write_text(json.dumps({"args": saved, **result}, indent=1))
    return report(result["problems"])


def report(problems: list[str]) -> int:
    for problem in problems:
        print(f"soak: FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


def judge_file(path: Path, max_growth: float, memory: tuple[str, ...]) -> int:
    """A saved soak judged again: its growths from its own samples and settings, then `verdict`."""
    try:
        saved = json.loads(path.read_text())
        run, samples = saved["args"], saved["samples"]
        names = [n for n in samples[0] if isinstance(samples[0][n], dict)]
        end = saved.get("load_end_s", samples[-1]["t_s"])
        extended = saved.get("extended") is not None
        whole, fresh = judged_growth(samples, names, run["warmup"], run["duration"], extended, end)
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise SystemExit(f"--judge {path}: not a soak's JSON as --out writes it ({type(e).__name__}: {e})") from e
    result = {"lost": saved.get("lost", 0), "growth_after_warmup": whole, "growth_fresh": fresh}
    print(json.dumps(result, indent=1))
    return report(verdict(result, max_growth, memory))


if __name__ == "__main__":
    sys.exit(main())
