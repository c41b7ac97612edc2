"""The engine thread's loop with `--lanes shared` (the default): each step launched a step ahead.

The thread plans and launches step N+1 while step N runs, and only then waits for N's tokens and
hands them out. The host's part of a step (draining the inbox, planning, staging, launching,
and then the wake-up after the sync and the postprocess: on the H200 0.3 ms a decode step and
1.0-1.4 ms a step with a prompt, docs/PERF.md) overlaps the device's, which no longer waits for
the host between steps. vLLM's async scheduling and SGLang's overlap scheduler do the same.

What makes it possible:
- the scheduler plans requests that are in flight too (`Scheduler(follow=True)`): a prompt's
  next chunk, or a decode of the token the step in flight samples, which the runner feeds from
  that step's tokens on the device (services/llm/runner.py); one whose last token is in flight
  is left out;
- both steps run in one stream, so a page freed or preempted while step N runs is written by a
  later step only after N is done with it;
- a request that N ends by EOS or a stop string rides in N+1 once more; that token is dropped.

Only where a launch queues work and returns (CUDA, `NativeEngine.step_ahead`): on the CPU it
computes the step, so running ahead would hold each step's tokens back until the next step is
computed (in one run of the CPU overload test at `7f770ea`, realtime's P99 was 2.8x its
unloaded P99, where the test allows 2x). There each step is handed out as soon as it is launched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.llm.lane import Launched

if TYPE_CHECKING:
    from services.llm.engine import NativeEngine


def run_shared(engine: NativeEngine) -> None:
    """Serve until the engine stops; then complete the step in flight, so its pages are free to go."""
    ahead: Launched | None = None  # launched, its tokens not yet handed out
    while not engine._stop:
        engine._drain_inbox()
        plan = engine.scheduler.schedule()
        step = None if plan.empty else engine._launch(plan, engine.runner.prefill_lane)
        if step is not None and not engine.step_ahead:  # the CPU: the launch computed it already
            settle(engine, step)
            step = None
        if ahead is not None:
            settle(engine, ahead)  # its results may let the next plan admit or finish more
        elif plan.empty:
            engine._wake.wait()
            engine._wake.clear()
            if engine._trace:
                engine._trace.idle()
        ahead = step
    if ahead is not None:
        settle(engine, ahead)


def settle(engine: NativeEngine, step: Launched) -> None:
    """Complete a launched step; a failure fails its requests, and the engine serves the rest."""
    try:
        engine._complete(step)
    except Exception as err:
        engine._fail(step.held, err)
