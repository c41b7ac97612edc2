"""W1 (or W4) under load through the llm engine's own schedule, simulated on the CPU: where the knee
(P99 <= 387 ms) would move if a step got cheaper, before GPU time is spent on it.

The engine's Scheduler and BlockManager (services/llm) run as they serve; what the GPU does is
a model of each step's time, fitted to the H200's measurements of the 7B-shaped preset in the
mesh under MPS, with the engine a step ahead (docs/PERF.md, the step traces of 2026-12-04, `b8fc945`,
at 25-45 req/s; with these defaults and `--overheads docs/bench/h200-ahead/call2-w1w2-results.json.gz`
the model gave W1's P99 317 / 367 / 426 ms at 35 / 40 / 45 req/s, where the mesh measured
317-320 / 336 / 382):
- a decode-only step of batch b: the step of the smallest bucket >= b as the mesh ran it
  (`--decode-ms`; the ViT's kernels share the GPU), plus `--decode-extra-ms`;
- a step with prompts: the packed graph's row bucket (13.4 ms for the 640-row bucket, as one W1
  prompt alone took on the device; 40.0 for 2,048, bench.decode_step; linear between, never
  under one weight read), plus `--riding-ms` per decode riding in it (their attention), plus
  `--prompt-extra-ms` (what a step of one prompt took in the mesh over that: 14.3-14.5 ms with
  1-4 riding decodes at 25 req/s);
- before the llm, `--front-ms` (gateway, preprocessing, the ViT, the hand-off: about 15 ms at
  25-35 req/s), after its last token `--back-ms`; or, with `--overheads RESULTS`, each request
  draws both from a measured mesh run (a `vlmesh bench` results file, the run at the rate
  nearest the simulated one): its preprocess + vision + hand-off stages before, and what its
  e2e spent outside every stage after (RPCs, relaying, the client: 13 ms p50 and 45-50 ms p99
  at 30-35 req/s on the H200);
- with `--tower-ms`, the pictures' GPU time apart from the front: it runs on the llm's lane,
  between two steps and in arrival order, since the vision shares the GPU under MPS. Without it
  the towers cost the steps nothing, which flatters a workload of large pictures.
Every request is shaped as `--workload` says: W1 (LLaVA's), 576 image and 32 text positions; or W4
(Qwen2.5-VL's), two 1280×720 pictures of 1,196 positions each and 64 text positions. 16 tokens
out (the first from the prefill), the QoS mix 20/60/20, Poisson arrivals. W4 on the H200
unloaded: about 13 ms of front (preprocessing, hand-off) and 33 of towers (two 16.4-ms replays).

    python -m bench.schedule_sim [--workload W1] [--rates 20,25,30,35,40] [--duration 600] [--seeds 3]
        [--overheads results.json.gz] [--decode-scale 1.0] [--prompt-scale 1.0]
        [--max-prefill-tokens 1024] [--max-batch 32] [--tower-ms 0]
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import statistics
from dataclasses import dataclass
from types import SimpleNamespace

from services.common.qos import QosLevel
from services.common.sampling import Sampling
from services.llm.block_manager import BlockManager
from services.llm.packed import decode_row_sizes, row_buckets
from services.llm.request import Request, Status
from services.llm.scheduler import DEFAULT_MAX_PREFILL_TOKENS, Scheduler

OUT = 16
PAGE = 128  # KV positions a page
# workload -> (positions of each picture, text positions)
SHAPES: dict[str, tuple[tuple[int, ...], int]] = {"W1": ((576,), 32), "W4": ((1196, 1196), 64)}
GREEDY = Sampling(max_tokens=OUT, temperature=0.0, top_p=1.0, seed=None, stop=(), min_tokens=OUT, ignore_eos=True)
MIX = ((QosLevel.REALTIME, 0.2), (QosLevel.STANDARD, 0.6), (QosLevel.BEST_EFFORT, 0.2))


@dataclass(frozen=True)
class StepModel:
    decode_ms: dict[int, float]  # decode graph per batch bucket
    decode_extra_ms: float
    prompt_640_ms: float
    prompt_2048_ms: float
    weight_read_ms: float
    riding_ms: float
    prompt_extra_ms: float
    decode_scale: float = 1.0  # what-if: every decode-only step this much of its time
    prompt_scale: float = 1.0  # what-if: every step with prompts this much

    def decode(self, n: int) -> float:
        bucket = next(b for b in sorted(self.decode_ms) if b >= n)
        return (self.decode_ms[bucket] + self.decode_extra_ms) * self.decode_scale

    def packed(self, rows: int, bucket: int, riding: int) -> float:
        per_row = (self.prompt_2048_ms - self.prompt_640_ms) / (2048 - 640)
        graph = max(self.weight_read_ms, self.prompt_640_ms + (bucket - 640) * per_row)
        return (graph + riding * self.riding_ms + self.prompt_extra_ms) * self.prompt_scale


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measured_overheads(path: str, rate: float) -> list[tuple[float, float]]:
    """(before the llm, outside every stage) in ms of each OK request of the run nearest `rate`."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    runs = {r["summary"]["offered_rps"]: name for name, r in zip(data["requests"], data["runs"], strict=True)}
    nearest = runs[min(runs, key=lambda r: abs(r - rate))]
    out = []
    for r in data["requests"][nearest]:
        st = r.get("stages_ms") or {}
        if r["status"] == "OK" and st:
            out.append((st["preprocess"] + st["vision"] + st["handoff"], r["e2e_ms"] - sum(st.values())))
    return out


class Run:
    """One run's arrivals (seconds of them at `rate`, Poisson), its scheduler, and its requests' clocks."""

    def __init__(self, rate: float, duration: float, seed: int, args) -> None:
        rnd = random.Random(seed)
        overheads = measured_overheads(args.overheads, rate) if args.overheads else [(args.front_ms, args.back_ms)]
        self.clock = [0.0]
        self.pictures, self.text = SHAPES[args.workload]
        self.starts = [sum(self.pictures[:j]) for j in range(len(self.pictures))]  # each picture's first position
        positions = sum(self.pictures) + self.text
        pool = BlockManager(args.max_batch * (-(-positions // PAGE) + 2) + 1, PAGE)
        clock = self.clock
        self.sched = Scheduler(
            args.max_batch, pool, args.max_prefill_tokens, clock=lambda: clock[0], prefix_cache=False
        )
        self.arrivals, t = [], 0.0
        while t < duration:
            t += rnd.expovariate(rate)
            qos = rnd.choices([q for q, _ in MIX], [w for _, w in MIX])[0]
            front, back = rnd.choice(overheads)
            self.arrivals.append((t + front / 1e3, t, qos, back))
        self.arrivals.sort()  # by when each reaches the llm
        self.born, self.first, self.last, self.done, self.back_ms = {}, {}, {}, {}, {}
        self.i = 0
        self.tower_s = args.tower_ms / 1e3

    @property
    def busy(self) -> bool:
        return self.i < len(self.arrivals) or bool(self.sched.waiting or self.sched.running)

    def next_arrival(self) -> float:
        return self.arrivals[self.i][0] if self.i < len(self.arrivals) else float("inf")

    def admit(self) -> None:
        """Queue every request that has reached the llm by now. With `--tower-ms`, each one's
        pictures first take the GPU for that long, between two steps and in arrival order: the
        vision shares the llm's GPU (MPS), so its towers hold up the steps."""
        while self.i < len(self.arrivals) and self.arrivals[self.i][0] <= self.clock[0]:
            at, sent, qos, back = self.arrivals[self.i]
            if self.tower_s:
                self.clock[0] += self.tower_s
                at = self.clock[0]
            req = Request(
                id=str(self.i),
                prompt_ids=[7] * (sum(self.pictures) + self.text),
                image_positions=list(self.starts),
                image_features=[SimpleNamespace(shape=(n, 0)) for n in self.pictures],
                text_tokens=self.text,
                sampling=GREEDY,
                max_new=OUT,
                qos=qos,
                detok=None,
                emit=None,
                arrival=at,
            )
            self.born[req.id], self.back_ms[req.id] = sent, back
            self.sched.add(req)
            self.i += 1

    def ran(self, chunks, decodes, end: float) -> None:
        """What a step that ended at `end` did: positions computed, a token each, finishes."""
        for c in chunks:
            c.req.computed = c.end
            if c.completes:
                c.req.output_ids.append(1)
                self.first[c.req.id] = end
        for r in decodes:
            r.computed += 1
            r.output_ids.append(1)
        for r in [*decodes, *(c.req for c in chunks if c.completes)]:
            if len(r.output_ids) >= OUT and r.status is Status.RUNNING:
                r.status = Status.FINISHED
                self.sched.finish(r)
                self.last[r.id] = end
                self.done[r.id] = end + self.back_ms[r.id] / 1e3

    def result(self, warmup: float) -> dict:
        """Each finished request's e2e, TTFT and TPOT (ms), leaving out the first `warmup` seconds."""
        ids = [k for k in self.done if self.born[k] >= warmup]
        return {
            "sent": len(self.arrivals),
            "finished": len(self.done),
            "e2e": [(self.done[k] - self.born[k]) * 1e3 for k in ids],
            "ttft": [(self.first[k] - self.born[k]) * 1e3 for k in ids],
            "tpot": [(self.last[k] - self.first[k]) * 1e3 / (OUT - 1) for k in ids],
        }


def simulate(rate: float, duration: float, seed: int, model: StepModel, args) -> dict:
    """One run through one shared lane: a step carries the prompts and the decodes."""
    run = Run(rate, duration, seed, args)
    sched, clock = run.sched, run.clock
    buckets = row_buckets(args.max_prefill_tokens + args.max_batch)
    while run.busy:
        run.admit()
        plan = sched.schedule()
        if plan.empty:
            clock[0] = run.next_arrival()  # idle until the next request reaches the llm
            continue
        rows = sum(c.end - c.start for c in plan.prefill)
        if rows:
            sizes = decode_row_sizes(args.max_batch)
            riding = next((s for s in sizes if s >= len(plan.decode)), 0) if plan.decode else 0
            bucket = next(b for b in buckets if b >= rows + riding)
            clock[0] += model.packed(rows, bucket, riding) / 1e3
        else:
            clock[0] += model.decode(len(plan.decode)) / 1e3
        run.ran(plan.prefill, plan.decode, clock[0])
    return run.result(args.warmup)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.schedule_sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(SHAPES), default="W1", help="request shape (default %(default)s)")
    p.add_argument("--rates", default="20,25,30,35,40")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of arrivals per run")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of arrivals left out")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--max-prefill-tokens", type=int, default=DEFAULT_MAX_PREFILL_TOKENS)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--decode-ms", default="1:4.3,2:4.5,4:4.9,8:5.5,16:6.1,32:7.3", help="bucket:ms,...")
    p.add_argument("--decode-extra-ms", type=float, default=0.0)
    p.add_argument("--prompt-640-ms", type=float, default=13.4)
    p.add_argument("--prompt-2048-ms", type=float, default=40.0)
    p.add_argument("--weight-read-ms", type=float, default=4.6)
    p.add_argument("--riding-ms", type=float, default=0.1)
    p.add_argument("--prompt-extra-ms", type=float, default=0.9)
    p.add_argument("--front-ms", type=float, default=15.0)
    p.add_argument("--back-ms", type=float, default=2.0)
    p.add_argument(
        "--tower-ms",
        type=float,
        default=0.0,
        help="each request's pictures on the same GPU, between the llm's steps (0: inside --front-ms)",
    )
    p.add_argument("--overheads", default=None, help="a vlmesh bench results file: draw front and back from it")
    p.add_argument("--decode-scale", type=float, default=1.0, help="what-if: decode-only steps take this share")
    p.add_argument("--prompt-scale", type=float, default=1.0, help="what-if: steps with prompts take this share")
    args = p.parse_args(argv)
    decode = {int(b): float(ms) for b, ms in (kv.split(":") for kv in args.decode_ms.split(","))}
    model = StepModel(
        decode,
        args.decode_extra_ms,
        args.prompt_640_ms,
        args.prompt_2048_ms,
        args.weight_read_ms,
        args.riding_ms,
        args.prompt_extra_ms,
        args.decode_scale,
        args.prompt_scale,
    )
    print("| offered req/s | e2e p50 / p99 ms (seeds: median, range of p99) | TTFT p50 / p99 | TPOT p50 / p99 | done |")
    print("| --- | --- | --- | --- | --- |")
    for rate in (float(r) for r in args.rates.split(",")):
        runs = [simulate(rate, args.duration, seed, model, args) for seed in range(args.seeds)]
        p99s = sorted(percentile(r["e2e"], 0.99) for r in runs)

        def med(key: str, q: float, runs: list[dict] = runs) -> float:
            return statistics.median(percentile(r[key], q) for r in runs)

        print(
            f"| {rate:g} | {med('e2e', 0.5):.0f} / {med('e2e', 0.99):.0f} ({p99s[0]:.0f}-{p99s[-1]:.0f}) "
            f"| {med('ttft', 0.5):.0f} / {med('ttft', 0.99):.0f} | {med('tpot', 0.5):.1f} / {med('tpot', 0.99):.1f} "
            f"| {sum(r['finished'] for r in runs)} of {sum(r['sent'] for r in runs)} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
