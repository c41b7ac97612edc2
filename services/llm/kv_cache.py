"""The paged KV pool: its tensors, and how many pages it gets at start-up.

Layout: per layer, k and v [g, n_pages * page_size, d] (g kv heads, d head dim). Page p holds
positions [p * page_size, (p + 1) * page_size) of whichever sequence owns it. Each layer's
tensors are their own allocations (not views of one block), so a compiled decode step
writes into them in place. `flex_attention` reads them as [1, g, S, d], the pages picked by
a block mask built from each sequence's block table.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from services.model.spec import ModelSpec

log = logging.getLogger(__name__)

GIB = 2**30
# Left free on the device after sizing: CUDA graphs, the sampler's scratch, other processes' growth.
HEADROOM_BYTES = 2 * GIB


@dataclass(frozen=True)
class KvConfig:
    page_size: int  # positions per page
    kv_cache_gib: float  # 0: sized automatically
    gpu_memory_utilization: float  # the share of the GPU this process may hold (weights + activations + KV)


def pool_slots(blocks: list[int], positions: np.ndarray, page_size: int) -> np.ndarray:
    """Pool positions of a sequence's `positions`, through its block table `blocks`."""
    return np.asarray(blocks, dtype=np.int64)[positions // page_size] * page_size + positions % page_size


def pool_slot(blocks: list[int], position: int, page_size: int) -> int:
    """`pool_slots` of one position, without arrays (a decode's, once a step)."""
    return blocks[position // page_size] * page_size + position % page_size


def page_bytes(spec: ModelSpec, dtype: torch.dtype, page_size: int) -> int:
    """Bytes of one page: K and V, every layer."""
    t = spec.text
    return 2 * t.layers * t.kv_heads * page_size * t.head_dim * torch.empty((), dtype=dtype).element_size()


def pool_pages(
    spec: ModelSpec, dtype: torch.dtype, device: torch.device, cfg: KvConfig, max_batch: int, own_bytes: int
) -> int:
    """Pages for the pool, the reserved null page included.

    `--kv-cache-gib` gives the size. Otherwise, on the CPU: `max_batch` sequences of the
    whole context. On a GPU: what `gpu_memory_utilization` of the device leaves after this
    process's own peak so far (`own_bytes`: weights and a warm-up prefill), never more than
    is free now less some headroom, and never more than `max_batch` full-context sequences
    can use (a request reserves its pages at admission, so more would sit idle).
    """
    per_page = page_bytes(spec, dtype, cfg.page_size)
    seq_pages = -(-spec.text.max_context // cfg.page_size)
    useful = max_batch * seq_pages + 1
    if cfg.kv_cache_gib > 0:
        pages = int(cfg.kv_cache_gib * GIB) // per_page
        source = f"--kv-cache-gib {cfg.kv_cache_gib:g}"
    elif device.type != "cuda":
        pages = useful
        source = f"--max-llm-batch {max_batch} x context {spec.text.max_context}"
    else:
        free, total = torch.cuda.mem_get_info(device)
        budget = min(cfg.gpu_memory_utilization * total - own_bytes, free - HEADROOM_BYTES)
        pages = min(useful, max(0, int(budget)) // per_page)
        source = (
            f"--gpu-memory-utilization {cfg.gpu_memory_utilization:g} of {total / GIB:.1f} GiB, "
            f"{own_bytes / GIB:.1f} GiB already held, {free / GIB:.1f} GiB free"
        )
    if pages - 1 < seq_pages:
        raise ValueError(
            f"the KV pool ({source}) has room for {max(0, pages - 1)} pages of {cfg.page_size} positions; one "
            f"sequence of the model's full context ({spec.text.max_context}) needs {seq_pages}: raise "
            "--kv-cache-gib or --gpu-memory-utilization, or lower --max-llm-batch"
        )
    log.info(
        "KV pool: %d pages of %d positions (%.2f GiB, %d full-context sequences), from %s",
        pages,
        cfg.page_size,
        pages * per_page / GIB,
        (pages - 1) // seq_pages,
        source,
    )
    return pages


class PagedKvCache:
    """k[layer], v[layer]: [g, n_pages * page_size, d] each, views of one pool
    [2, layers, g, n_pages * page_size, d]."""

    def __init__(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype, n_pages: int, page_size: int) -> None:
        t = spec.text
        self.n_pages, self.page_size = n_pages, page_size
        # One tensor, so that a page is copied across every layer in one op (copy_page). Zeros, not
        # empty: padding rows of a captured batch read the null page, and garbage there could hold
        # NaN (harmless to other rows, but noisy to debug).
        self.pool = torch.zeros((2, t.layers, t.kv_heads, n_pages * page_size, t.head_dim), device=device, dtype=dtype)
        self.k, self.v = list(self.pool[0]), list(self.pool[1])  # each layer's view is contiguous

    def copy_page(self, src: int, dst: int, positions: int) -> None:
        """Copy the first `positions` positions of page `src` into page `dst`, in every layer (queued on
        the current stream: a prefix-cache part, services/llm/prefix.py). One copy for all layers: a
        slice and a copy per layer were the engine thread's largest Python cost under load (docs/PERF.md)."""
        s, d = src * self.page_size, dst * self.page_size
        self.pool[..., d : d + positions, :].copy_(self.pool[..., s : s + positions, :])
