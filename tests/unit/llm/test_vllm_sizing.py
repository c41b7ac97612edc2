"""vLLM's KV space, sized from the llm's own config (no vLLM needed)."""

from __future__ import annotations

import torch

from services.llm.kv_cache import KvConfig, page_bytes, pool_pages
from services.llm.vllm_engine import kv_cache_bytes
from services.model.spec import load_spec
from tests.helpers import ROOT


def test_kv_space_is_what_the_native_engine_allocates_for_the_same_batch():
    spec = load_spec(ROOT / "models" / "demo")
    cpu, page = torch.device("cpu"), 16
    pages = pool_pages(spec, torch.float32, cpu, KvConfig(page, 0.0, 0.6), max_batch=3, own_bytes=0)
    usable = (pages - 1) * page_bytes(spec, torch.float32, page)  # the native pool keeps one page in reserve
    assert kv_cache_bytes(spec, torch.float32, 3) == usable
    assert kv_cache_bytes(spec, torch.bfloat16, 6) == usable  # half the bytes, twice the sequences
