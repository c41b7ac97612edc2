"""The paged KV pool: a prefix part's page copy reaches every layer's K and V, and nothing else."""

from __future__ import annotations

import types

import torch

from services.llm.kv_cache import PagedKvCache

PAGE, PAGES = 4, 6


def pool() -> PagedKvCache:
    text = types.SimpleNamespace(layers=3, kv_heads=2, head_dim=5)
    kv = PagedKvCache(types.SimpleNamespace(text=text), torch.device("cpu"), torch.float32, PAGES, PAGE)
    gen = torch.Generator().manual_seed(0)
    for t in (*kv.k, *kv.v):  # through the layers' views, as the attention writes them
        t.copy_(torch.randn(t.shape, generator=gen))
    return kv


def test_copy_page_moves_the_first_positions_of_a_page_in_every_layer_and_nothing_else():
    kv = pool()
    before = [t.clone() for t in (*kv.k, *kv.v)]
    kv.copy_page(src=4, dst=1, positions=3)
    for got, was in zip((*kv.k, *kv.v), before, strict=True):
        want = was.clone()
        want[:, 1 * PAGE : 1 * PAGE + 3] = was[:, 4 * PAGE : 4 * PAGE + 3]
        assert torch.equal(got, want)  # the 4th position of page 1 and every other page as they were


def test_each_layer_is_a_contiguous_view_of_one_pool():
    kv = pool()
    assert len(kv.k) == len(kv.v) == 3
    for t in (*kv.k, *kv.v):
        assert t.shape == (2, PAGES * PAGE, 5) and t.is_contiguous()
    kv.k[2][1, 7, 4] = 123.0
    assert kv.pool[0, 2, 1, 7, 4] == 123.0 and kv.v[2][1, 7, 4] != 123.0
