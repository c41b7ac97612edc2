"""The native llm engine: `schedule -> run -> postprocess` on one dedicated thread.

On CUDA the thread launches each step before it hands out the tokens of the one ahead of it
(services/llm/shared_loop.py); with `--lanes split` it keeps a prefill step and a decode step in
flight at once (services/llm/split_loop.py). The bookkeeping around a step (`_begin`,
`_complete`) is the same in both. A request ended while a launched step holds it (a cancel, a
stop found in the tokens of the step ahead) is answered at once; its pages and leases go when
no launched step holds it (`_release`).

It implements the Engine interface (services/llm/interface.py) without gRPC: `submit`
builds a Request and streams its `Output`s to the caller's event loop; `abort` stops a
request within one step and frees its batch place and KV pages. Features that alias the
vision arena (CUDA IPC) are read in place: their leases are verified before the chunk that
reads them and again once the step that read them has ended, and then released.

The scheduler decides (admit, preempt, finish) and the model runner computes; this loop
carries out the plan and records what happened in the metrics.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from services.common.errors import FeaturesNeeded, MeshError
from services.common.metrics import BATCH_SIZE, PREEMPTIONS, PREFIX_FIRST_TOKENS, PREFIX_TOKENS, watch_scheduler
from services.common.qos import QosLevel
from services.llm.block_manager import BlockManager
from services.llm.interface import EngineStats, Job, Leases
from services.llm.lane import Lane, Launched
from services.llm.request import Finish, Output, Request
from services.llm.runner import ModelRunner
from services.llm.scheduler import DEFAULT_MAX_PREFILL_TOKENS, Plan, Scheduler
from services.llm.shared_loop import run_shared
from services.llm.split_loop import run_split
from services.llm.step_trace import StepTrace
from services.llm.submit import QueuedSubmission, new_request, queued_emit
from services.model.prompt import PromptBuilder

log = logging.getLogger(__name__)


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
        self.scheduler = Scheduler(
            max_batch, pages, max_prefill_tokens, prefix_cache=prefix_cache, follow=not runner.split
        )
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="llm-engine", daemon=True)
        self.eos = set(runner.spec.text.eos_token_ids)
        # Launch each step before handing out the one ahead (services/llm/shared_loop.py) where a
        # launch only queues work: on CUDA. On the CPU a launch computes the step, so running ahead
        # would hold every token back by one step (tests turn it on there to check its logic).
        self.step_ahead = runner.device.type == "cuda"
        self._trace = StepTrace(step_trace) if step_trace else None
        if self._trace:
            for lane in runner.lanes.values():
                for fetch in lane.fetches:
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
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    @property
    def device(self):
        return self.runner.device

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(running=len(s.running), waiting=s.waiting, free_slots=s.free_places)

    # ---- engine thread ----
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
            req.aborted = True
            self._finish(req, Finish.ABORT)  # what it holds goes once no launched step holds it

    def _loop(self) -> None:
        if self.runner.split:
            run_split(self)  # services/llm/split_loop.py: a prefill and a decode step in flight at once
        else:
            run_shared(self)  # services/llm/shared_loop.py: each step launched before the one ahead ends
        for req in list(self.scheduler.running) + self.scheduler.all_waiting():
            self._finish(req, Finish.ABORT, "the llm server is shutting down")
        if self._trace:
            self._trace.close()

    def _fail(self, reqs: list[Request], err: Exception) -> None:
        log.exception("engine step failed")
        for req in reqs:
            if req.running:
                self._finish(req, Finish.ERROR, f"engine step failed: {type(err).__name__}: {err}")

    def _land(self, reqs: list[Request]) -> None:
        """A step that held these has ended: release those that ended meanwhile and nothing holds now."""
        for req in reqs:
            req.in_flight -= 1
            if req.ended:
                self._release(req)

    def _launch(self, plan: Plan, lane: Lane) -> Launched | None:
        """Launch a plan on a lane; None when nothing of it was left to run, or it failed (its
        requests with it, once what it queued has ended: the rest are served)."""
        step = self._begin(plan)
        if step is None:
            return None
        for req in step.held:
            req.in_flight += 1
        try:
            step.fetch = self.runner.launch(step.chunks, step.decodes, lane)
        except Exception as err:
            if lane.stream is not None:  # what it queued ends before its pages can go to others
                lane.stream.synchronize()
            else:
                self.runner.synchronize()
            self._land(step.held)
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
        decodes = [r for r in plan.decode if r.running]
        if not chunks and not decodes:
            return None
        if decodes:
            BATCH_SIZE.labels("llm").observe(len(decodes))
        return Launched(chunks, decodes, None, time.perf_counter())

    def _complete(self, step: Launched, lane: str = "shared") -> None:
        """A launched step's end: wait for its tokens (the host sync: its reads are done), then
        register its prompt pages, release the features it read, and hand out the tokens."""
        chunks, decodes, fetch = step.chunks, step.decodes, step.fetch
        try:
            tokens = fetch.wait()
        finally:
            self._land(step.held)
        for c in chunks:
            # Features it read that were reused meanwhile fail it, and nothing it computed is kept.
            if c.req.ended or not c.req.running or not self._leases_hold(c.req, c.start):
                continue
            self.scheduler.prefix.computed(c.req)  # its full prompt pages, for the prompts after it
            # Read; no later chunk reads them (`computed` may be past them already: the next step,
            # launched, may still be reading them).
            if c.req.leases and c.end >= c.req.features_end:
                c.req.drop_leases()
        done, sampled = time.perf_counter(), [c.req for c in chunks if c.completes] + decodes  # tokens' order
        for req, token in zip(sampled, tokens, strict=True):
            if not req.prefill_done_at and req.running and not req.ended:  # a resume keeps its first clock
                req.prefill_done_at = done
                self.scheduler.prefix.computed(req)  # a prompt's last position may run as a decode
                self.scheduler.prefix.answered(req, token)  # for a greedy repeat of its prompt
        self._postprocess(sampled, tokens)
        if self._trace:
            rows = sum(c.end - c.start for c in chunks)
            device = fetch.device_ms()
            self._trace.record(
                step.launched, done, time.perf_counter(), rows, len(chunks), len(decodes), fetch.marked_at, device, lane
            )

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

    def _postprocess(self, reqs: list[Request], tokens: list[int]) -> None:
        for req, tok in zip(reqs, tokens, strict=True):
            if req.ended or not req.running:  # ended or preempted while the step ran: its token goes
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
        if req.ended:
            return
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
