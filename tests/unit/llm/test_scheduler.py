"""The llm scheduler: class first, arrival within a class, aging, preemption, pages and chunked prefill."""

from __future__ import annotations

import zlib
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.qos import QosLevel, effective_class
from services.common.sampling import Sampling
from services.llm.block_manager import BlockManager
from services.llm.request import Request, Status
from services.llm.scheduler import Scheduler

GREEDY = Sampling(max_tokens=None, temperature=0.0, top_p=1.0, seed=None, stop=(), min_tokens=0, ignore_eos=False)


class FakeRequest:
    """What the scheduler reads of a request, with Request's own derived properties."""

    seq_len, prefilling = Request.seq_len, Request.prefilling
    unseen, generated = Request.unseen, Request.generated

    def __init__(
        self,
        rid: str,
        qos: QosLevel,
        arrival: float,
        prompt: int = 10,
        max_new: int = 6,
        keys: list | None = None,
        token: int | None = None,
    ) -> None:
        self.id, self.qos, self.arrival = rid, qos, arrival
        # Its own token unless told (equal prompts: equal ids), so that no part of another's page matches.
        token = 1 + zlib.crc32(rid.encode()) % 10_000 if token is None else token
        self.prompt_ids, self.max_new = [token] * prompt, max_new
        self.images: list = []
        self.page_keys = keys or []  # the prefix cache's page keys (none: nothing is shared)
        self.part_keys: dict = {}
        self.registered = self.cached_tokens = 0
        self.parts_registered, self.kv_copy, self.features_cached = False, None, False
        self.features_end, self.leases = 0, None  # no image; no features to keep
        self.status, self.computed, self.prefill_target = Status.WAITING, 0, 0
        self.in_flight = 0
        self.blocks: list[int] = []
        self.output_ids: list[int] = []
        self.preempted_at: list[float] = []
        self.sampling = GREEDY

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def running(self) -> bool:
        return self.status is Status.RUNNING

    @property
    def ended(self) -> bool:
        return self.status is Status.FINISHED


def scheduler(max_batch: int, pages: int = 64, page_size: int = 4, budget: int = 10_000, **kw) -> Scheduler:
    return Scheduler(max_batch, BlockManager(pages, page_size), budget, **kw)


def run_plan(plan) -> None:
    """What the runner would do: compute each chunk, decode one token."""
    for c in plan.prefill:
        c.req.computed = c.end
        if c.completes:
            c.req.output_ids.append(1)
    for r in plan.decode:
        r.computed += 1
        r.output_ids.append(1)


def drain_order(sched: Scheduler, clock: list[float], step_s: float) -> list[str]:
    """Admit one request per step (one slot), finishing it at once; return the admission order."""
    order = []
    while sched.waiting:
        plan = sched.schedule()
        for chunk in plan.prefill:
            order.append(chunk.req.id)
            sched.finish(chunk.req)
        clock[0] += step_s
    return order


def test_class_then_arrival():
    clock = [100.0]
    sched = scheduler(max_batch=1, aging_s=1e9, clock=lambda: clock[0])
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
    sched = scheduler(max_batch=1, aging_s=2.0, clock=lambda: clock[0])
    sched.add(FakeRequest("be", QosLevel.BEST_EFFORT, 0.0))
    served_at = None
    for step in range(100):  # one new realtime request per 0.1 s step, one slot: always a backlog
        sched.add(FakeRequest(f"rt{step}", QosLevel.REALTIME, clock[0]))
        for chunk in sched.schedule().prefill:
            if chunk.req.id == "be":
                served_at = clock[0]
            sched.finish(chunk.req)
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
        reqs[rid] = FakeRequest(rid, qos, clock[0], max_new=n + 6)
        reqs[rid].output_ids = [0] * n
        sched.add(reqs[rid])
    plan = sched.schedule()
    assert sorted(c.req.id for c in plan.prefill) == sorted(reqs)
    run_plan(plan)
    assert sched.free_places == 0
    return reqs


def test_realtime_preempts_the_best_effort_request_with_least_work():
    clock = [0.0]
    sched = scheduler(max_batch=3, clock=lambda: clock[0])
    reqs = full_of(
        sched, clock, ("be-a", QosLevel.BEST_EFFORT, 9), ("st", QosLevel.STANDARD, 1), ("be-b", QosLevel.BEST_EFFORT, 4)
    )
    clock[0] += 0.5
    sched.add(FakeRequest("rt", QosLevel.REALTIME, clock[0]))
    plan = sched.schedule()
    assert [r.id for r in plan.preempted] == ["be-b"]  # fewer tokens generated than be-a: less to recompute
    assert [c.req.id for c in plan.prefill] == ["rt"]
    assert sorted(r.id for r in plan.decode) == ["be-a", "st"]
    victim = reqs["be-b"]
    assert victim.blocks == [] and victim.output_ids == [0] * 4 + [1]  # tokens kept; its KV is the runner's to drop
    assert sched.waiting == 1
    run_plan(plan)
    # When a place frees, the victim resumes before later best-effort work.
    sched.add(FakeRequest("be-late", QosLevel.BEST_EFFORT, clock[0]))
    sched.finish(reqs["st"])
    resumed = sched.schedule()
    assert [r.id for r in resumed.admitted] == ["be-b"]
    assert resumed.prefill[0].req.prefill_target == 10 + 5  # prompt and the tokens it had: recomputed


def test_whole_prompts_start_no_prompt_in_the_leftover_of_a_step():
    sched = scheduler(max_batch=4, budget=30)
    for rid in ("a", "b", "c"):
        sched.add(FakeRequest(rid, QosLevel.STANDARD, 0.0, prompt=12))
    whole = sched.schedule()
    assert [(c.req.id, c.start, c.end) for c in whole.prefill] == [("a", 0, 12), ("b", 0, 12)]  # c: 12 > 6 left
    run_plan(whole)
    alone = sched.schedule()
    assert [(c.req.id, c.start, c.end) for c in alone.prefill] == [("c", 0, 12)]
    big = scheduler(max_batch=4, budget=30)
    big.add(FakeRequest("long", QosLevel.STANDARD, 0.0, prompt=50))
    big.add(FakeRequest("next", QosLevel.STANDARD, 0.0, prompt=4))
    first = big.schedule()
    assert [(c.req.id, c.start, c.end) for c in first.prefill] == [("long", 0, 30)]  # alone: chunked
    run_plan(first)
    rest = big.schedule()  # the long prompt's rest goes on first; a whole prompt fits beside it
    assert [(c.req.id, c.start, c.end) for c in rest.prefill] == [("long", 30, 50), ("next", 0, 4)]


def test_only_realtime_preempts_and_only_best_effort_is_preempted():
    clock = [0.0]
    sched = scheduler(max_batch=2, clock=lambda: clock[0])
    full_of(sched, clock, ("st", QosLevel.STANDARD, 0), ("be", QosLevel.BEST_EFFORT, 0))
    sched.add(FakeRequest("st2", QosLevel.STANDARD, clock[0]))
    assert sched.schedule().preempted == []  # standard waits for a slot
    sched2 = scheduler(max_batch=2, clock=lambda: clock[0])
    full_of(sched2, clock, ("st-a", QosLevel.STANDARD, 0), ("st-b", QosLevel.STANDARD, 0))
    sched2.add(FakeRequest("rt", QosLevel.REALTIME, clock[0]))
    plan = sched2.schedule()
    assert plan.preempted == [] and plan.prefill == []  # realtime waits: no best-effort to take from


def test_an_aged_best_effort_request_is_not_preempted():
    """After 2 x aging_s a best-effort request competes as realtime: it cannot be preempted again."""
    clock = [0.0]
    sched = scheduler(max_batch=1, aging_s=2.0, clock=lambda: clock[0])
    full_of(sched, clock, ("be", QosLevel.BEST_EFFORT, 3))
    clock[0] = 4.5
    sched.add(FakeRequest("rt", QosLevel.REALTIME, clock[0]))
    plan = sched.schedule()
    assert plan.preempted == [] and plan.prefill == []


def test_prompts_are_chunked_under_the_token_budget_and_decodes_run_every_step():
    clock = [0.0]
    sched = scheduler(max_batch=4, budget=16, clock=lambda: clock[0])
    short = FakeRequest("short", QosLevel.STANDARD, 0.0, prompt=6)
    long = FakeRequest("long", QosLevel.STANDARD, 1.0, prompt=40)
    sched.add(short)
    sched.add(long)
    steps = []
    while long.prefilling or not long.output_ids:
        plan = sched.schedule()
        assert sum(c.end - c.start for c in plan.prefill) <= 16
        steps.append(([(c.req.id, c.start, c.end) for c in plan.prefill], [r.id for r in plan.decode]))
        run_plan(plan)
    assert steps == [
        ([("short", 0, 6)], []),  # the long prompt does not fill what the budget leaves...
        ([("long", 0, 16)], ["short"]),  # ...it starts a step of its own, in chunks of the budget
        ([("long", 16, 32)], ["short"]),  # the short one decodes while the long one is still prefilling
        ([("long", 32, 40)], ["short"]),
    ]
    assert long.output_ids == [1]  # its last chunk sampled its first token


def test_pages_are_reserved_for_the_whole_sequence_and_a_full_pool_makes_requests_wait():
    clock = [0.0]
    # 9 pages of 4 positions, one reserved: 8 usable. Each request needs (10 + 6) / 4 = 4.
    sched = scheduler(max_batch=8, pages=9, page_size=4, clock=lambda: clock[0])
    reqs = [FakeRequest(f"r{i}", QosLevel.STANDARD, float(i)) for i in range(3)]
    for r in reqs:
        sched.add(r)
    plan = sched.schedule()
    assert [r.id for r in plan.admitted] == ["r0", "r1"] and sched.waiting == 1
    assert all(len(r.blocks) == 4 for r in plan.admitted) and sched.blocks.free == 0
    assert len({p for r in plan.admitted for p in r.blocks}) == 8  # no page shared, page 0 never given
    assert 0 not in {p for r in plan.admitted for p in r.blocks}
    run_plan(plan)
    sched.finish(reqs[0])
    assert [r.id for r in sched.schedule().admitted] == ["r2"]
    for r in reqs[1:]:
        sched.finish(r)
    assert sched.blocks.free == sched.blocks.capacity and sched.free_places == 8


def test_realtime_preempts_best_effort_for_pages_too():
    clock = [0.0]
    sched = scheduler(max_batch=8, pages=9, page_size=4, clock=lambda: clock[0])  # room for two requests
    for rid, qos in (("be", QosLevel.BEST_EFFORT), ("st", QosLevel.STANDARD)):
        sched.add(FakeRequest(rid, qos, clock[0]))
    run_plan(sched.schedule())
    sched.add(FakeRequest("st2", QosLevel.STANDARD, clock[0]))
    assert sched.schedule().admitted == []  # places are free, pages are not: it waits
    sched.add(FakeRequest("rt", QosLevel.REALTIME, clock[0]))
    plan = sched.schedule()
    assert [r.id for r in plan.preempted] == ["be"] and [r.id for r in plan.admitted] == ["rt"]


# --- the prefix cache ---


def keyed(rid, keys, prompt=12, qos=QosLevel.STANDARD, t=0.0, token=None):
    return FakeRequest(rid, qos, t, prompt=prompt, max_new=4, keys=keys, token=token)


def computed_first(sched: Scheduler, keys: list[bytes]):
    """A first request of `keys`, prefilled and its pages registered."""
    first = keyed("a", keys)
    sched.add(first)
    run_plan(sched.schedule())
    sched.prefix.computed(first)
    return first


def test_a_request_sent_as_content_keys_runs_only_while_the_pool_holds_its_images_and_is_never_preempted():
    """Request.features_cached (LlmGenerateRequest.cached_image_keys): it has no features to compute
    its image positions from, so it is refused (Plan.refused) unless the cache holds them all."""
    sched = scheduler(max_batch=3, pages=16, page_size=4, clock=lambda: 0.0)
    computed_first(sched, [b"0", b"1", b"2"])
    held = keyed("b", [b"0", b"1", b"2"], qos=QosLevel.BEST_EFFORT)
    gone = keyed("c", [b"0", b"X"])  # its image's positions reach into a page the pool does not hold
    for req in (held, gone):
        req.features_cached, req.features_end = True, 8
    sched.add(held)
    sched.add(gone)
    assert sched.prefix.holds_images(held) and not sched.prefix.holds_images(gone)
    plan = sched.schedule()
    assert plan.refused == [gone] and not gone.running and sched.waiting == 0
    assert plan.admitted == [held] and plan.prefill[0].start == 8
    run_plan(plan)
    rt = keyed("rt", [b"r"], prompt=40, qos=QosLevel.REALTIME)  # needs the pages that `held` holds
    sched.add(rt)
    assert sched.schedule().preempted == [] and held.running  # a resume would need its features


def test_a_request_starts_after_the_pages_an_earlier_one_computed():
    sched = scheduler(max_batch=2, pages=16, page_size=4)
    first = computed_first(sched, [b"0", b"1", b"2"])
    assert first.registered == 3 and first.cached_tokens == 0
    second = keyed("b", [b"0", b"1", b"X"])
    sched.add(second)
    plan = sched.schedule()
    (chunk,) = plan.prefill
    assert (chunk.req, chunk.start) == (second, 8)  # two shared pages: 8 positions not computed
    assert second.blocks[:2] == first.blocks[:2] and second.blocks[2] != first.blocks[2]
    assert second.cached_tokens == 8


def test_one_prompt_position_is_always_left_to_compute():
    sched = scheduler(max_batch=2, pages=16, page_size=4)
    computed_first(sched, [b"0", b"1", b"2"])
    again = keyed("b", [b"0", b"1", b"2"])  # the same 12-position prompt: 3 full pages
    sched.add(again)
    (chunk,) = sched.schedule().prefill
    assert chunk.start == 8 and chunk.end == 12  # the last page is computed: its logits give the first token


def test_a_greedy_repeat_whose_first_token_the_pool_keeps_computes_nothing_and_decodes_at_once():
    sched = scheduler(max_batch=8, pages=32, page_size=4)
    first = keyed("a", [b"0", b"1", b"2"])
    sched.add(first)
    (chunk,) = sched.schedule().prefill
    first.computed = chunk.end
    sched.prefix.computed(first)  # as the engine does once the step is back: its pages, then its token
    sched.prefix.answered(first, 42)
    again = keyed("b", [b"0", b"1", b"2"])
    sched.add(again)
    plan = sched.schedule()
    assert plan.answered == [(again, 42)] and plan.decode == [first, again] and not plan.prefill
    assert again.computed == again.cached_tokens == 12 and again.blocks[:3] == first.blocks[:3]
    # Not: with features read in place (leases), sampled, or with EOS banned.
    leased, drawn, banned = (keyed(r, [b"0", b"1", b"2"]) for r in "cde")
    leased.leases = object()
    drawn.sampling = Sampling(None, 0.7, 1.0, 3, (), 0, False)
    banned.sampling = Sampling(None, 0.0, 1.0, None, (), 2, False)
    for req in (leased, drawn, banned):
        sched.add(req)
        plan = sched.schedule()
        assert not plan.answered and plan.admitted == [req] and req.computed == 8


def test_no_later_admission_of_a_plan_takes_a_page_that_an_earlier_one_copies_a_part_from():
    """The runner copies the chunks' parts before the decodes': a repeat (a decode at once) whose
    source page a prompt admitted after it took would copy that prompt's part, not its own."""
    sched = scheduler(max_batch=8, pages=6, page_size=32)  # 5 usable pages
    a = FakeRequest("a", QosLevel.STANDARD, 0.0, prompt=40, token=1)
    a.page_keys = None  # computed by the prefix cache: its part keys too
    sched.add(a)
    run_plan(sched.schedule())
    a.output_ids.clear()  # as the engine does: pages registered, then the first token noted
    sched.prefix.computed(a)
    sched.prefix.answered(a, 42)
    sched.finish(a)  # its 2 pages cached: the second holds the part where its prompt ends
    b = FakeRequest("b", QosLevel.STANDARD, 1.0, prompt=52, token=2)
    b.page_keys = None
    sched.add(b)
    run_plan(sched.schedule())
    sched.prefix.computed(b)  # b runs on, in 2 pages: the pool has 1 free page and a's 2 cached ones
    again = FakeRequest("again", QosLevel.STANDARD, 2.0, prompt=40, token=1)
    other = FakeRequest("other", QosLevel.STANDARD, 3.0, prompt=50, token=2)  # b's first 48, and 2 more
    for req in (again, other):
        req.page_keys = None
        sched.add(req)
    plan = sched.schedule()
    assert plan.answered == [(again, 42)] and again.kv_copy is not None
    source = again.kv_copy[0]
    assert all(source not in r.blocks for r in plan.admitted if r is not again)
    assert sched.blocks.free >= 1  # the source page is cached again once the plan is made


def test_finishing_and_preemption_drop_holds_and_cached_pages_serve_a_resume():
    clock = [0.0]
    sched = scheduler(max_batch=1, pages=8, page_size=4, clock=lambda: clock[0])
    be = keyed("be", [b"0", b"1"], prompt=9, qos=QosLevel.BEST_EFFORT)
    sched.add(be)
    run_plan(sched.schedule())
    sched.prefix.computed(be)
    rt = keyed("rt", [b"r0"], prompt=5, qos=QosLevel.REALTIME, t=0.0)
    sched.add(rt)
    plan = sched.schedule()
    assert plan.preempted == [be] and be.computed == 0 and not be.blocks
    # be's computed pages stay cached, held by nobody: its two full pages, and the one its prompt
    # ends in (under the key of that part)
    assert sched.blocks.cached == 3
    run_plan(plan)
    sched.finish(rt)
    plan = sched.schedule()
    (chunk,) = plan.prefill
    assert chunk.req is be and chunk.start == 8  # it resumes after its own cached pages
    assert be.cached_tokens == 0  # what its first admission found
    sched.finish(be)
    assert sched.blocks.free == sched.blocks.capacity


def test_switched_off_nothing_is_shared():
    sched = scheduler(max_batch=2, pages=16, page_size=4)
    sched.prefix.enabled = False
    first = FakeRequest("a", QosLevel.STANDARD, 0.0, prompt=12)
    first.page_keys = None  # would be computed, were the cache on
    sched.add(first)
    (chunk,) = sched.schedule().prefill
    assert chunk.start == 0 and first.page_keys is None


# --- the pool's accounting under random traffic (hypothesis) ---

PREFIXES = [[b"a0", b"a1", b"a2"], [b"a0", b"a1", b"b2"], [b"c0", b"c1"], [b"d0"]]


def check_pool(sched: Scheduler) -> None:
    """Every page's holders are the running requests that list it; free and held pages add up."""
    bm = sched.blocks
    holders: Counter[int] = Counter(p for r in sched.running for p in r.blocks)
    for r in sched.running:
        assert len(set(r.blocks)) == len(r.blocks), "a page twice in one block table"
    assert all(bm._refs[p] == n for p, n in holders.items())
    assert all(bm._refs[p] == 0 for p in bm._free) and not set(bm._free) & set(holders)
    assert all(bm._refs[p] == 0 for p in bm._cached)
    assert bm.free + len(holders) == bm.capacity


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "step", "finish"]),
            st.integers(0, len(PREFIXES) - 1),
            st.sampled_from(list(QosLevel)),
            st.integers(0, 6),
        ),
        max_size=60,
    )
)
def test_pages_are_never_shared_while_written_and_all_come_back(ops):
    clock = [0.0]
    sched = scheduler(max_batch=3, pages=14, page_size=4, budget=6, clock=lambda: clock[0])
    n = 0
    for op, prefix, qos, extra in ops:
        clock[0] += 0.5
        if op == "add":
            keys = PREFIXES[prefix][: 1 + extra % len(PREFIXES[prefix])]
            n += 1
            # Equal prefixes have equal tokens: a page's leading parts may be copied from another's.
            prompt = 4 * len(keys) + extra % 3
            sched.add(keyed(f"r{n}", list(keys), prompt=prompt, qos=qos, t=clock[0], token=prefix))
        elif op == "finish" and sched.running:
            sched.finish(sched.running[extra % len(sched.running)])
        else:
            plan = sched.schedule()
            for c in plan.prefill:  # what the chunk writes must be its own pages, held by nobody else
                first, last = c.start // 4, (c.end - 1) // 4
                assert all(sched.blocks._refs[c.req.blocks[i]] == 1 for i in range(first, last + 1))
                if c.req.kv_copy:  # the part it copies ends where it starts, from a page not its own
                    src, positions = c.req.kv_copy
                    assert positions == c.start % 4 > 0 and src not in c.req.blocks
                    c.req.kv_copy = None  # the runner's
            for r in plan.decode:
                assert sched.blocks._refs[r.blocks[r.computed // 4]] == 1
            run_plan(plan)
            for c in plan.prefill:
                sched.prefix.computed(c.req)
            for r in list(sched.running):  # a request ends once it has its tokens
                if len(r.output_ids) >= r.max_new:
                    sched.finish(r)
        check_pool(sched)
    for r in list(sched.running):
        sched.finish(r)
    check_pool(sched)
    assert sched.blocks.free == sched.blocks.capacity


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["add", "step", "step", "end"]), st.sampled_from(list(QosLevel)), st.integers(0, 9)),
        max_size=60,
    )
)
def test_a_step_ahead_plans_each_token_once_and_gives_every_page_back(ops):
    """One step ahead (the engine's `OneAhead`, on CUDA): each step is planned and launched while the one before it
    is in flight. A planned decode feeds a token that is back or the one the step in flight
    samples, at the position after the last; nothing is planned past its last token or once it
    ended; a request preempted by a plan is not in it; an ended request keeps its pages until no
    launched step holds it; and every page comes back."""
    clock = [0.0]
    sched = scheduler(max_batch=3, pages=14, page_size=4, budget=6, clock=lambda: clock[0])
    flying: tuple[list, list] | None = None  # the step in flight: the requests it samples, and all it holds

    def land(step) -> None:  # the engine's _complete: tokens out, then what ended goes
        sampled, held = step
        for r in held:
            r.in_flight -= 1
        for r in sampled:
            if r.running and not r.ended:
                assert len(r.output_ids) < r.max_new
                r.output_ids.append(1)
                if len(r.output_ids) == r.max_new:
                    r.status = Status.FINISHED
        for r in held:
            if r.ended and not r.in_flight:
                sched.finish(r)

    for n, (op, qos, x) in enumerate(ops):
        clock[0] += 0.5
        if op == "add":
            sched.add(FakeRequest(f"r{n}", qos, clock[0], prompt=3 + x, max_new=1 + x % 4))
        elif op == "end" and sched.running:  # a stop string, or a cancel: answered now
            r = sched.running[x % len(sched.running)]
            if not r.ended:
                r.status = Status.FINISHED
                if not r.in_flight:
                    sched.finish(r)
        else:
            plan = sched.schedule()
            gone = {id(r) for r in plan.preempted}
            assert not any(id(c.req) in gone for c in plan.prefill) and not any(id(r) in gone for r in plan.decode)
            ahead = {id(r) for r in flying[0]} if flying else set()
            for r in plan.decode:
                assert not r.ended and r.generated < r.max_new
                assert r.unseen == 0 or id(r) in ahead  # fed by the step in flight
                assert r.computed == r.seq_len - 1 + r.unseen  # the position of the token it feeds
            held = [c.req for c in plan.prefill] + plan.decode
            sampled = [c.req for c in plan.prefill if c.completes] + plan.decode
            run_plan_launched(plan)
            for r in held:
                r.in_flight += 1
            if flying:
                land(flying)
            flying = (sampled, held)
        check_pool(sched)
    if flying:
        land(flying)
    for r in list(sched.running):
        sched.finish(r)
    check_pool(sched)
    assert sched.blocks.free == sched.blocks.capacity


def run_plan_launched(plan) -> None:
    """What the runner does at a launch: positions computed; the tokens come when the step lands."""
    for c in plan.prefill:
        c.req.computed = c.end
    for r in plan.decode:
        r.computed += 1
