"""The llm scheduler's order: class first, arrival within a class, and aging against starvation."""

from __future__ import annotations

from services.common.qos import QosLevel, effective_class
from services.llm.scheduler import Scheduler


class FakeRequest:
    def __init__(self, rid: str, qos: QosLevel, arrival: float) -> None:
        self.id, self.qos, self.arrival = rid, qos, arrival
        self.aborted, self.slot = False, -1


def drain_order(sched: Scheduler, clock: list[float], step_s: float) -> list[str]:
    """Admit one request per step (one slot), finishing it at once; return the admission order."""
    order = []
    while sched.waiting:
        plan = sched.schedule()
        for req in plan.prefill:
            order.append(req.id)
            sched.finish(req)
        clock[0] += step_s
    return order


def test_class_then_arrival():
    clock = [100.0]
    sched = Scheduler(max_batch=1, aging_s=1e9, clock=lambda: clock[0])
    for rid, qos, t in [
        ("be1", QosLevel.BEST_EFFORT, 1),
        ("st1", QosLevel.STANDARD, 2),
        ("rt1", QosLevel.REALTIME, 3),
        ("st2", QosLevel.STANDARD, 4),
        ("rt2", QosLevel.REALTIME, 5),
    ]:
        sched.add(FakeRequest(rid, qos, t))
    assert drain_order(sched, clock, 0.1) == ["rt1", "rt2", "st1", "st2", "be1"]


def test_aging_keeps_best_effort_from_starving():
    """A steady stream of fresh realtime work cannot hold back an old best-effort request forever."""
    clock = [0.0]
    sched = Scheduler(max_batch=1, aging_s=2.0, clock=lambda: clock[0])
    sched.add(FakeRequest("be", QosLevel.BEST_EFFORT, 0.0))
    served_at = None
    for step in range(100):  # one new realtime request per 0.1 s step, one slot: always a backlog
        sched.add(FakeRequest(f"rt{step}", QosLevel.REALTIME, clock[0]))
        for req in sched.schedule().prefill:
            if req.id == "be":
                served_at = clock[0]
            sched.finish(req)
        clock[0] += 0.1
    assert served_at is not None and 4.0 <= served_at <= 4.2  # competes as realtime after 2 x aging_s


def test_effective_class():
    assert effective_class(QosLevel.BEST_EFFORT, 0.0) == 2
    assert effective_class(QosLevel.BEST_EFFORT, 2.5) == 1
    assert effective_class(QosLevel.BEST_EFFORT, 9.0) == 0
    assert effective_class(QosLevel.REALTIME, 9.0) == 0
