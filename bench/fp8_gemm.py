"""The fp8 prompt GEMMs on a CUDA GPU, per decoder projection and row count: bf16 cuBLAS against
`torch._scaled_mm` with row-wise scales (what `--quantize fp8` serves: one scale a token, one a
channel), with one scale for the activations and none for the weight (tensor-wise: cuBLASLt's
own fp8 path), and that with the weight's channel scale multiplied in after; and the activation
quantization (compiled, alone) for each layout. Timed as bench.gemv times: a CUDA graph of
`--layers` launches over distinct weights, replayed.

    python -m bench.fp8_gemm [--model preset:llava-7b-shaped] [--rows 640,1024,2048]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.gemv import graph_time, shapes
from services.model.qlinear import FP8, FP8_MAX, fp8_rows


def fp8_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (e4m3, one fp32 scale): the whole tensor's largest magnitude at 448."""
    scale = x.abs().amax().float().clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def time_shape(n: int, k: int, m: int, layers: int, quantizers) -> list[float]:
    """Microseconds per launch of each column, for x [m, k] times W [n, k]^T."""
    bf16, one = torch.bfloat16, torch.ones((), device="cuda")
    ws = [torch.randn(n, k, device="cuda", dtype=bf16) / k**0.5 for _ in range(layers)]
    qs = [fp8_rows(w) for w in ws]  # [n, k] e4m3 and [n, 1] scales, as Fp8Linear stores them
    x = torch.randn(m, k, device="cuda", dtype=bf16)
    (xr, xrs), (xt, xts) = fp8_rows(x), fp8_tensor(x)

    def row_wise(i: int) -> torch.Tensor:
        return torch._scaled_mm(xr, qs[i][0].t(), scale_a=xrs, scale_b=qs[i][1].view(1, -1), out_dtype=bf16)

    def tensor_wise(i: int) -> torch.Tensor:
        return torch._scaled_mm(xt, qs[i][0].t(), scale_a=xts, scale_b=one, out_dtype=bf16)

    runs = [
        lambda i: F.linear(x, ws[i]),
        row_wise,
        tensor_wise,
        lambda i: tensor_wise(i) * qs[i][1].view(1, -1),
        *(lambda i, q=q: q(x) for q in quantizers),
    ]
    return [graph_time(run, layers) * 1e6 for run in runs]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.fp8_gemm", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="preset:llava-7b-shaped")
    p.add_argument("--rows", default="640,1024,2048", help="a prompt step's rows (default %(default)s)")
    p.add_argument("--layers", type=int, default=8, help="launches (distinct weights) per graph")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("python -m bench.fp8_gemm needs a CUDA GPU")
    quantizers = (torch.compile(fp8_rows), torch.compile(fp8_tensor))
    rows = []
    for m in (int(r) for r in args.rows.split(",")):
        for name, (n, k) in shapes(args.model).items():
            rows.append((m, name, *time_shape(n, k, m, args.layers, quantizers)))
            print(rows[-1], flush=True)
    print(
        "\n| rows | linear | bf16 us | row-wise us (x bf16) | tensor-wise us (x bf16) "
        "| tensor-wise, channel scale after, us (x bf16) | quantize rows us | quantize tensor us |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for m, name, b, r, t, ta, qr, qt in rows:
        print(f"| {m} | {name} | {b:.1f} | {r:.1f} ({r / b:.2f}) | {t:.1f} ({t / b:.2f}) | {ta:.1f} ({ta / b:.2f}) "
              f"| {qr:.1f} | {qt:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
