"""Where one request's time went: one typed value, in seconds, from the stage that measures
it to the client, the metrics, the gateway's admission and the benchmark.

Each service fills the stages it runs; the gateway merges them and adds its own. Only the
wire (vlmesh.v1.StageTimings) carries milliseconds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vlmesh.v1 import common_pb2 as pb


@dataclass(frozen=True)
class Timings:
    admission: float = 0.0  # gateway: validation and admission
    vision_queue: float = 0.0  # vision: waiting for a batch
    preprocess: float = 0.0  # vision: decode, resize, normalize
    vision: float = 0.0  # vision: ViT + projector forward
    handoff: float = 0.0  # export into the arena + import by the llm
    llm_queue: float = 0.0  # llm: waiting for a batch slot
    prefill: float = 0.0
    decode: float = 0.0
    ttft: float = 0.0  # gateway: request received to first token sent
    total: float = 0.0  # gateway: request received to final message

    @property
    def queue(self) -> float:
        """All the waiting: admission and both services' queues."""
        return self.admission + self.vision_queue + self.llm_queue

    def merge(self, other: Timings) -> Timings:
        """Stage by stage sums: each service measures its own stages (the hand-off has two halves)."""
        return Timings(*(getattr(self, n) + getattr(other, n) for n in _NAMES))

    def replace(self, **stages: float) -> Timings:
        return dataclasses.replace(self, **stages)

    def to_pb(self) -> pb.StageTimings:
        return pb.StageTimings(**{ms: getattr(self, n) * 1000 for n, ms in zip(_NAMES, _WIRE, strict=True)})

    @classmethod
    def from_pb(cls, t: pb.StageTimings) -> Timings:
        return cls(*(getattr(t, ms) / 1000 for ms in _WIRE))


# Field names, and the wire's: per request, not dataclasses.asdict/astuple (deep copies, 10x the time).
_NAMES = tuple(f.name for f in dataclasses.fields(Timings))
_WIRE = tuple(f"{n}_ms" for n in _NAMES)
