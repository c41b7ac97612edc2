"""The batch-1 decode step's linears alone: the one-row Triton kernel (services/model/gemv.py)
against cuBLAS (F.linear), per decoder shape, on a CUDA GPU.

Each case is timed as the decode step runs it: a CUDA graph of `--layers` launches over as many
distinct weight matrices (so no weight is read from L2), replayed; the time per launch is the
replay's over the launches. Every config of a small grid is tried and checked against an fp32
reference; the table gives cuBLAS, the best config, and the config `gemv.pick` chooses.

    python -m bench.gemv [--model preset:llava-7b-shaped] [--layers 24] [--out gemv.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch
import torch.nn.functional as F

from services.common.buckets import capture_graphs
from services.model import gemv
from services.model.spec import load_spec

GRID = [gemv.Config(*c) for c in itertools.product((8, 16, 32, 64), (256, 512, 1024), (4, 8), (2, 3, 4))]


def graph_time(run, layers: int, replays: int = 20) -> float:
    """Seconds per launch of `run(i)` for i in range(layers), captured in one CUDA graph."""
    graph = capture_graphs([layers], lambda n: [run(i) for i in range(n)], "bench.gemv")[layers]
    graph.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / layers)
    return statistics.median(times)


def shapes(model: str) -> dict[str, tuple[int, int]]:
    """The decoder's four projections as [out, in] (q/k/v and gate/up fused, as the engine runs them)."""
    t = load_spec(model).text
    return {
        "qkv": ((t.heads + 2 * t.kv_heads) * t.head_dim, t.hidden),
        "o": (t.hidden, t.heads * t.head_dim),
        "gate_up": (2 * t.intermediate, t.hidden),
        "down": (t.hidden, t.intermediate),
    }


def sweep(name: str, n: int, k: int, layers: int) -> dict:
    """cuBLAS and every config of GRID for x [1, k] W[n, k]^T."""
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(layers)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ref = [F.linear(x.float(), w.float()) for w in ws[:2]]
    ys = [torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for _ in ws]
    cublas = graph_time(lambda i: F.linear(x, ws[i]), layers)
    timed = {}
    for cfg in GRID:
        try:
            for i in range(2):
                ys[i].fill_(float("nan"))  # every output must be written
                gemv.launch(x, ws[i], ys[i], cfg)
                err = ((ys[i].float() - ref[i]).norm() / ref[i].norm()).item()
                if not err < 1e-2:
                    raise ValueError(f"relative error {err}")
            timed[cfg] = graph_time(lambda i, c=cfg: gemv.launch(x, ws[i], ys[i], c), layers)
        except Exception as e:  # a config that does not compile or fit (shared memory) is skipped
            print(f"  {name} {tuple(cfg)}: {type(e).__name__}: {str(e)[:120]}")
    best = min(timed, key=timed.get)
    picked = gemv.pick(n, k)
    print(f"{name}: cuBLAS {cublas * 1e6:.1f} us, best {timed[best] * 1e6:.1f} {tuple(best)}", flush=True)
    return {
        "linear": name,
        "MB": n * k * 2 / 1e6,
        "cublas_s": cublas,
        "best": best._asdict(),
        "best_s": timed[best],
        "picked": picked._asdict(),
        "picked_s": timed.get(picked),
        "top5": [(c._asdict(), timed[c]) for c in sorted(timed, key=timed.get)[:5]],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gemv", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="preset:llava-7b-shaped")
    p.add_argument("--layers", type=int, default=24, help="launches (distinct weights) per graph")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("python -m bench.gemv needs a CUDA GPU")
    results = [sweep(name, n, k, args.layers) for name, (n, k) in shapes(args.model).items()]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    print("\n| linear | MB | cuBLAS us (TB/s) | best us (TB/s) | best (rows, cols, warps, stages) | picked us |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        c, b, mb = r["cublas_s"] * 1e6, r["best_s"] * 1e6, r["MB"]
        picked = f"{r['picked_s'] * 1e6:.1f}" if r["picked_s"] else "not in the grid"
        best = tuple(r["best"].values())
        print(f"| {r['linear']} | {mb:.0f} | {c:.1f} ({mb / c:.2f}) | {b:.1f} ({mb / b:.2f}) | {best} | {picked} |")


if __name__ == "__main__":
    main()
