"""Which engine serves: the one place that names the Engine implementations."""

from __future__ import annotations

import torch

from services.llm.config import ENGINES
from services.llm.interface import Engine
from services.model.prompt import PromptBuilder


def build_engine(
    name: str,
    prompts: PromptBuilder,
    device: torch.device,
    dtype: torch.dtype,
    max_batch: int,
    default_max_tokens: int,
    vllm_kv_cache_gib: float = 0.0,
) -> Engine:
    """Load the named engine's weights and start it; ValueError for an unknown name."""
    spec = prompts.spec
    if name == "vllm":
        from services.llm.vllm_engine import VllmEngine

        engine: Engine = VllmEngine(spec, dtype, max_batch, prompts, default_max_tokens, vllm_kv_cache_gib)
    elif name == "native":
        from services.llm.engine import NativeEngine
        from services.llm.runner import ModelRunner

        engine = NativeEngine(ModelRunner(spec, device, dtype, max_batch), max_batch, prompts, default_max_tokens)
    else:
        raise ValueError(f"--llm-engine {name!r}: use one of {', '.join(ENGINES)}")
    engine.start()
    return engine
