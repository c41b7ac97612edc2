"""vLLM's KV space, sized from the llm's own config (no vLLM needed)."""

from __future__ import annotations

import torch

from services.llm.runner import ModelRunner
from services.llm.vllm_engine import kv_cache_bytes
from services.model.spec import load_spec
from tests.helpers import ROOT


def test_kv_space_is_what_the_native_engine_allocates_for_the_same_batch():
    spec = load_spec(ROOT / "models" / "demo")
    runner = ModelRunner(spec, torch.device("cpu"), torch.float32, slots=3)
    allocated = sum(t.numel() * t.element_size() for t in (runner.k_cache, runner.v_cache))
    assert kv_cache_bytes(spec, torch.float32, 3) == allocated
    assert kv_cache_bytes(spec, torch.bfloat16, 6) == allocated  # half the bytes, twice the sequences
