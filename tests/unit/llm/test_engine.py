"""The llm engine without gRPC: batching, sampling, stops and aborts."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from services.common.errors import FailedPrecondition
from services.common.qos import QosLevel
from services.llm.engine import Lockstep, OneAhead
from services.llm.interface import EngineStats
from services.llm.request import Finish, Status
from tests.helpers import PROMPTS, Parts, image_bytes


def assert_idle(engine) -> None:
    """Nothing running or waiting, every batch place and KV page free again."""
    assert engine.stats() == EngineStats(running=0, waiting=0, free_slots=3)
    pages = engine.scheduler.blocks
    assert pages.free == pages.capacity


@pytest.fixture(scope="module", params=["lockstep", "ahead"])
def parts(tiny_model, request):
    """Both pacings (services/llm/engine.py): each step handed out once launched (the CPU's), and
    each step launched before the one ahead is handed out (CUDA's, here on the CPU)."""
    p = Parts(tiny_model, max_batch=3)
    if request.param == "ahead":
        p.engine.pacing = OneAhead()  # the engine thread is idle: no step is pending
    yield p
    p.engine.stop()


def test_batched_equals_alone(parts):
    """Five requests through 3 slots (joining and leaving mid-batch) decode as they do alone."""
    alone = []
    for i, prompt in enumerate(PROMPTS):
        pair = parts.request(i, prompt, max_tokens=8 + i, min_tokens=8 + i)
        parts.run(pair)
        alone.append(pair[1]["ids"])
    pairs = [parts.request(i, prompt, max_tokens=8 + i, min_tokens=8 + i) for i, prompt in enumerate(PROMPTS)]
    parts.run(*pairs)
    assert [box["ids"] for _, box in pairs] == alone
    assert all(box["finish"] is Finish.LENGTH for _, box in pairs)
    assert_idle(parts.engine)


def test_seeded_sampling_is_reproducible(parts):
    a = parts.request(1, PROMPTS[0], max_tokens=12, min_tokens=12, temperature=1.0, seed=7)
    b = parts.request(1, PROMPTS[0], max_tokens=12, min_tokens=12, temperature=1.0, seed=7)
    c = parts.request(1, PROMPTS[0], max_tokens=12, min_tokens=12, temperature=1.0, seed=8)
    parts.run(a, b, c)
    assert a[1]["ids"] == b[1]["ids"]
    assert a[1]["ids"] != c[1]["ids"]


def test_top_p_tiny_is_greedy(parts):
    greedy = parts.request(2, PROMPTS[1], max_tokens=10, min_tokens=10)
    nucleus = parts.request(2, PROMPTS[1], max_tokens=10, min_tokens=10, temperature=1.0, top_p=1e-6, seed=3)
    parts.run(greedy, nucleus)
    assert greedy[1]["ids"] == nucleus[1]["ids"]


def test_stop_string_ends_generation(parts):
    free = parts.request(3, PROMPTS[2], max_tokens=16, min_tokens=16)
    parts.run(free)
    text = free[1]["text"]
    assert len(text) > 4
    stop = text[2:4]
    stopped = parts.request(3, PROMPTS[2], max_tokens=16, min_tokens=16, stop=[stop])
    parts.run(stopped)
    assert stopped[1]["finish"] is Finish.STOP
    assert stopped[1]["text"] == text[: text.find(stop)]


def test_abort_frees_the_slot(parts):
    pairs = [parts.request(i, PROMPTS[0], max_tokens=400, min_tokens=400) for i in range(3)]
    for req, _ in pairs:
        parts.engine.add(req)
    for req, _ in pairs:
        parts.engine.abort(req.id)
    for _, box in pairs:
        assert box["done"].wait(30)
        assert box["finish"] is Finish.ABORT
    assert_idle(parts.engine)
    ok = parts.request(0, PROMPTS[0], max_tokens=3)
    parts.run(ok)
    assert ok[1]["finish"] in (Finish.LENGTH, Finish.STOP)


def test_a_request_cancelled_while_a_launched_step_holds_it_keeps_its_pages_until_that_step_ends(tiny_model):
    """One step ahead: a cancel is answered at once, but the request's pages go only once the step
    that holds it is back, so they are never handed on while that step may write them."""
    p = Parts(tiny_model, max_batch=3)
    try:
        engine = p.engine
        engine.pacing = OneAhead()
        a = p.request(0, PROMPTS[0], max_tokens=200, min_tokens=200)
        engine.add(a[0])
        deadline = time.monotonic() + 30
        while len(a[1]["ids"]) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        seen, finish = {}, engine._finish

        def traced_finish(req, *args, **kw):
            if req is a[0]:
                seen["before"] = req.in_flight
            finish(req, *args, **kw)
            if req is a[0]:
                seen["after"] = (req.status, len(req.blocks), engine.scheduler.blocks.free)

        engine._finish = traced_finish
        engine.abort(a[0].id)
        assert a[1]["done"].wait(30) and a[1]["finish"] is Finish.ABORT
        assert seen["before"] >= 1  # a launched step held it when the cancel came...
        status, held, free = seen["after"]
        assert status is Status.FINISHED and held > 0  # ...so it was answered, and its pages stayed
        assert free < engine.scheduler.blocks.capacity
        while engine.stats().running:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert len(a[1]["ids"]) < 200
        assert_idle(engine)
    finally:
        p.engine.stop()


def test_one_ahead_launches_each_step_before_the_one_ahead_is_handed_out(tiny_model):
    """`OneAhead`: a step is launched while the one ahead of it is in flight, its decodes fed that
    step's tokens on the device; the tokens are those of `Lockstep`, which launches no step ahead,
    and a request a stop string ends in flight gives its pages back after."""
    from services.llm.config import NativeEngineConfig

    p = Parts(tiny_model, max_batch=3, native=NativeEngineConfig(prefix_cache=False))  # each run computes all
    try:
        assert isinstance(p.engine.pacing, Lockstep)  # the CPU's
        pairs = [p.request(i, PROMPTS[i], max_tokens=7, min_tokens=7) for i in range(3)]
        p.run(*pairs)
        alone = [box for _, box in pairs]
        p.engine.pacing = OneAhead()  # CUDA's, on the CPU (where a launch computes the step)
        events, launch, complete = [], p.engine.runner.launch, p.engine._complete

        def traced_launch(chunks, decodes):
            events.append(("launch", sum(1 for r in decodes if r.unseen)))
            return launch(chunks, decodes)

        def traced_complete(step):
            events.append(("complete", 0))
            complete(step)

        p.engine.runner.launch, p.engine._complete = traced_launch, traced_complete
        stop = alone[1]["text"][1:3]  # ends request 1 mid-stream, while its next step is in flight
        pairs = [p.request(i, PROMPTS[i], max_tokens=7, min_tokens=7, stop=[stop] if i == 1 else []) for i in range(3)]
        p.run(*pairs)
        kinds = [kind for kind, _ in events]
        assert kinds.count("launch") == kinds.count("complete") >= 7  # a prefill step, then 6 decode steps
        flying, ahead = 0, 0  # steps launched while another was in flight
        for kind in kinds:
            ahead += kind == "launch" and flying > 0
            flying += 1 if kind == "launch" else -1
        assert ahead >= 5, events  # most steps: launched before the one ahead was handed out
        assert sum(fed for _, fed in events) >= 10  # decodes fed on the device
        assert [pairs[i][1]["ids"] for i in (0, 2)] == [alone[i]["ids"] for i in (0, 2)]
        assert pairs[1][1]["finish"] is Finish.STOP
        assert pairs[1][1]["text"] == alone[1]["text"][: alone[1]["text"].find(stop)]
        assert_idle(p.engine)
    finally:
        p.engine.stop()


def test_random_preset_runs_without_weights(tmp_path):
    """preset:NAME needs no weight files: modules are initialised on the device."""
    from services.model.presets import resolve_model

    model_dir = resolve_model("preset:tiny-shaped", cache=tmp_path)
    assert not list(Path(model_dir).glob("*.safetensors"))
    parts = Parts(model_dir, max_batch=2)
    try:
        pair = parts.request(1, PROMPTS[0], max_tokens=8, min_tokens=8, ignore_eos=True)
        parts.run(pair)
        assert len(pair[1]["ids"]) == 8
        assert parts.vision.spec.image_tokens == 16  # (56 / 14) ** 2
    finally:
        parts.engine.stop()


class Leases:
    """Lease hooks as the llm servicer attaches them to features read in place."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.verified = self.released = 0
        self.fail_on = fail_on

    def verify(self) -> None:
        self.verified += 1
        if self.verified == self.fail_on:
            raise FailedPrecondition("tensor reference is stale: its lease was released, expired or never issued")

    def release(self) -> None:
        self.released += 1


def with_leases(pair, leases: Leases):
    pair[0].leases = leases
    pair[1]["errors"] = []
    emit = pair[0].emit

    def keep_error(out):
        if out.error is not None:
            pair[1]["errors"].append(out.error)
        emit(out)

    pair[0].emit = keep_error
    return pair


def test_leases_verified_around_the_prefill_then_released_once(parts):
    leases = Leases()
    plain = parts.request(5, PROMPTS[0], max_tokens=4)
    held = with_leases(parts.request(5, PROMPTS[0], max_tokens=4), leases)
    parts.run(plain, held)
    assert held[1]["ids"] == plain[1]["ids"] and held[1]["finish"] is Finish.LENGTH
    assert (leases.verified, leases.released) == (2, 1)  # before and after the prefill read the features


def test_a_prefix_hit_that_reads_no_features_still_releases_them_once(parts):
    """The image's positions come from cached pages: the features are not read; a preemptible
    request still copies them first (a resume whose pages were evicted reads them)."""
    first = parts.request(64, PROMPTS[0], max_tokens=4, min_tokens=4)
    parts.run(first)
    leases = Leases()
    hit = with_leases(parts.request(64, PROMPTS[0], qos=QosLevel.BEST_EFFORT, max_tokens=4, min_tokens=4), leases)
    features = hit[0].image_features[0]
    parts.run(hit)
    assert hit[0].cached_tokens > hit[0].features_end  # the features were not needed...
    assert hit[1]["ids"] == first[1]["ids"] and leases.released == 1
    assert hit[0].image_features[0] is not features and torch.equal(hit[0].image_features[0], features)  # ...copied


def test_leases_of_features_a_launched_chunk_reads_go_only_after_its_step(tiny_model):
    """A prompt in chunks of 8 whose image spans several: the step ahead reads the next chunk's
    features while the step before it is handed out, so the leases go only once the step of the
    last chunk that reads them has ended, not when `computed` passes them."""
    from services.llm.config import NativeEngineConfig

    p = Parts(tiny_model, max_batch=3, native=NativeEngineConfig(max_prefill_tokens=8))
    try:
        p.engine.pacing = OneAhead()  # CUDA's, on the CPU
        handed_out: list[int] = []  # the ends of the request's chunks whose step is being handed out
        pair = p.request(70, PROMPTS[1], max_tokens=3)
        req = pair[0]
        complete = p.engine._complete

        def traced_complete(step):
            handed_out.extend(c.end for c in step.chunks if c.req is req)
            complete(step)

        class Watched(Leases):
            def release(self) -> None:
                super().release()
                self.read_by_then = max(handed_out, default=0)

        p.engine._complete = traced_complete
        leases = Watched()
        with_leases(pair, leases)
        assert req.features_end > 16  # the image spans more than two chunks
        p.run(pair)
        assert pair[1]["finish"] is Finish.LENGTH and leases.released == 1
        assert leases.read_by_then >= req.features_end  # not while a launched chunk still read them
    finally:
        p.engine.stop()


@pytest.mark.parametrize("fail_on", [1, 2], ids=["lost-while-waiting", "lost-while-read"])
def test_a_lost_lease_fails_the_request_with_failed_precondition(parts, fail_on):
    leases = Leases(fail_on=fail_on)
    image = 60 + fail_on  # a picture no other request showed: no cached prefix spares reading the features
    pair = with_leases(parts.request(image, PROMPTS[1], max_tokens=4), leases)
    parts.run(pair)
    assert pair[1]["finish"] is Finish.ERROR and pair[1]["ids"] == []  # no token computed from reused memory
    assert isinstance(pair[1]["errors"][0], FailedPrecondition)
    assert leases.released == 1
    assert_idle(parts.engine)
    after = parts.request(image, PROMPTS[1], max_tokens=4)
    parts.run(after)  # the engine keeps serving
    assert after[1]["finish"] is Finish.LENGTH
    assert after[0].cached_tokens == 0  # nothing computed from reused memory went to the prefix cache


def test_abort_while_waiting_releases_the_leases(parts):
    # Fill the 3 slots with long requests so the held one waits, then abort it.
    busy = [parts.request(7 + i, PROMPTS[0], max_tokens=60, min_tokens=60) for i in range(3)]
    for req, _ in busy:
        parts.engine.add(req)
    leases = Leases()
    held = with_leases(parts.request(9, PROMPTS[0], max_tokens=4), leases)
    parts.engine.add(held[0])
    parts.engine.abort(held[0].id)
    assert held[1]["done"].wait(60) and held[1]["finish"] is Finish.ABORT
    assert leases.released == 1
    for _, box in busy:
        assert box["done"].wait(60)


def test_realtime_overtakes_a_full_batch_of_best_effort_and_the_preempted_finish_correctly(parts):
    """3 slots busy with best-effort decodes; a realtime request takes one at once (preemption)."""
    jobs = [(40 + i, PROMPTS[i], {"max_tokens": 40, "min_tokens": 40}) for i in range(3)]
    alone = [parts.request(img, prompt, **s) for img, prompt, s in jobs]
    parts.run(*alone)  # the reference: never preempted
    be = [parts.request(img, prompt, QosLevel.BEST_EFFORT, **s) for img, prompt, s in jobs]
    for req, _ in be:
        parts.engine.add(req)
    deadline = time.monotonic() + 30
    while min(len(box["ids"]) for _, box in be) < 5:  # all three are decoding
        assert time.monotonic() < deadline
        time.sleep(0.002)
    rt = parts.request(50, PROMPTS[3], QosLevel.REALTIME, max_tokens=4, min_tokens=4)
    parts.run(rt)
    preempted = [pair for pair in be if pair[0].preempted_at]
    assert len(preempted) == 1, "the realtime request should have taken exactly one best-effort slot"
    assert not preempted[0][1]["done"].is_set(), "the realtime request finished before the one it preempted"
    for _, box in be:
        assert box["done"].wait(60)
    for (_, want), (_, got) in zip(alone, be, strict=True):
        assert got["finish"] is Finish.LENGTH and got["ids"] == want["ids"]  # recomputed, same tokens
        assert got["text"] == want["text"]
    assert_idle(parts.engine)


def test_a_failed_step_fails_its_requests_and_the_engine_keeps_serving(parts, monkeypatch):
    runner = parts.engine.runner
    real = runner._stage_chunks

    def broken(*args):
        real(*args)  # staged half a step's inputs, then failed
        raise RuntimeError("device lost its mind")

    monkeypatch.setattr(runner, "_stage_chunks", broken)
    failed = [
        parts.request(808, PROMPTS[0], max_tokens=4) for _ in range(150)
    ]  # more than staging holds; a new picture
    parts.run(*failed)
    assert all(box["finish"] is Finish.ERROR for _, box in failed)
    monkeypatch.undo()
    for _ in range(3):  # staging starts afresh each step: no leftovers from the failed ones
        ok = parts.request(8, PROMPTS[0], max_tokens=4)
        parts.run(ok)
        assert ok[1]["finish"] is Finish.LENGTH
    assert_idle(parts.engine)


@pytest.mark.parametrize("pacing", ["lockstep", "ahead"])
def test_a_preempted_qwen_request_resumes_at_its_own_rotary_positions(tiny_qwen, pacing):
    """M-RoPE (services/model/mrope.py) across preemption: a best-effort Qwen2.5-VL request pushed
    out mid-decode by a realtime one is recomputed (its prompt's [3, L] positions, its outputs at
    index + delta) and ends with the tokens it gives alone."""
    parts = Parts(tiny_qwen, max_batch=3)
    if pacing == "ahead":
        parts.engine.pacing = OneAhead()
    try:
        pictures = [image_bytes(60 + i, (90 + 40 * i, 300 - 50 * i), "JPEG") for i in range(4)]
        jobs = [(pictures[i], PROMPTS[i], {"max_tokens": 30, "min_tokens": 30}) for i in range(3)]
        alone = [parts.request(img, prompt, **s) for img, prompt, s in jobs]
        parts.run(*alone)
        be = [parts.request(img, prompt, QosLevel.BEST_EFFORT, **s) for img, prompt, s in jobs]
        for req, _ in be:
            parts.engine.add(req)
        deadline = time.monotonic() + 30
        while min(len(box["ids"]) for _, box in be) < 5:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        parts.run(parts.request(pictures[3], PROMPTS[3], QosLevel.REALTIME, max_tokens=4, min_tokens=4))
        assert sum(bool(req.preempted_at) for req, _ in be) == 1
        assert all(req.rope_delta != 0 for req, _ in be)  # the positions do differ from the indices
        for _, box in be:
            assert box["done"].wait(60)
        for (_, want), (_, got) in zip(alone, be, strict=True):
            assert got["ids"] == want["ids"]
        assert_idle(parts.engine)
    finally:
        parts.engine.stop()
