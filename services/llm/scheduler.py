"""The llm scheduler: a pure policy over requests and KV slots (CPU only, no torch).

Each step it admits waiting requests into free KV slots in QoS order (class, aged by
waiting time, then arrival) and decodes every running request once. The plan is the
contract with the model runner.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.metrics import QUEUE_DEPTH
from services.common.qos import AGING_S, effective_class
from services.llm.request import Request


class SlotPool:
    """KV cache rows. A request holds one row from prefill until it finishes."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._free = list(range(n - 1, -1, -1))

    def take(self) -> int:
        return self._free.pop()

    def give(self, slot: int) -> None:
        self._free.append(slot)

    @property
    def free(self) -> int:
        return len(self._free)


@dataclass
class Plan:
    prefill: list[Request] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(
        self, max_batch: int, aging_s: float = AGING_S, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.slots = SlotPool(max_batch)
        self._waiting: list[Request] = []
        self.running: list[Request] = []
        self.aging_s, self.clock = aging_s, clock

    def add(self, req: Request) -> None:
        self._waiting.append(req)
        QUEUE_DEPTH.labels("llm", req.qos.wire).inc()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def schedule(self) -> Plan:
        plan = Plan(decode=list(self.running))
        if not (self._waiting and self.slots.free):
            return plan
        now = self.clock()
        # Sorting a short queue when a slot is free costs less than keeping an aged heap.
        self._waiting.sort(key=lambda r: (effective_class(r.qos, now - r.arrival, self.aging_s), r.arrival))
        while self._waiting and self.slots.free:
            req = self._waiting.pop(0)
            QUEUE_DEPTH.labels("llm", req.qos.wire).dec()
            if req.aborted:
                continue
            req.slot = self.slots.take()
            plan.prefill.append(req)
            self.running.append(req)
        return plan

    def finish(self, req: Request) -> None:
        """Free a request's slot (finished, aborted or failed)."""
        if req.slot >= 0:
            self.running.remove(req)
            self.slots.give(req.slot)
            req.slot = -1

    def drop_waiting(self, request_id: str) -> Request | None:
        for i, req in enumerate(self._waiting):
            if req.id == request_id:
                self._waiting.pop(i)
                QUEUE_DEPTH.labels("llm", req.qos.wire).dec()
                return req
        return None

    def all_waiting(self) -> list[Request]:
        return list(self._waiting)
