"""Sampling parameters in their resolved form (validated by services/common/validation.py)."""

from __future__ import annotations

from dataclasses import dataclass

from vlmesh.v1 import common_pb2 as pb


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

    def to_pb(self) -> pb.SamplingParams:
        """The normalised parameters, as the gateway forwards them downstream."""
        out = pb.SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            stop=list(self.stop),
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
        )
        if self.max_tokens is not None:
            out.max_tokens = self.max_tokens
        if self.seed is not None:
            out.seed = self.seed
        return out
