"""The 1-byte weight matmul (services/model/int8_mm.py) against bf16 cuBLAS and against
dequantize-then-cuBLAS, per decoder shape and row count, on a CUDA GPU; `--weight` picks int8
codes (the int8 variant's) or e4m3 (the fp8 variant's decode rows).

Timed as the engine runs it: a CUDA graph of `--layers` launches over as many distinct weights
(so none is read from L2), replayed; the time per launch is the replay's over the launches.
Every config of a small grid (split along K or not) is tried and checked against an fp64
reference. The table gives the bytes-read floor of the int8 weight at the copy bandwidth of `--bandwidth` (TB/s), bf16
cuBLAS, the dequantizing path, the best config (at one row gemv's one-row kernel too, scaled) and the op as it
picks (its time includes a copy of the output).

    python -m bench.int8_mm [--model preset:llava-7b-shaped] [--weight int8|fp8] [--rows 1,8,32,640] [--out F]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from bench.gemv import graph_time, shapes
from services.model import gemv, int8_mm

ROW = [(n, k, w, s) for n in (8, 16, 32) for k in (512, 1024, 2048) for w in (4, 8) for s in (3, 4)]  # gemv's
C = int8_mm.Config
SPLITS = (2, 4, 8)
GRID = {  # (rows, channels, input channels) per program, warps, stages, splits along K; by row count
    "decode": [C(16, n, k, w, 4) for n in (16, 32, 64, 128) for k in (128, 256, 512) for w in (4, 8)]
    + [C(16, n, k, 4, 4, j) for n in (32, 64) for k in (128, 256) for j in SPLITS],
    "mid": [C(m, n, k, 4, s) for m in (32, 64) for n in (32, 64, 128) for k in (64, 128, 256) for s in (3, 4)]
    + [C(32, n, k, 4, s, j) for n in (32, 64) for k in (64, 128) for s in (3, 4) for j in SPLITS],
    "prefill": [
        C(m, n, k, w, s) for m in (64, 128) for n in (128, 256) for k in (64, 128) for w in (4, 8) for s in (3, 4)
    ],
}


def grid(m: int) -> list[int8_mm.Config]:
    return GRID["decode" if m <= 16 else "mid" if m <= 64 else "prefill"]


def codes(n: int, k: int, weight: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes [n, k] as the variant stores them, and scales [n] that make unit-scale outputs."""
    if weight == "fp8":  # e4m3 over its whole range (|q| <= 448), as Fp8Linear scales a channel's max to it
        q = (torch.randn(n, k, device="cuda", generator=gen) * 112).clamp(-448, 448).to(torch.float8_e4m3fn)
        return q, torch.rand(n, device="cuda", generator=gen) / (112 * k**0.5)
    q = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8, generator=gen)
    return q, torch.rand(n, device="cuda", generator=gen) / (127 * k**0.5)


def sweep(name: str, n: int, k: int, m: int, layers: int, weight: str) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    qs, ss = zip(*(codes(n, k, weight, gen) for _ in range(layers)), strict=True)
    ws = [(q.float() * s[:, None]).to(torch.bfloat16) for q, s in zip(qs, ss, strict=True)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = [(x.double() @ qs[i].float().double().T) * ss[i].double() for i in range(2)]
    ys = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    cublas = graph_time(lambda i: F.linear(x, ws[i]), layers)
    dequant = graph_time(lambda i: F.linear(x, qs[i].to(x.dtype)) * ss[i].to(x.dtype), layers)
    timed = {}

    def trial(cfg, run, label: str) -> None:
        """Check `run(i, cfg)` against the reference on two weights, then time it; a config that
        does not compile, fit (shared memory) or match is skipped, named."""
        try:
            for i in range(2):
                ys[i].fill_(float("nan"))  # every output must be written
                run(i, cfg)
                err = ((ys[i].double() - ref[i]).norm() / ref[i].norm()).item()
                if not err < 1e-2:
                    raise ValueError(f"relative error {err}")
            timed[cfg] = graph_time(lambda i: run(i, cfg), layers)
        except Exception as e:
            print(f"  {name} m={m} {label} {tuple(cfg)}: {type(e).__name__}: {str(e)[:100]}")

    if m == 1:  # gemv's one-row kernel, scaled: what the op runs for one row of o and down
        for c in ROW:
            trial(gemv.Config(*c), lambda i, cfg: gemv.launch(x, qs[i], ys[i], cfg, scale=ss[i]), "one-row")
    for cfg in grid(m):
        trial(cfg, lambda i, c: int8_mm.launch(x, qs[i], ss[i], ys[i], c), "tile")
    best = min(timed, key=timed.get)
    picked_s = graph_time(lambda i: ys[i].copy_(int8_mm.linear(x, qs[i], ss[i])), layers)  # the op, as it picks
    print(f"{name} m={m}: cuBLAS bf16 {cublas * 1e6:.1f} us, dequant {dequant * 1e6:.1f}, "
          f"best {timed[best] * 1e6:.1f} {tuple(best)}, picked {picked_s * 1e6:.1f}", flush=True)  # fmt: skip
    return {
        "linear": name, "weight": weight, "n": n, "k": k, "m": m, "weight_MB": n * k / 1e6,
        "cublas_bf16_s": cublas, "dequant_s": dequant,
        "best": best._asdict(), "best_s": timed[best], "picked_s": picked_s,
        "top5": [(c._asdict(), timed[c]) for c in sorted(timed, key=timed.get)[:5]],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.int8_mm", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="preset:llava-7b-shaped")
    p.add_argument("--weight", default="int8", choices=("int8", "fp8"), help="the codes: int8, or e4m3 (fp8)")
    p.add_argument("--rows", default="1,8,32,640", help="row counts (batch sizes, or a prefill's tokens)")
    p.add_argument("--layers", type=int, default=16, help="launches (distinct weights) per graph")
    p.add_argument("--bandwidth", type=float, default=4.24, help="copy bandwidth for the floor, TB/s")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("python -m bench.int8_mm needs a CUDA GPU")
    rows = [int(r) for r in args.rows.split(",")]
    linears = shapes(args.model).items()
    results = [sweep(name, n, k, m, args.layers, args.weight) for m in rows for name, (n, k) in linears]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    w = args.weight
    print(
        f"\n| rows | linear | {w} floor us | bf16 cuBLAS us | dequant + cuBLAS us | {w} best us (x floor) "
        "| best (m, n, k, warps, stages, split) | picked us |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        floor = r["weight_MB"] / args.bandwidth  # MB / (TB/s) = us
        b = r["best_s"] * 1e6
        c, d = r["cublas_bf16_s"] * 1e6, r["dequant_s"] * 1e6
        print(f"| {r['m']} | {r['linear']} | {floor:.1f} | {c:.1f} | {d:.1f} | {b:.1f} ({b / floor:.2f}) "
              f"| {tuple(r['best'].values())} | {r['picked_s'] * 1e6:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
