"""The per-chunk prefill (`--prefill chunks`, the CPU's default and the reference): its staged
inputs and its forward, one SDPA per chunk (services/llm/attention.py `prefill_attention`); and
the warm-up prefill that measures what the largest prefill takes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from services.llm.attention import Span, prefill_attention
from services.llm.kv_cache import PagedKvCache, pool_slots
from services.llm.scheduler import Chunk
from services.llm.staging import Staging

if TYPE_CHECKING:
    from services.llm.runner import ModelRunner


def stage_chunks(chunks: list[Chunk], staging: Staging, page_size: int):
    """A per-chunk prefill's inputs, into the staging buffer: ids, positions, pool slots, each chunk's
    span (with the pool positions it reads when it continues its sequence), and the sampled rows
    and their EOS bans (None when no chunk completes)."""
    ids, positions, slots, spans, last_rows, bans = [], [], [], [], [], []
    row = 0
    for c in chunks:
        req = c.req
        seq = req.prompt_ids + req.output_ids if req.output_ids else req.prompt_ids
        ids.extend(seq[c.start : c.end])
        pos = np.arange(c.start, c.end)
        positions.append(pos)
        slots.append(pool_slots(req.blocks, pos, page_size))
        context = None
        if c.start > 0:  # attends to earlier positions, already in the pool
            context = staging.ints(pool_slots(req.blocks, np.arange(c.end), page_size))
        spans.append(Span(row, c.end - c.start, c.start, context))
        row += c.end - c.start
        if c.completes:
            last_rows.append(row - 1)
            bans.append(len(req.output_ids) < req.sampling.min_tokens)
    return (
        staging.ints(ids),
        staging.ints(np.concatenate(positions)),
        staging.ints(np.concatenate(slots)),
        spans,
        staging.ints(last_rows) if last_rows else None,
        staging.ints(bans) if last_rows else None,
    )


def forward(runner: ModelRunner, kv: PagedKvCache, x: torch.Tensor, positions, slots, spans: list[Span]):
    """Packed chunks x [N, H] at `positions` [N], stored at pool positions `slots` [N] of `kv` -> hidden [N, H]."""
    cos, sin = runner.rope[0][positions], runner.rope[1][positions]
    for i, layer in enumerate(runner.model.layers):
        k_pool, v_pool = kv.k[i], kv.v[i]
        q, k, v = runner.prefill_in(layer, x, cos, sin, k_pool, v_pool, slots)
        x = runner.prefill_out(layer, x, prefill_attention(q, k, v, k_pool, v_pool, spans))
    return x


def warm_up(runner: ModelRunner, tokens: int) -> int:
    """Run a prefill of `tokens` positions on a small pool; return this process's peak memory.

    What the weights and the largest prefill take is what the KV pool must leave free.
    """
    device, page = runner.device, runner.page_size
    torch.cuda.reset_peak_memory_stats(device)
    per_seq = min(tokens, runner.max_context)
    kv = PagedKvCache(runner.spec, device, runner.dtype, -(-per_seq // page) + 1, page)
    spans, row = [], 0
    while row < tokens:
        n = min(per_seq, tokens - row)
        spans.append(Span(row, n, 0, None))
        row += n
    positions = torch.cat([torch.arange(s.length, device=device) for s in spans])
    with torch.inference_mode():
        x = runner.model.embed_tokens(torch.zeros(tokens, dtype=torch.int64, device=device))
        runner.model.logits(forward(runner, kv, x, positions, positions + page, spans)[-1:])
        # A one-token prefill too: compiled code specialises a size of 1, and that compile
        # belongs before `ready`, not in the middle of serving.
        forward(runner, kv, x[:1], positions[:1], positions[:1] + page, [Span(0, 1, 0, None)])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device)
    del kv
    torch.cuda.empty_cache()
    return peak
