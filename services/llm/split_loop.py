"""The engine thread's loop with `--lanes split`: a prefill step and a decode step in flight at once.

Time-shared (`--lanes shared`), every running request waits through each prompt step for its
next token; at W1's 35 req/s on the H200 prompt steps were some 58% of the engine's time, and
the P99 followed them (docs/PERF.md). Split, the runner has two lanes (services/llm/lane.py; on
CUDA each on SMs of its own) and this loop keeps both busy:

- an idle prefill lane launches the scheduler's next prefill plan (`schedule(decodes=False)`:
  admission, QoS order, preemption and the token budget as in a shared step);
- an idle decode lane launches one token for every request past its prefill (`decodable`);
- then it waits for whichever lane's step ends first (polling both lanes' events, and waking
  early when new work arrives for an idle lane), completes it, and goes round again.

A request in a launched step is `in_flight` until its tokens are back: the other lane's plans
leave it out, preemption cannot take its pages, and a cancel takes effect when that step ends,
so no step ever writes pages that were given to another request. A prompt's first token comes
from its prefill step; from the next decode step on it decodes with the rest.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from services.llm.lane import Lane, Launched
from services.llm.scheduler import Plan

if TYPE_CHECKING:
    from services.llm.engine import NativeEngine

log = logging.getLogger(__name__)

POLL_S = 0.0002  # between looks at the lanes' events: well under a step (5-25 ms on the H200)


def run_split(engine: NativeEngine) -> None:
    """Serve until the engine stops; then wait for the steps in flight, so their pages are free to go."""
    sched, runner = engine.scheduler, engine.runner
    flying: dict[str, Launched] = {}
    while not engine._stop:
        engine._wake.clear()
        engine._drain_inbox()
        planned = False  # a plan came, even if its launch failed: look again before sleeping
        if runner.prefill_lane.name not in flying:
            plan = sched.schedule(decodes=False)
            planned |= launch(engine, flying, runner.prefill_lane, plan)
        if runner.decode_lane.name not in flying:
            decodes = sched.decodable()
            if decodes:
                planned |= launch(engine, flying, runner.decode_lane, Plan(decode=decodes))
        if flying:
            wait_for_one(engine, flying)
        elif not planned:
            engine._wake.wait()
            if engine._trace:
                engine._trace.idle()
    for step in list(flying.values()):
        step.fetch.wait()
        engine._land(step.held)


def launch(engine: NativeEngine, flying: dict[str, Launched], lane: Lane, plan: Plan) -> bool:
    """Launch the plan on the lane; False when there was nothing to plan."""
    if plan.empty and not plan.preempted:
        return False
    step = engine._launch(plan, lane)
    if step is not None:
        flying[lane.name] = step
    return True


def wait_for_one(engine: NativeEngine, flying: dict[str, Launched]) -> None:
    """Complete the first lane's step to end; return early when work arrives and a lane is idle."""
    lanes = len(engine.runner.lanes)
    while True:
        for name, step in list(flying.items()):
            if step.fetch.ready():
                del flying[name]
                try:
                    engine._complete(step, name)
                except Exception as err:
                    engine._fail(step.held, err)
                return
        if engine._wake.is_set() and len(flying) < lanes:
            return
        time.sleep(POLL_S)
