"""The llm scheduler: a pure policy over requests and KV slots (no torch, no metrics).

Each step it admits waiting requests into free KV slots in QoS order (class, aged by
waiting time, then arrival) and decodes every running request once. The plan is the
contract with the model runner, and it says what happened (admitted, preempted); the
engine records it. The scheduler alone changes a request's place in line: its queue
position and its slot.

Preemption: when every slot is taken and a realtime request heads the queue, the scheduler
takes the slot of a running best-effort request that still competes below it (a best-effort
request ages into the realtime class after 2 x AGING_S, and from then on is not preempted,
so none is preempted forever). The victim is the one with the fewest generated tokens (the
least work lost). It goes back to the queue with its tokens and is resumed by recomputation:
its next prefill runs over the prompt and every token it has generated.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.qos import AGING_S, QosLevel, effective_class
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
    prefill: list[Request] = field(default_factory=list)  # new, or resumed after preemption
    decode: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

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
        # Waiting requests per class, kept as the queue changes (read by the engine's gauges).
        self.waiting_by_qos: Counter[QosLevel] = Counter()

    def add(self, req: Request) -> None:
        self._waiting.append(req)
        self.waiting_by_qos[req.qos] += 1

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def schedule(self) -> Plan:
        plan = Plan()
        if self._waiting and (self.slots.free or self._realtime_waiting()):
            now = self.clock()
            # Sorting a short queue when a slot is free costs less than keeping an aged heap.
            self._waiting.sort(key=lambda r: (self._class(r, now), r.arrival))
            while self._waiting:
                req = self._waiting[0]
                if req.aborted:
                    self._pop()
                    continue
                if not self.slots.free:
                    victim = self._victim(req, now)
                    if victim is None:
                        break
                    self._preempt(victim, now)
                    plan.preempted.append(victim)
                self._pop()
                req.slot = self.slots.take()
                plan.prefill.append(req)
                self.running.append(req)
        plan.decode = [r for r in self.running if r not in plan.prefill]
        return plan

    def _class(self, req: Request, now: float) -> int:
        return effective_class(req.qos, now - req.arrival, self.aging_s)

    def _realtime_waiting(self) -> bool:
        return any(r.qos is QosLevel.REALTIME for r in self._waiting)

    def _pop(self, index: int = 0) -> Request:
        req = self._waiting.pop(index)
        self.waiting_by_qos[req.qos] -= 1
        return req

    def _victim(self, head: Request, now: float) -> Request | None:
        """A running best-effort request that a realtime `head` may preempt, or None."""
        if head.qos is not QosLevel.REALTIME:
            return None
        rank = self._class(head, now)
        candidates = [
            r for r in self.running if r.qos is QosLevel.BEST_EFFORT and self._class(r, now) > rank and not r.aborted
        ]
        return min(candidates, key=lambda r: (len(r.output_ids), -r.arrival), default=None)

    def _preempt(self, req: Request, now: float) -> None:
        """Free a running request's slot and queue it again; it resumes by recomputation.

        Its KV state is the runner's to reset (the engine tells it, from the plan).
        """
        self.running.remove(req)
        self.slots.give(req.slot)
        req.slot = -1
        req.preempted_at.append(now)
        self.add(req)

    def finish(self, req: Request) -> None:
        """Free a request's slot (finished, aborted or failed)."""
        if req.slot >= 0:
            self.running.remove(req)
            self.slots.give(req.slot)
            req.slot = -1

    def drop_waiting(self, request_id: str) -> Request | None:
        for i, req in enumerate(self._waiting):
            if req.id == request_id:
                return self._pop(i)
        return None

    def all_waiting(self) -> list[Request]:
        return list(self._waiting)
