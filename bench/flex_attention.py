"""Probe `flex_attention` over a paged pool on CUDA: the decode kernel's block layout, prefill kernel options.

Each case runs `--layers` calls (one pool per layer, so nothing is served from L2) in one CUDA
graph and reports microseconds per call, beside the KV floor (bytes over 4.3 TB/s) and the
largest difference from SDPA on the same keys gathered contiguously.
- decode, q of length 1, `b` sequences of `ctx` positions on random pages of 128:
  `full+partial` marks every page before the last a full block (the engine's layout before
  the H200 showed that flex's decode kernel splits full blocks by the pool's length, so a
  sequence's pages all ran on one CTA per head); `partial` marks every page partial, with the
  mask keeping all of a page but the last (the engine's layout now).
  Then the partial layout at batches 1-8 with `SPLIT_KV` set (flex's own choice is 2 x SMs /
  (batch x heads), 1 from batch 8).
- prefill, one 608-position prompt (W1's) causal over its pages, with flex's default kernel
  options and others, and cuDNN / flash SDPA on contiguous keys for reference.

    python -m bench.flex_attention [--layers 32] [--pages 300]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

H, D, PAGE = 32, 128, 128
PREFILL_OPTIONS = {
    "default": None,
    "M64 N64": {"BLOCK_M": 64, "BLOCK_N": 64},
    "M128 N128 w8": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8},
    "M64 N128 w4 s2": {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2},
    "M128 N64 w8 s2": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
}


class Probe:
    def __init__(self, layers: int, pages: int) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.recompile_limit = 256  # one compile per case
        torch._dynamo.config.accumulated_recompile_limit = 4096
        self.layers, self.pages, self.span = layers, pages, pages * PAGE
        self.k = [torch.randn(H, self.span, D, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
        self.v = [torch.randn(H, self.span, D, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
        self.flex = torch.compile(flex_attention, dynamic=False)
        self.rows: list[tuple[str, str, float, float, float]] = []

    def graph_us(self, fn, reps: int = 20) -> float:
        """Microseconds per layer call of `fn` (which runs every layer), replayed from a CUDA graph."""
        fn()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / reps / self.layers * 1e6

    def gathered(self, i: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values at pool positions `slots` [b, L] -> [b, h, L, d]."""
        return self.k[i][:, slots].transpose(0, 1), self.v[i][:, slots].transpose(0, 1)

    def decode(self, b: int, ctx: int, layout: str, split: int | None = None) -> None:
        from torch.nn.attention.flex_attention import BlockMask

        n = -(-ctx // PAGE)
        tables = torch.stack([torch.randperm(self.pages, device="cuda")[:n] for _ in range(b)])
        last = torch.full((b,), (ctx - 1) // PAGE, device="cuda")
        offset = torch.full((b,), (ctx - 1) % PAGE, device="cuda")
        last_page = tables.gather(1, last[:, None])[:, 0]
        i32 = {"dtype": torch.int32, "device": "cuda"}
        kv_idx = torch.zeros(b, 1, 1, self.pages, **i32)
        common = {"BLOCK_SIZE": (128, PAGE), "seq_lengths": (1, self.span), "compute_q_blocks": False}
        if layout == "full+partial":
            kv_idx[:, 0, 0, 0] = last_page
            full_idx = torch.zeros(b, 1, 1, self.pages, **i32)
            full_idx[:, 0, 0, :n] = tables
            mask = BlockMask.from_kv_blocks(
                torch.ones(b, 1, 1, **i32),
                kv_idx,
                last.to(torch.int32).view(b, 1, 1),
                full_idx,
                mask_mod=lambda z, h, q, kv: kv % PAGE <= offset[z],
                **common,
            )
        else:
            kv_idx[:, 0, 0, :n] = tables
            mask = BlockMask.from_kv_blocks(
                (last + 1).to(torch.int32).view(b, 1, 1),
                kv_idx,
                mask_mod=lambda z, h, q, kv: (kv // PAGE != last_page[z]) | (kv % PAGE <= offset[z]),
                **common,
            )
        q = torch.randn(b, H, 1, D, device="cuda", dtype=torch.bfloat16)
        out = []

        options = {"SPLIT_KV": split} if split else None  # CTAs per (sequence, head); flex's own choice if None

        def run():
            out[:] = [
                self.flex(q, self.k[i][None], self.v[i][None], block_mask=mask, kernel_options=options)
                for i in range(self.layers)
            ]

        us = self.graph_us(run)
        slots = (tables[:, :, None] * PAGE + torch.arange(PAGE, device="cuda")).flatten(1)[:, :ctx]
        ref = F.scaled_dot_product_attention(q, *self.gathered(self.layers - 1, slots))
        err = (out[-1].float() - ref.float()).abs().max().item()
        variant = f"{layout}, SPLIT_KV {split or 'auto'}"
        self.rows.append((f"decode b={b} ctx={ctx}", variant, us, b * ctx * H * D * 4 / 4.3e12 * 1e6, err))

    def prefill(self, n: int, label: str) -> None:
        from torch.nn.attention.flex_attention import BlockMask

        rows, pages = -(-n // 128) * 128, -(-n // PAGE)
        held = torch.randperm(self.pages, device="cuda")[:pages]
        logical = torch.full((self.pages,), -1, device="cuda")
        logical[held] = torch.arange(pages, device="cuda")
        blocks = rows // 128
        i32 = {"dtype": torch.int32, "device": "cuda"}
        kv_idx = torch.zeros(1, 1, blocks, self.pages, **i32)
        full_num = torch.zeros(1, 1, blocks, **i32)
        full_idx = torch.zeros(1, 1, blocks, self.pages, **i32)
        for i in range(blocks):  # query block i: its diagonal page partial, the pages before it full
            kv_idx[0, 0, i, 0] = held[min(i, pages - 1)]
            full_num[0, 0, i] = min(i, pages)
            full_idx[0, 0, i, : min(i, pages)] = held[: min(i, pages)]

        def own_positions(z, h, q, kv):
            lp = logical[kv // PAGE]
            return (lp >= 0) & (lp * PAGE + kv % PAGE <= q) & (q < n)

        mask = BlockMask.from_kv_blocks(
            torch.ones(1, 1, blocks, **i32),
            kv_idx,
            full_num,
            full_idx,
            BLOCK_SIZE=(128, PAGE),
            mask_mod=own_positions,
            seq_lengths=(rows, self.span),
            compute_q_blocks=False,
        )
        q = torch.randn(rows, H, D, device="cuda", dtype=torch.bfloat16)
        options, out = PREFILL_OPTIONS[label], []

        def run():
            qh = q.transpose(0, 1)[None]  # [1, h, rows, d], as the packed step passes it
            out[:] = [
                self.flex(qh, self.k[i][None], self.v[i][None], block_mask=mask, kernel_options=options)
                for i in range(self.layers)
            ]

        us = self.graph_us(run)
        slots = (held[:, None] * PAGE + torch.arange(PAGE, device="cuda")).flatten()[None, :n]
        qc = q[:n].transpose(0, 1)[None]
        ref = F.scaled_dot_product_attention(qc, *self.gathered(self.layers - 1, slots), is_causal=True)
        err = (out[-1][:, :, :n].float() - ref.float()).abs().max().item()
        self.rows.append((f"prefill n={n}", f"flex {label}", us, 0.0, err))
        if label == "default":
            self.sdpa(qc, slots, n)

    def sdpa(self, qc: torch.Tensor, slots: torch.Tensor, n: int) -> None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kv = [[t.contiguous() for t in self.gathered(i, slots)] for i in range(4)]  # contiguous: cuDNN's best case
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):

            def run(backend=backend):
                with sdpa_kernel(backend):
                    for i in range(self.layers):
                        F.scaled_dot_product_attention(qc, *kv[i % 4], is_causal=True)

            self.rows.append((f"prefill n={n}", f"sdpa {backend.name}, contiguous", self.graph_us(run), 0.0, 0.0))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32, help="calls per graph, one pool each (default %(default)s)")
    parser.add_argument("--pages", type=int, default=300, help="pages of 128 positions per pool (default %(default)s)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.flex_attention needs a CUDA device")
    probe, t0 = Probe(args.layers, args.pages), time.perf_counter()
    for b, ctx in ((1, 600), (4, 600), (32, 600), (1, 2000)):
        for layout in ("full+partial", "partial"):
            probe.decode(b, ctx, layout)
    for b in (1, 2, 4, 8):  # flex picks 2 x SMs / (b x heads) splits, 1 from batch 8: does more pay?
        for split in (4, 8, 16):
            probe.decode(b, 600, "partial", split)
    for label in PREFILL_OPTIONS:
        probe.prefill(608, label)
    print(f"probe took {time.perf_counter() - t0:.0f} s")
    print("| case | variant | us per layer | KV floor us | max abs diff from SDPA |")
    print("| --- | --- | --- | --- | --- |")
    for case, variant, us, floor, err in probe.rows:
        print(f"| {case} | {variant} | {us:.1f} | {floor:.1f} | {err:.4f} |")


if __name__ == "__main__":
    main()
