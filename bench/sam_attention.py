"""SAM's attention two ways on CUDA: the augmented dot product SDPA runs (SamAttention) against
FlexAttention with a score_mod that adds the decomposed relative positions.

The shapes are deepseek-vl-7b's SAM ViT-B/16 at 1024 px: a global layer attends over the whole
64x64 grid, a windowed one over 25 windows of 14x14 a picture. Each way is compiled; the table
gives the device time of one layer's attention (qkv to proj) per picture, p50 of `--steps`, and
each way's relative error against the augmented way in fp32.

    python -m bench.sam_attention [--batch 1] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.nn.attention.flex_attention import flex_attention

from services.model.deepseek_vl import SamAttention


def flex_forward(attn: SamAttention, x: torch.Tensor) -> torch.Tensor:
    """SamAttention's result, the bias added to the scaled score inside the flex kernel."""
    b, h, w, _ = x.shape
    q, k, v = attn.qkv(x).view(b, h, w, 3, attn.heads, -1).permute(3, 0, 4, 1, 2, 5).unbind(0)  # [B, nh, H, W, C]
    rel_h = torch.einsum("bnhwc,hkc->bnhwk", q, attn._table(attn.rel_pos_h, h)).flatten(2, 3)  # [B, nh, N, H]
    rel_w = torch.einsum("bnhwc,wkc->bnhwk", q, attn._table(attn.rel_pos_w, w)).flatten(2, 3)  # [B, nh, N, W]

    def bias(score, bi, hi, qi, ki):
        return score + rel_h[bi, hi, qi, ki // w] + rel_w[bi, hi, qi, ki % w]

    out = flex_attention(q.flatten(2, 3), k.flatten(2, 3), v.flatten(2, 3), score_mod=bias, scale=attn.scale)
    out = out.view(b, attn.heads, h, w, -1).permute(0, 2, 3, 1, 4).reshape(b, h, w, -1)
    return attn.proj(out)


def device_ms(fn, x: torch.Tensor, steps: int) -> float:
    for _ in range(5):
        fn(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(steps):
        start.record()
        fn(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    from transformers import SamVisionConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1, help="pictures")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    cfg = SamVisionConfig(hidden_size=768, num_attention_heads=12, image_size=1024, patch_size=16, qkv_bias=True)
    rows = []
    for name, window, shape in (
        ("global 64x64", 0, (args.batch, 64, 64, 768)),
        ("windows 25x14x14", 14, (args.batch * 25, 14, 14, 768)),
    ):
        torch.manual_seed(0)
        attn = SamAttention(cfg, window).cuda()
        with torch.no_grad():
            attn.rel_pos_h.normal_(0, 0.5)
            attn.rel_pos_w.normal_(0, 0.5)
        x = torch.randn(shape, device="cuda")
        with torch.no_grad():
            want = attn(x)[0]
            flex32 = torch.compile(lambda t, a=attn: flex_forward(a, t))(x)
            err = ((flex32 - want).norm() / want.norm()).item()
            attn = attn.to(torch.bfloat16)
            xb = x.to(torch.bfloat16)
            sdpa = torch.compile(lambda t, a=attn: a(t)[0])
            flex = torch.compile(lambda t, a=attn: flex_forward(a, t))
            t_sdpa = device_ms(sdpa, xb, args.steps) / args.batch
            t_flex = device_ms(flex, xb, args.steps) / args.batch
        rows.append((name, t_sdpa, t_flex, err))
    print("| layer | augmented SDPA ms/picture | flex ms/picture | flex/SDPA | flex err (fp32) |")
    print("| --- | --- | --- | --- | --- |")
    for name, a, f, err in rows:
        print(f"| {name} | {a:.3f} | {f:.3f} | {f / a:.2f} | {err:.1e} |")


if __name__ == "__main__":
    main()
