"""The decode step: one token for each running sequence, over static buffers, graph-captured on CUDA.

Inputs live at fixed device addresses (the front of the runner's staging buffer): tokens
[B], positions [B], block tables [B, max_pages] and an EOS-ban flag [B] (under M-RoPE also
each sequence's rotary offset [B]), for B = the largest batch. A batch of n runs as the
smallest captured bucket b >= n (1, 2, 4, 8, ...); rows n..b are padding that reads and
writes only the null page. Outputs too are static: logits [B, V] (fp32) and greedy tokens
[B], so a step allocates nothing on the device.

Each layer runs through its decode attention's `run_layer` (services/llm/attention.py): on
CUDA one `torch.compile`d function around `flex_attention`'s paged kernel, the same for every
layer, so it compiles once per bucket. Each bucket's whole step is then captured in a CUDA
graph and replayed: one launch per step.
"""

from __future__ import annotations

import torch

from services.common.buckets import batch_buckets, capture_graphs
from services.llm.attention import DecodeAttention, page_slots
from services.llm.kv_cache import PagedKvCache
from services.model.llama import LlamaDecoder


def ban_eos(logits: torch.Tensor, eos: torch.Tensor | None, ban: torch.Tensor) -> None:
    """-inf on the EOS ids (eos [k]) of the rows whose flag (ban [n], int) is set: min_tokens not reached yet."""
    if eos is None:  # a model without EOS ids: nothing to ban
        return
    eos_logits = logits.index_select(1, eos)
    logits.index_copy_(1, eos, torch.where(ban[:, None].bool(), float("-inf"), eos_logits))


class DecodeStep:
    def __init__(
        self,
        model: LlamaDecoder,
        kv: PagedKvCache,
        attn: DecodeAttention,
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [max_context, d]
        inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],  # int32 device views
        eos: torch.Tensor | None,  # the model's EOS ids [k] on the device; None when it has none
        max_batch: int,
        delta: torch.Tensor | None = None,  # M-RoPE: each sequence's rotary offset [B] (services/model/mrope.py)
    ) -> None:
        self.model, self.kv, self.attn, self.rope, self.eos = model, kv, attn, rope, eos
        self.tokens, self.positions, self.tables, self.ban = inputs
        self.delta = delta
        device = self.tokens.device
        self.logits = torch.zeros(max_batch, model.lm_head.out_features, device=device)
        self.greedy = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.buckets = batch_buckets(max_batch)
        # A compiled layer keeps an entry per bucket (and per engine, in a process that builds
        # several, as the tests do): past dynamo's limit (8) it would fall back to eager flex,
        # which is wrong for this block mask and cannot be captured. Keep well clear of it.
        dynamo = torch._dynamo.config
        dynamo.cache_size_limit = max(dynamo.cache_size_limit, 64)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Set to a list to time each step on the device: (batch, start, end) CUDA events (the
        # events are read later, after the step's sync, so timing adds no sync of its own).
        self.timings: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] | None = None

    def bucket(self, n: int) -> int:
        """The batch a step of n sequences runs as: the smallest captured size >= n (n when not captured)."""
        if not self._graphs:
            return n
        return next(b for b in self.buckets if b >= n)

    @torch.inference_mode()
    def forward(self, b: int, max_len: int) -> None:
        """Rows [:b] of the inputs -> rows [:b] of `logits` and `greedy`. Capturable: no syncs, static shapes."""
        tokens = self.tokens[:b]
        positions = self.positions[:b].long()
        tables = self.tables[:b].long()
        rotary = positions if self.delta is None else positions + self.delta[:b].long()  # a decode is text
        cos, sin = self.rope[0][rotary], self.rope[1][rotary]  # [b, d]
        slots = page_slots(tables, positions, self.kv.page_size)
        self.attn.prepare(positions, tables, max_len)
        x = self.model.embed_tokens(tokens)  # [b, H]
        for i, layer in enumerate(self.model.layers):
            x = self.attn.run_layer(layer, x, cos, sin, self.kv.k[i], self.kv.v[i], slots)
        logits = self.logits[:b]
        logits.copy_(self.model.logits(x))
        ban_eos(logits, self.eos, self.ban[:b])
        torch.argmax(logits, dim=-1, out=self.greedy[:b])

    def run(self, n: int, max_len: int) -> None:
        """Run a step of n sequences (inputs filled and uploaded), as its bucket."""
        b = self.bucket(n)
        graph = self._graphs.get(b)
        if self.timings is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        if graph is None:
            self.forward(b, max_len)
        else:
            graph.replay()
        if self.timings is not None:
            end.record()
            self.timings.append((b, start, end))

    def capture(self, max_len: int, stream: torch.cuda.Stream | None = None) -> None:
        """Compile (on first use) and capture one graph per bucket (services/common/buckets.py),
        on `stream` when given (the decode lane's SMs).

        The inputs must hold valid rows (the null page: zeros do) while capturing.
        """
        run = lambda b: self.forward(b, max_len)  # noqa: E731
        self._graphs = capture_graphs(self.buckets, run, "decode step, batch", stream)
