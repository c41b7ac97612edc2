"""Which engine serves: the one place that names the Engine implementations."""

from __future__ import annotations

import torch

from services.common.errors import InvalidArgument
from services.llm.config import ENGINES, NativeEngineConfig
from services.llm.interface import Engine
from services.model.prompt import PromptBuilder
from services.model.spec import ModelSpec


def check_engine(name: str, spec: ModelSpec) -> None:
    """INVALID_ARGUMENT where the named engine cannot serve the checkpoint's family."""
    if name == "vllm" and spec.text.mrope_section is not None:
        raise InvalidArgument(
            f"{spec.model_dir}: --llm-engine vllm cannot serve {spec.family}: its decoder turns picture tokens "
            "by their grid (M-RoPE), which the prompt embeddings handed to vLLM cannot carry; use --llm-engine native"
        )


def build_engine(
    name: str,
    prompts: PromptBuilder,
    device: torch.device,
    dtype: torch.dtype,
    max_batch: int,
    default_max_tokens: int,
    vllm_kv_cache_gib: float = 0.0,
    native: NativeEngineConfig | None = None,
) -> Engine:
    """Load the named engine's weights and start it; ValueError for an unknown name."""
    spec = prompts.spec
    if name == "vllm":
        from services.llm.vllm_engine import VllmEngine

        check_engine(name, spec)

        engine: Engine = VllmEngine(spec, dtype, max_batch, prompts, default_max_tokens, vllm_kv_cache_gib)
    elif name == "native":
        engine = build_native(prompts, device, dtype, max_batch, default_max_tokens, native)
    else:
        raise ValueError(f"--llm-engine {name!r}: use one of {', '.join(ENGINES)}")
    engine.start()
    return engine


def build_native(
    prompts: PromptBuilder,
    device: torch.device,
    dtype: torch.dtype,
    max_batch: int,
    default_max_tokens: int,
    cfg: NativeEngineConfig | None = None,
):
    """The native engine (weights loaded, KV pool sized, decode captured on CUDA), not yet started."""
    from services.llm.engine import NativeEngine
    from services.llm.kv_cache import KvConfig
    from services.llm.runner import ModelRunner, RunnerConfig

    cfg = cfg or NativeEngineConfig()
    kv = KvConfig(cfg.page_size(device.type), cfg.kv_cache_gib, cfg.gpu_memory_utilization)
    packed = None if cfg.prefill == "auto" else cfg.prefill == "packed"
    runner_cfg = RunnerConfig(
        max_batch, kv, cfg.max_prefill_tokens, cfg.enforce_eager, cfg.quantize, packed, cfg.skinny_gemv
    )
    runner = ModelRunner(prompts.spec, device, dtype, runner_cfg)
    return NativeEngine(
        runner, max_batch, prompts, default_max_tokens, cfg.max_prefill_tokens, cfg.prefix_cache, cfg.step_trace
    )
