"""The llm scheduler's order: class first, arrival within a class, aging against starvation, preemption."""

from __future__ import annotations

from services.common.qos import QosLevel, effective_class
from services.llm.scheduler import Scheduler


class FakeRequest:
    def __init__(self, rid: str, qos: QosLevel, arrival: float) -> None:
        self.id, self.qos, self.arrival = rid, qos, arrival
        self.aborted, self.slot, self.computed = False, -1, 0
        self.output_ids: list[int] = []
        self.preempted_at: list[float] = []


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


def full_of(sched: Scheduler, clock: list[float], *specs: tuple[str, QosLevel, int]) -> dict[str, FakeRequest]:
    """Admit requests until the slots are full; `specs` = (id, class, tokens generated so far)."""
    reqs = {}
    for rid, qos, n in specs:
        reqs[rid] = FakeRequest(rid, qos, clock[0])
        reqs[rid].output_ids = [0] * n
        sched.add(reqs[rid])
    assert sorted(r.id for r in sched.schedule().prefill) == sorted(reqs)
    assert sched.slots.free == 0
    return reqs


def test_realtime_preempts_the_best_effort_request_with_least_work():
    clock = [0.0]
    sched = Scheduler(max_batch=3, clock=lambda: clock[0])
    reqs = full_of(
        sched, clock, ("be-a", QosLevel.BEST_EFFORT, 9), ("st", QosLevel.STANDARD, 1), ("be-b", QosLevel.BEST_EFFORT, 4)
    )
    for r in reqs.values():
        r.computed = 20
    clock[0] += 0.5
    sched.add(FakeRequest("rt", QosLevel.REALTIME, clock[0]))
    plan = sched.schedule()
    assert [r.id for r in plan.preempted] == ["be-b"]  # fewer tokens generated than be-a: less to recompute
    assert [r.id for r in plan.prefill] == ["rt"]
    assert sorted(r.id for r in plan.decode) == ["be-a", "st"]
    victim = reqs["be-b"]
    assert victim.slot == -1 and victim.output_ids == [0] * 4  # tokens kept; its KV state is the runner's to drop
    assert sched.waiting == 1
    # When a slot frees, the victim resumes before later best-effort work.
    sched.add(FakeRequest("be-late", QosLevel.BEST_EFFORT, clock[0]))
    sched.finish(reqs["st"])
    assert [r.id for r in sched.schedule().prefill] == ["be-b"]


def test_only_realtime_preempts_and_only_best_effort_is_preempted():
    clock = [0.0]
    sched = Scheduler(max_batch=2, clock=lambda: clock[0])
    full_of(sched, clock, ("st", QosLevel.STANDARD, 0), ("be", QosLevel.BEST_EFFORT, 0))
    sched.add(FakeRequest("st2", QosLevel.STANDARD, clock[0]))
    assert sched.schedule().preempted == []  # standard waits for a slot
    sched2 = Scheduler(max_batch=2, clock=lambda: clock[0])
    full_of(sched2, clock, ("st-a", QosLevel.STANDARD, 0), ("st-b", QosLevel.STANDARD, 0))
    sched2.add(FakeRequest("rt", QosLevel.REALTIME, clock[0]))
    plan = sched2.schedule()
    assert plan.preempted == [] and plan.prefill == []  # realtime waits: no best-effort to take from


def test_an_aged_best_effort_request_is_not_preempted():
    """After 2 x aging_s a best-effort request competes as realtime: it cannot be preempted again."""
    clock = [0.0]
    sched = Scheduler(max_batch=1, aging_s=2.0, clock=lambda: clock[0])
    full_of(sched, clock, ("be", QosLevel.BEST_EFFORT, 3))
    clock[0] = 4.5
    sched.add(FakeRequest("rt", QosLevel.REALTIME, clock[0]))
    plan = sched.schedule()
    assert plan.preempted == [] and plan.prefill == []
