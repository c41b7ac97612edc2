"""Prefill and decode at once on one GPU: what each lane's step costs alone and beside the other.

The engine's own captured graphs (services/llm/runner.py: the packed prefill of one W1-shaped
prompt, the decode step of `--batches` sequences at `--context` positions), replayed on two
streams, in pairings:

- `whole / whole`: both on the whole device, two streams of normal priority, and again with
  the decode's stream of high priority;
- for each split `p` of `--prefill-sms`: the prefill on a green context of `p` SMs
  (services/llm/sm_partition.py) and the decode confined to the rest, or on the whole device
  (normal and high priority).

Each lane's graph is captured on its own stream: a graph keeps the SMs of the context it was
captured in. Both lanes' replays are queued interleaved, in the ratio of their times alone, so
that neither lane's queue waits behind the other's on the host (the eleventh session's probe
queued every prefill first: the host blocks once the launch queue is full, so its "side by side"
hardly overlapped). Only the steps inside the span where both lanes were busy are timed (CUDA
events on each stream). `overlap` is what the pair gets done per unit of time against the two
run one after the other on the whole device: full_p / p_with + full_d / d_with; over 1, running
them at once pays.

    python -m bench.sm_split [--model preset:llava-7b-shaped] [--prefill-sms 64,96,112]
        [--batches 8,16] [--context 640] [--prompt 608] [--out sm_split.json] [--matmul-only]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.decode_step import admitted
from services.llm.block_manager import BlockManager
from services.llm.kv_cache import KvConfig
from services.llm.runner import ModelRunner
from services.llm.scheduler import Chunk
from services.llm.sm_partition import device_sms, split_sms
from services.model.spec import load_spec


def event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def alone(work, stream: torch.cuda.Stream, n: int, skip: int = 2) -> float:
    """Median ms of n runs of `work` queued on `stream`."""
    torch.cuda.synchronize()
    events = []
    with torch.cuda.stream(stream):
        for _ in range(n):
            a, b = event(), event()
            a.record()
            work()
            b.record()
            events.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events[skip : n - skip])


def together(prefill, p_stream, decode, d_stream, p_ms: float, d_ms: float, seconds: float = 0.5) -> dict:
    """Both lanes busy for about `seconds`, their runs queued interleaved: median ms of each lane's
    runs inside the span where both were busy, and how many there were."""
    n_p = max(8, int(seconds * 1e3 / p_ms))
    ratio = p_ms / d_ms
    torch.cuda.synchronize()
    ref = event()
    ref.record()
    runs = {"p": [], "d": []}

    def one(work, stream, into):
        with torch.cuda.stream(stream):
            a, b = event(), event()
            a.record()
            work()
            b.record()
        into.append((a, b))

    for i in range(n_p):
        one(prefill, p_stream, runs["p"])
        while len(runs["d"]) < (i + 1) * ratio:
            one(decode, d_stream, runs["d"])
    torch.cuda.synchronize()
    spans = {k: [(ref.elapsed_time(a), ref.elapsed_time(b)) for a, b in v] for k, v in runs.items()}
    lo = max(spans["p"][0][0], spans["d"][0][0])
    hi = min(spans["p"][-1][1], spans["d"][-1][1])
    out = {}
    for k, v in spans.items():
        inside = [e - s for s, e in v if s >= lo and e <= hi]
        out[f"{k}_ms"] = statistics.median(inside) if inside else float("nan")
        out[f"{k}_n"] = len(inside)
    return out


def capture(forward, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        forward()
    return graph


def matmul_check(device: torch.device, splits: list[int]) -> None:
    """A matmul on each partition and on the whole device, alone, then on both partitions at once."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def mm():
        torch.mm(a, a)

    whole = alone(mm, torch.cuda.current_stream(), 10)
    print(f"matmul 8192^3 on the whole device ({device_sms(device)} SMs): {whole:.2f} ms")
    for sms in splits:
        pre, rest = split_sms(sms, device)
        first, second = alone(mm, pre.stream, 10), alone(mm, rest.stream, 10)
        both = together(mm, pre.stream, mm, rest.stream, first, second)
        print(
            f"{pre.sms} / {rest.sms} SMs: alone {first:.2f} / {second:.2f} ms, "
            f"at once {both['p_ms']:.2f} / {both['d_ms']:.2f} ms"
        )


def pair(name: str, b: int, prefill, p_stream, decode, d_stream, p_alone: float, d_alone: float, full: tuple) -> dict:
    """One pairing's row: each lane alone (as placed) and at once, and the overlap against the whole device's turns."""
    row = {"batch": b, "pairing": name, "prefill_alone_ms": p_alone, "decode_alone_ms": d_alone}
    at_once = together(prefill, p_stream, decode, d_stream, p_alone, d_alone)
    row.update(prefill_with_ms=at_once["p_ms"], decode_with_ms=at_once["d_ms"], n=(at_once["p_n"], at_once["d_n"]))
    row["overlap"] = full[0] / row["prefill_with_ms"] + full[1] / row["decode_with_ms"]
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.sm_split", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="preset:llava-7b-shaped")
    p.add_argument("--prefill-sms", default="64,96,112")
    p.add_argument("--batches", default="8,16")
    p.add_argument("--context", type=int, default=640)
    p.add_argument("--prompt", type=int, default=608)
    p.add_argument("--out", default=None)
    p.add_argument("--matmul-only", action="store_true", help="only the partition check (no model): e.g. under MPS")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    splits = [int(s) for s in args.prefill_sms.split(",") if s]
    if args.matmul_only:
        return matmul_check(device, splits)
    spec = load_spec(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    t0 = time.perf_counter()
    runner = ModelRunner(spec, device, torch.bfloat16, max(batches), KvConfig(128, 0.0, 0.6), 2048)
    print(f"runner ready in {time.perf_counter() - t0:.1f} s", flush=True)
    packed = runner.packed
    pages = BlockManager(runner.n_pages, runner.page_size)
    prompt = admitted(pages, args.prompt)
    runner.step([Chunk(prompt, 0, args.prompt)], [])  # stages the packed step's inputs
    size = (packed.rows, 0, packed.fresh)
    prefill_graph = packed._graphs[size]
    total, default = device_sms(device), torch.cuda.current_stream()
    streams = {"normal": torch.cuda.Stream(device), "high": torch.cuda.Stream(device, priority=-1)}
    other = torch.cuda.Stream(device)
    full_p = alone(prefill_graph.replay, default, 12)
    print(f"{total} SMs; prefill {size} on the whole device {full_p:.2f} ms", flush=True)
    rows = []
    for b in batches:
        seqs = [admitted(pages, args.context - 1, 1) for _ in range(b)]
        runner.step([], seqs)  # stages the decode step's inputs (the upload carries the packed step's too)
        decode_graph = runner.decode._graphs[runner.decode.bucket(b)]
        full_d = alone(decode_graph.replay, default, 30)
        full = (full_p, full_d)
        print(f"batch {b}: decode on the whole device {full_d:.2f} ms", flush=True)
        for prio, stream in streams.items():
            rows.append(
                pair(
                    f"whole / whole ({prio})",
                    b,
                    prefill_graph.replay,
                    other,
                    decode_graph.replay,
                    stream,
                    full_p,
                    full_d,
                    full,
                )
            )
        for sms in splits:
            pre, rest = split_sms(sms, device)
            # A graph keeps the SMs of the context it was captured in: capture on each partition.
            on_pre = capture(lambda: packed.forward(size), pre.stream)
            on_rest = capture(lambda b=b: runner.decode.forward(runner.decode.bucket(b), 1), rest.stream)
            p_alone = alone(on_pre.replay, pre.stream, 12)
            rest_alone = alone(on_rest.replay, rest.stream, 30)
            rows.append(
                pair(
                    f"{pre.sms} / {rest.sms}",
                    b,
                    on_pre.replay,
                    pre.stream,
                    on_rest.replay,
                    rest.stream,
                    p_alone,
                    rest_alone,
                    full,
                )
            )
            for prio, stream in streams.items():
                name = f"{pre.sms} / whole ({prio})"
                rows.append(
                    pair(name, b, on_pre.replay, pre.stream, decode_graph.replay, stream, p_alone, full_d, full)
                )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"sms": total, "prefill_key": list(size), "full_prefill_ms": full_p, "rows": rows}, f, indent=2)
    print(f"\nprefill {size}: {full_p:.2f} ms on the whole device ({total} SMs); decode priority in brackets")
    print(
        "| batch | prefill SMs / decode SMs | prefill alone -> at once | decode alone -> at once "
        "| steps timed | overlap |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['batch']} | {r['pairing']} | {r['prefill_alone_ms']:.2f} -> {r['prefill_with_ms']:.2f} "
            f"| {r['decode_alone_ms']:.2f} -> {r['decode_with_ms']:.2f} | {r['n'][0]} / {r['n'][1]} "
            f"| {r['overlap']:.2f} |"
        )


if __name__ == "__main__":
    main()
