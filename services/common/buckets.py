"""The batch sizes CUDA graphs are captured for (the llm's decode step, the vision tower)."""

from __future__ import annotations


def batch_buckets(max_batch: int) -> list[int]:
    """Powers of two below max_batch, and max_batch itself: a batch of n runs as the smallest >= n."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return [*sizes, max_batch]
