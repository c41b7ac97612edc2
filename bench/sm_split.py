"""Prefill and decode on disjoint SMs of one GPU: what each lane's step costs alone and side by side.

The engine's own captured graphs (services/llm/runner.py: the packed prefill of one W1-shaped
prompt, the decode step of `--batches` sequences at `--context` positions) replayed on the
streams of two green contexts (services/llm/sm_partition.py): the prefill's `p` SMs and the
rest. For each split it times, with CUDA events on each lane's stream, each lane alone on its
SMs, then both at once, and the decode on the whole device beside the prefill on its `p` SMs,
on a stream of normal and of high priority. Each lane's graph is captured on its partition's
stream: a graph keeps the SMs of the context it was captured in (replayed on a partition, one
captured on the whole device ran at its whole-device speed). A matmul on the prefill's partition
checks that the partition holds.

    python -m bench.sm_split [--model preset:llava-7b-shaped] [--prefill-sms 64,80,96,104]
        [--batches 8,16] [--context 640] [--prompt 608] [--out sm_split.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.decode_step import Prompt, Seq
from services.llm.block_manager import BlockManager
from services.llm.kv_cache import KvConfig
from services.llm.runner import ModelRunner
from services.llm.scheduler import Chunk
from services.llm.sm_partition import device_sms, split_sms
from services.model.spec import load_spec


def timed(work, stream: torch.cuda.Stream, n: int) -> list:
    """Queue n runs of `work` on `stream`, each between two timing events (read them after a sync)."""
    events = []
    with torch.cuda.stream(stream):
        for _ in range(n):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            work()
            b.record()
            events.append((a, b))
    return events


def median_ms(events: list, skip: int = 2) -> float:
    return statistics.median(a.elapsed_time(b) for a, b in events[skip : len(events) - skip or None])


def alone(work, stream, n: int) -> float:
    events = timed(work, stream, n)
    torch.cuda.synchronize()
    return median_ms(events)


def together(prefill, p_stream, decode, d_stream, p_ms: float, d_ms: float, seconds: float = 0.4):
    """Both lanes busy for about `seconds`: (prefill ms, decode ms) per run, medians."""
    n_p, n_d = max(6, int(seconds * 1e3 / p_ms)), max(12, int(seconds * 1e3 / d_ms))
    torch.cuda.synchronize()
    pe = timed(prefill, p_stream, n_p)
    de = timed(decode, d_stream, n_d)
    torch.cuda.synchronize()
    return median_ms(pe), median_ms(de)


def capture(forward, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        forward()
    return graph


def matmul_check(device: torch.device, splits: list[int]) -> None:
    """A matmul on each partition and on the whole device, one after another, then both partitions at once."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    whole = alone(lambda: torch.mm(a, a), torch.cuda.current_stream(), 10)
    print(f"matmul 8192^3 on the whole device ({device_sms(device)} SMs): {whole:.2f} ms")
    for sms in splits:
        pre, rest = split_sms(sms, device)
        first, second = alone(lambda: torch.mm(a, a), pre.stream, 10), alone(lambda: torch.mm(a, a), rest.stream, 10)
        both = together(lambda: torch.mm(a, a), pre.stream, lambda: torch.mm(a, a), rest.stream, first, second)
        print(
            f"{pre.sms} / {rest.sms} SMs: alone {first:.2f} / {second:.2f} ms, at once {both[0]:.2f} / {both[1]:.2f} ms"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.sm_split", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="preset:llava-7b-shaped")
    p.add_argument("--prefill-sms", default="64,80,96,104")
    p.add_argument("--batches", default="8,16")
    p.add_argument("--context", type=int, default=640)
    p.add_argument("--prompt", type=int, default=608)
    p.add_argument("--out", default=None)
    p.add_argument("--matmul-only", action="store_true", help="only the partition check (no model): e.g. under MPS")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    if args.matmul_only:
        return matmul_check(device, [int(s) for s in args.prefill_sms.split(",")])
    spec = load_spec(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    t0 = time.perf_counter()
    runner = ModelRunner(spec, device, torch.bfloat16, max(batches), KvConfig(128, 0.0, 0.6), 2048)
    print(f"runner ready in {time.perf_counter() - t0:.1f} s", flush=True)
    packed = runner.packed
    pages = BlockManager(runner.n_pages, runner.page_size)
    prompt = Prompt([7] * args.prompt, pages.allocate(pages.pages_for(args.prompt)))
    runner.step([Chunk(prompt, 0, args.prompt)], [])  # stages the packed step's inputs
    size = (packed.rows, 0, packed.fresh)
    prefill_graph = packed._graphs[size]
    total, default = device_sms(device), torch.cuda.current_stream()
    normal, high = torch.cuda.Stream(device), torch.cuda.Stream(device, priority=-1)

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def matmul():
        torch.mm(a, a)

    results = {"sms": total, "prefill_key": list(size), "rows": []}
    full_mm, full_p = alone(matmul, default, 10), alone(prefill_graph.replay, default, 12)
    print(f"{total} SMs; whole device: matmul 8192^3 {full_mm:.2f} ms, prefill {size} {full_p:.2f} ms", flush=True)
    for b in batches:
        seqs = [Seq(pages.allocate(pages.pages_for(args.context)), args.context - 1) for _ in range(b)]
        runner.step([], seqs)  # stages the decode step's inputs (the upload carries the packed step's too)
        decode_graph = runner.decode._graphs[runner.decode.bucket(b)]
        full_d = alone(decode_graph.replay, default, 30)
        print(f"batch {b}: decode alone on the whole device {full_d:.2f} ms", flush=True)
        for sms in (int(s) for s in args.prefill_sms.split(",")):
            pre, rest = split_sms(sms, device)
            row = {"batch": b, "prefill_sms": pre.sms, "decode_sms": rest.sms, "full_prefill_ms": full_p}
            row["full_decode_ms"] = full_d
            row["matmul_ms"] = alone(matmul, pre.stream, 10)
            # A graph keeps the SMs of the context it was captured in: capture on each partition.
            on_pre = capture(lambda: packed.forward(size), pre.stream)
            on_rest = capture(lambda b=b: runner.decode.forward(runner.decode.bucket(b), 1), rest.stream)
            row["prefill_alone_ms"] = alone(on_pre.replay, pre.stream, 12)
            row["decode_alone_ms"] = alone(on_rest.replay, rest.stream, 30)
            row["prefill_with_ms"], row["decode_with_ms"] = together(
                on_pre.replay, pre.stream, on_rest.replay, rest.stream, full_p, full_d
            )
            # The decode captured on the whole device (every SM the prefill leaves it) beside it, on
            # a stream of normal priority and of high priority (whose blocks go first wherever an SM
            # frees, the prefill's own SMs included).
            row["prefill_with_primary_ms"], row["decode_primary_with_ms"] = together(
                on_pre.replay, pre.stream, decode_graph.replay, normal, full_p, full_d
            )
            row["prefill_with_high_ms"], row["decode_high_with_ms"] = together(
                on_pre.replay, pre.stream, decode_graph.replay, high, full_p, full_d
            )
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    print(f"\nprefill {size} whole device {full_p:.2f} ms; matmul whole device {full_mm:.2f} ms")
    print(
        "| batch | SMs prefill / decode | matmul on prefill's ms | prefill alone | decode alone "
        "| both: prefill / decode | decode on the whole device beside: prefill / decode | the same, decode "
        "of high priority |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results["rows"]:
        print(
            f"| {r['batch']} | {r['prefill_sms']} / {r['decode_sms']} | {r['matmul_ms']:.2f} "
            f"| {r['prefill_alone_ms']:.2f} | {r['decode_alone_ms']:.2f} (whole {r['full_decode_ms']:.2f}) "
            f"| {r['prefill_with_ms']:.2f} / "
            f"{r['decode_with_ms']:.2f} | {r['prefill_with_primary_ms']:.2f} / {r['decode_primary_with_ms']:.2f} "
            f"| {r['prefill_with_high_ms']:.2f} / {r['decode_high_with_ms']:.2f} |"
        )


if __name__ == "__main__":
    main()
