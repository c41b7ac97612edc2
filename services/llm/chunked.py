"""The per-chunk prefill's staged inputs (`--prefill chunks`, the CPU's default and the reference;
its forward is the runner's, one SDPA per chunk: services/llm/attention.py `prefill_attention`)."""

from __future__ import annotations

import numpy as np

from services.llm.attention import Span
from services.llm.kv_cache import pool_slots
from services.llm.scheduler import Chunk
from services.llm.staging import Staging


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
