"""The native llm engine: `schedule -> launch -> hand out` on one dedicated thread.

It implements the Engine interface (services/llm/interface.py) without gRPC: `submit` builds a
Request and streams its `Output`s to the caller's event loop; `abort` stops a request within one
step and frees its batch place and KV pages. The scheduler decides (admit, preempt, finish), the
model runner computes, and this loop carries out the plan and records what happened.

Pacing: on CUDA a launch only queues work, so the thread launches step N+1 before it waits for
N's tokens and hands them out (`OneAhead`): the host's planning and staging overlap the device's
work, as vLLM's async scheduling and SGLang's overlap scheduler do. On the CPU a launch computes
the step, so each step is handed out at once (`Lockstep`).

A request ended while a launched step holds it (a cancel, a stop found in the tokens of the step
ahead) is answered at once; its pages and leases go when no launched step holds it. Features
that alias the vision arena (CUDA IPC) are read in place: their leases are verified before the
chunk that reads them and again once the step that read them has ended, and then released.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from services.common.errors import FeaturesNeeded, MeshError
from services.common.metrics import BATCH_SIZE, PREEMPTIONS, PREFIX_FIRST_TOKENS, PREFIX_TOKENS, watch_scheduler
from services.common.qos import QosLevel
from services.llm.block_manager import BlockManager
from services.llm.interface import EngineStats, Job, Leases
from services.llm.request import Finish, Output, Request, Status
from services.llm.runner import ModelRunner
from services.llm.scheduler import DEFAULT_MAX_PREFILL_TOKENS, Chunk, Plan, Scheduler
from services.llm.step_trace import StepTrace
from services.llm.submit import QueuedSubmission, new_request, queued_emit
from services.llm.transfers import TokenFetch
from services.model.prompt import PromptBuilder

log = logging.getLogger(__name__)


@dataclass
class Launched:
    """A launched step whose tokens are not handed out yet."""

    chunks: list[Chunk]
    decodes: list[Request]
    fetch: TokenFetch | None  # its tokens (None until its launch returns)
    launched: float  # host clock when its launch began

    @property
    def held(self) -> list[Request]:
        return [c.req for c in self.chunks] + self.decodes


class Lockstep:
    """Each step is handed out as soon as it is launched: where a launch computes the step (the CPU)."""

    def launched(self, step: Launched | None) -> list[Launched]:
        """The steps whose tokens to hand out now, given the one just launched (None: none was)."""
        return [step] if step is not None else []

    def drain(self) -> list[Launched]:
        """The steps still to hand out when the engine stops."""
        return []


class OneAhead(Lockstep):
    """Step N+1 is launched before N is handed out (CUDA). The scheduler plans requests in flight as
    what comes after that step (a prompt's next chunk, a decode of the token N samples, which the
    runner feeds on the device); both steps run in one stream, so pages freed or preempted while N
    runs are written only after N is done with them; a token sampled for a request N ended is dropped."""

    def __init__(self) -> None:
        self._ahead: Launched | None = None

    def launched(self, step: Launched | None) -> list[Launched]:
        done, self._ahead = self._ahead, step
        return [done] if done is not None else []

    def drain(self) -> list[Launched]:
        done, self._ahead = self._ahead, None
        return [done] if done is not None else []


class NativeEngine:
    """vlmesh's own engine: continuous batching in QoS order, preemption, zero-copy CUDA features."""

    reads_in_place = True

    def __init__(
        self,
        runner: ModelRunner,
        max_batch: int,
        prompts: PromptBuilder,
        default_max_tokens: int,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        prefix_cache: bool = True,
        step_trace: str | None = None,
    ) -> None:
        """`prefix_cache`: share the KV pages of prompts' equal leading pages (services/llm/prefix.py);
        `step_trace`: append a line per step to this file (services/llm/step_trace.py)."""
        self.runner = runner
        self.prompts, self.default_max_tokens = prompts, default_max_tokens
        pages = BlockManager(runner.n_pages, runner.page_size)
        self.scheduler = Scheduler(max_batch, pages, max_prefill_tokens, prefix_cache=prefix_cache)
        self.pacing: Lockstep = OneAhead() if runner.device.type == "cuda" else Lockstep()
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="llm-engine", daemon=True)
        self.eos = set(runner.spec.text.eos_token_ids)
        self._trace = StepTrace(step_trace) if step_trace else None
        if self._trace:
            for fetch in runner.fetches:
                fetch.timed = True  # each step's device span, for the trace
        watch_scheduler(self.scheduler)

    # ---- called from any thread ----
    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job, leases: Leases | None = None) -> QueuedSubmission:
        """Build the request (INVALID_ARGUMENT if its prompt leaves no room) and queue it."""
        outputs, emit = queued_emit()
        req = new_request(self.prompts, self.default_max_tokens, job, emit)
        req.leases = leases
        if job.features_cached:
            req.features_cached = True
            if not self.scheduler.prefix.holds_images(req):
                raise FeaturesNeeded()
        self.add(req)
        return QueuedSubmission(req, outputs, self.abort)

    @property
    def reads_cached_images(self) -> bool:
        return self.scheduler.prefix.enabled

    def add(self, req: Request) -> None:
        """Queue a built request; its outputs go to `req.emit` (from the engine thread)."""
        self._inbox.put(("add", req))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)

    @property
    def device(self):
        return self.runner.device

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(running=len(s.running), waiting=s.waiting, free_slots=s.free_places)

    # ---- the engine thread's loop ----
    def _serve(self) -> None:
        """Plan, launch and hand out steps until stopped; then end what is left."""
        while not self._stopping:
            self._drain_inbox()
            plan = self.scheduler.schedule()
            step = None if plan.empty else self._launch(plan)
            done = self.pacing.launched(step)
            for ended in done:
                self._hand_out(ended)  # its results may let the next plan admit or finish more
            if not done and plan.empty:
                self._idle()
        for ended in self.pacing.drain():  # its pages are then free to go
            self._hand_out(ended)
        for req in list(self.scheduler.running) + self.scheduler.all_waiting():
            self._finish(req, Finish.ABORT, "the llm server is shutting down")
        if self._trace:
            self._trace.close()

    def _idle(self) -> None:
        self._wake.wait()
        self._wake.clear()
        if self._trace:
            self._trace.idle()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self.scheduler.add(item)  # type: ignore[arg-type]
            else:
                self._abort(item)  # type: ignore[arg-type]

    def _abort(self, request_id: str) -> None:
        req = self.scheduler.drop_waiting(request_id)
        if req is None:
            req = next((r for r in self.scheduler.running if r.id == request_id), None)
        if req is not None:
            self._finish(req, Finish.ABORT)  # what it holds goes once no launched step holds it

    # ---- a step ----
    def _launch(self, plan: Plan) -> Launched | None:
        """Launch a plan; None when nothing of it was left to run, or it failed (its requests with
        it, once what it queued has ended: the rest are served)."""
        step = self._begin(plan)
        if step is None:
            return None
        for req in step.held:
            req.in_flight += 1
        try:
            step.fetch = self.runner.launch(step.chunks, step.decodes)
        except Exception as err:
            self.runner.synchronize()  # what it queued ends before its pages can go to others
            self._unhold(step.held)
            self._fail(step.held, err)
            return None
        return step

    def _begin(self, plan: Plan) -> Launched | None:
        """A plan's bookkeeping before its launch: the step it launches (chunks whose leases hold,
        decodes still running, the clock), or None when nothing is left to run."""
        now = time.perf_counter()
        for req in plan.refused:
            self._finish(req, Finish.ERROR, FeaturesNeeded())
        for req in plan.preempted:  # it resumes by recomputing what its pages held
            PREEMPTIONS.labels("llm", req.qos.wire).inc()
        for req in plan.admitted:
            if not req.preempted_at:  # resumed requests keep their clocks and their generator
                req.scheduled_at = now
                req.generator = None if req.sampling.greedy else self.runner.new_generator(req.sampling.seed)
                # Preemptible, and its features alias memory it holds only until its prefill.
                req.copy_features = req.leases is not None and req.qos is QosLevel.BEST_EFFORT
                PREFIX_TOKENS.labels("hit").inc(req.cached_tokens)
                PREFIX_TOKENS.labels("miss").inc(req.prompt_len - req.cached_tokens)
        for req, token in plan.answered:  # a greedy repeat: its first token from the prefix cache
            req.prefill_done_at = now
            PREFIX_FIRST_TOKENS.inc()
            self._postprocess([req], [token])
        chunks = [c for c in plan.prefill if self._leases_hold(c.req, c.start)]  # not reclaimed while it waited
        decodes = [r for r in plan.decode if r.status is Status.RUNNING]
        if not chunks and not decodes:
            return None
        if decodes:
            BATCH_SIZE.labels("llm").observe(len(decodes))
        return Launched(chunks, decodes, None, time.perf_counter())

    def _hand_out(self, step: Launched) -> None:
        """A launched step's end; a failure fails its requests, and the engine serves the rest."""
        try:
            self._complete(step)
        except Exception as err:
            self._fail(step.held, err)

    def _complete(self, step: Launched) -> None:
        """Wait for the step's tokens (the host sync: its reads are done), then register its prompt
        pages, release the features it read, and hand out the tokens."""
        chunks, decodes, fetch = step.chunks, step.decodes, step.fetch
        try:
            tokens = fetch.wait()
        finally:
            self._unhold(step.held)
        prefix = self.scheduler.prefix
        for c in chunks:
            # Features it read that were reused meanwhile fail it, and nothing it computed is kept.
            if c.req.status is not Status.RUNNING or not self._leases_hold(c.req, c.start):
                continue
            prefix.computed(c.req)  # its full prompt pages, for the prompts after it
            # Read; no later chunk reads them (`computed` may be past them already: the next step,
            # launched, may still be reading them).
            if c.req.leases and c.end >= c.req.features_end:
                c.req.drop_leases()
        done, sampled = time.perf_counter(), [c.req for c in chunks if c.completes] + decodes  # tokens' order
        for req, token in zip(sampled, tokens, strict=True):
            if not req.prefill_done_at and req.status is Status.RUNNING:  # a resume keeps its first clock
                req.prefill_done_at = done
                prefix.computed(req)  # a prompt's last position may run as a decode
                prefix.answered(req, token)  # for a greedy repeat of its prompt
        self._postprocess(sampled, tokens)
        if self._trace:
            rows = sum(c.end - c.start for c in chunks)
            self._trace.record(
                step.launched, done, time.perf_counter(), rows, len(chunks), len(decodes), fetch.marked_at,
                fetch.device_ms(),
            )  # fmt: skip

    def _unhold(self, reqs: list[Request]) -> None:
        """A step that held these has ended: release those that ended meanwhile and nothing holds now."""
        for req in reqs:
            req.in_flight -= 1
            if req.status is Status.FINISHED:
                self._release(req)

    def _fail(self, reqs: list[Request], err: Exception) -> None:
        log.exception("engine step failed")
        for req in reqs:
            if req.status is Status.RUNNING:
                self._finish(req, Finish.ERROR, f"engine step failed: {type(err).__name__}: {err}")

    def _leases_hold(self, req: Request, start: int) -> bool:
        """Verify the leases of features read from position `start` on; a lost lease fails the request."""
        if req.leases is None or start >= req.features_end:
            return True
        try:
            req.leases.verify()
        except MeshError as err:
            self._finish(req, Finish.ERROR, err)
            return False
        return True

    # ---- a request's outputs ----
    def _postprocess(self, reqs: list[Request], tokens: list[int]) -> None:
        for req, tok in zip(reqs, tokens, strict=True):
            if req.status is not Status.RUNNING:  # ended or preempted while the step ran: its token goes
                continue
            if tok in self.eos and not req.sampling.ignore_eos:
                self._finish(req, Finish.STOP)
                continue
            req.output_ids.append(tok)
            text, stopped = req.detok.push(tok)
            if stopped:
                self._finish(req, Finish.STOP, text=text, token_ids=[tok])
            elif len(req.output_ids) >= req.max_new or req.seq_len >= self.runner.max_context:
                self._finish(req, Finish.LENGTH, text=text, token_ids=[tok])
            else:
                req.emit(Output(text, [tok]))

    def _finish(
        self,
        req: Request,
        finish: Finish,
        error: str | Exception | None = None,
        text: str = "",
        token_ids: list[int] | None = None,
    ) -> None:
        """End a request (once); its last token rides on the final output (one message less to relay).

        What it holds goes now, or when the last launched step that holds it has ended."""
        if req.status is Status.FINISHED:
            return
        req.status = Status.FINISHED
        req.finished_at = time.perf_counter()
        if finish in (Finish.STOP, Finish.LENGTH):
            text += req.detok.flush()
        req.emit(Output(text, token_ids or [], finish=finish, error=error))
        self._release(req)

    def _release(self, req: Request) -> None:
        """An ended request's pages, place and leases, once no launched step may read or write them."""
        if not req.in_flight:
            req.drop_leases()
            self.scheduler.finish(req)
