"""Sampling parameters: validation (gateway and llm alike) and the resolved form."""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.errors import InvalidArgument
from vlmesh.v1 import common_pb2 as pb

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


@dataclass(frozen=True)
class Sampling:
    max_tokens: int | None  # None: as many as the default and the context allow
    temperature: float  # 0 = greedy
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    min_tokens: int
    ignore_eos: bool

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check_sampling(p: pb.SamplingParams, max_context: int) -> Sampling:
    """Validate what a client sent; INVALID_ARGUMENT names the field and the allowed range."""
    max_tokens = p.max_tokens if p.HasField("max_tokens") else None
    if max_tokens is not None and not 1 <= max_tokens < max_context:
        raise InvalidArgument(
            f"sampling.max_tokens={max_tokens} is out of range: use 1..{max_context - 1} "
            f"(the model's context is {max_context} tokens, prompt included), or leave it unset"
        )
    temperature = p.temperature if p.HasField("temperature") else 0.0
    if not math.isfinite(temperature) or not 0.0 <= temperature <= 100.0:
        raise InvalidArgument(f"sampling.temperature={temperature} is out of range: use 0 (greedy) to 100")
    top_p = p.top_p if p.HasField("top_p") else 1.0
    if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise InvalidArgument(f"sampling.top_p={top_p} is out of range: use a value in (0, 1]")
    if len(p.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"sampling.stop has {len(p.stop)} strings; at most {MAX_STOP_STRINGS}")
    for i, s in enumerate(p.stop):
        if not s or len(s) > MAX_STOP_CHARS:
            raise InvalidArgument(f"sampling.stop[{i}] must be 1..{MAX_STOP_CHARS} characters")
    if max_tokens is not None and p.min_tokens > max_tokens:
        raise InvalidArgument(f"sampling.min_tokens={p.min_tokens} exceeds max_tokens={max_tokens}")
    return Sampling(
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        seed=p.seed if p.HasField("seed") else None,
        stop=tuple(p.stop),
        min_tokens=p.min_tokens,
        ignore_eos=p.ignore_eos,
    )
