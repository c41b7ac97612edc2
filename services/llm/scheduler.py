"""The llm scheduler: a pure policy over requests and KV slots (CPU only, no torch).

Each step it admits waiting requests into free KV slots in QoS order (class, then
arrival) and decodes every running request once. The plan is the contract with the
model runner.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from services.common.metrics import QUEUE_DEPTH
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
    def __init__(self, max_batch: int) -> None:
        self.slots = SlotPool(max_batch)
        self._waiting: list[tuple[tuple[int, float], int, Request]] = []
        self._seq = itertools.count()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        heapq.heappush(self._waiting, (req.sort_key(), next(self._seq), req))
        QUEUE_DEPTH.labels("llm", req.qos.wire).inc()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def schedule(self) -> Plan:
        plan = Plan(decode=list(self.running))
        while self._waiting and self.slots.free:
            _, _, req = heapq.heappop(self._waiting)
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
        for i, (_, _, req) in enumerate(self._waiting):
            if req.id == request_id:
                self._waiting.pop(i)
                QUEUE_DEPTH.labels("llm", req.qos.wire).dec()
                heapq.heapify(self._waiting)
                return req
        return None

    def all_waiting(self) -> list[Request]:
        return [req for _, _, req in self._waiting]
