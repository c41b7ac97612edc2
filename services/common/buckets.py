"""CUDA graphs by size: the batch sizes they are captured for, and the capture itself (the llm's
decode and packed steps, the vision tower)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """Powers of two below max_batch, and max_batch itself: a batch of n runs as the smallest >= n."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return [*sizes, max_batch]


def capture_graphs(
    sizes: Iterable, run: Callable, what: str, stream=None, pool=None, error_mode: str = "global"
) -> dict:
    """{size: torch.cuda.CUDAGraph} of `run(size)`, largest first, all in one memory pool.

    A size is a batch, or any key that sorts (the packed step's (rows, decode rows)).

    Each size runs twice on a side stream first (the compile, then a run outside the capture),
    as CUDA graph capture needs. `run` must read and write only static buffers, with no host
    syncs. Raises what compiling or capturing raised.

    `stream`: capture on it (default: a side stream of the current device). `pool`: a
    `torch.cuda.graph_pool_handle()` that earlier captures used too (default: a new one).
    `error_mode`: torch.cuda.graph's capture_error_mode; "thread_local" where other threads may
    use the device during the capture (a capture while serving).
    """
    import torch  # here: services/common is imported by the launcher, which loads no torch

    start = time.perf_counter()
    pool, stream = pool or torch.cuda.graph_pool_handle(), stream or torch.cuda.Stream()
    graphs = {}
    for size in sorted(sizes, reverse=True):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                run(size)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=error_mode):
            run(size)
        graphs[size] = graph
        log.info("%s captured for %s (%.1f s so far)", what, size, time.perf_counter() - start)
    torch.cuda.synchronize()
    return graphs
