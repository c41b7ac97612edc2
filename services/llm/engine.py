"""The native llm engine: `schedule -> run -> postprocess` on one dedicated thread.

It implements the Engine interface (services/llm/interface.py) without gRPC: `submit`
builds a Request and streams its `Output`s to the caller's event loop; `abort` stops a
request within one step and frees its slot. Features that alias the vision arena (CUDA
IPC) are read in place: their leases are verified around the prefill and released after it.

The scheduler decides (admit, preempt, finish) and the model runner computes; this loop
carries out the plan and records what happened in the metrics.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from services.common.errors import MeshError
from services.common.metrics import BATCH_SIZE, KV_SLOTS, PREEMPTIONS, QUEUE_DEPTH
from services.common.qos import QosLevel
from services.llm.interface import EngineStats, Job, Leases
from services.llm.request import Finish, Output, Request
from services.llm.runner import ModelRunner
from services.llm.scheduler import Plan, Scheduler
from services.llm.submit import QueuedSubmission, new_request, queued_emit
from services.model.prompt import PromptBuilder

log = logging.getLogger(__name__)


class NativeEngine:
    """vlmesh's own engine: continuous batching in QoS order, preemption, zero-copy CUDA features."""

    reads_in_place = True

    def __init__(self, runner: ModelRunner, max_batch: int, prompts: PromptBuilder, default_max_tokens: int) -> None:
        self.runner = runner
        self.prompts, self.default_max_tokens = prompts, default_max_tokens
        self.scheduler = Scheduler(max_batch)
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="llm-engine", daemon=True)
        self.eos = set(runner.spec.text.eos_token_ids)
        slots = self.scheduler.slots
        KV_SLOTS.labels("used").set_function(lambda: slots.n - slots.free)
        KV_SLOTS.labels("free").set_function(lambda: slots.free)
        waiting = self.scheduler.waiting_by_qos
        for q in QosLevel:
            QUEUE_DEPTH.labels("llm", q.wire).set_function(lambda q=q: waiting[q])

    # ---- called from any thread ----
    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job, leases: Leases | None = None) -> QueuedSubmission:
        """Build the request (INVALID_ARGUMENT if its prompt leaves no room) and queue it."""
        outputs, emit = queued_emit()
        req = new_request(self.prompts, self.default_max_tokens, job, emit)
        req.leases = leases
        self.add(req)
        return QueuedSubmission(req, outputs, self.abort)

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
        return EngineStats(running=len(s.running), waiting=s.waiting, free_slots=s.slots.free)

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
            self._finish(req, Finish.ABORT)

    def _loop(self) -> None:
        while not self._stop:
            self._drain_inbox()
            plan = self.scheduler.schedule()
            if plan.empty:
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                self._step(plan)
            except Exception as err:  # fail the step's requests, keep serving the rest
                log.exception("engine step failed")
                for req in plan.prefill + plan.decode:
                    if req.slot >= 0:
                        self._finish(req, Finish.ERROR, f"engine step failed: {type(err).__name__}: {err}")
        for req in list(self.scheduler.running) + self.scheduler.all_waiting():
            self._finish(req, Finish.ABORT, "the llm server is shutting down")

    def _step(self, plan: Plan) -> None:
        now = time.perf_counter()
        for req in plan.preempted:
            self.runner.evict(req)
            PREEMPTIONS.labels("llm", req.qos.wire).inc()
        for req in plan.prefill:
            resumed = bool(req.preempted_at)  # recompute: the prompt and every token generated so far
            if not resumed:
                req.scheduled_at = now
                req.generator = None if req.sampling.greedy else self.runner.new_generator(req.sampling.seed)
            try:
                if req.leases:
                    req.leases.verify()  # not reclaimed while the request waited
                logits = self.runner.prefill(req)
                if req.leases and req.qos is QosLevel.BEST_EFFORT:
                    # It may be preempted and recomputed after its leases are gone: keep a copy.
                    self.runner.own_features(req)
                tokens = self.runner.sample([req], logits)  # a host sync: the prefill has read the features
                if req.leases:
                    req.leases.verify()  # and they were not reused while it read them
            except MeshError as err:
                self._finish(req, Finish.ERROR, err)
                continue
            req.drop_leases()
            if not resumed:
                req.prefill_done_at = time.perf_counter()
            self._postprocess([req], tokens)
        decode = [r for r in plan.decode if r.slot >= 0]
        if decode:
            BATCH_SIZE.labels("llm").observe(len(decode))
            logits = self.runner.decode(decode)
            self._postprocess(decode, self.runner.sample(decode, logits))

    def _postprocess(self, reqs: list[Request], tokens: list[int]) -> None:
        for req, tok in zip(reqs, tokens, strict=True):
            if tok in self.eos and not req.sampling.ignore_eos:
                self._finish(req, Finish.STOP)
                continue
            req.output_ids.append(tok)
            text, stopped = req.detok.push(tok)
            if stopped:
                self._finish(req, Finish.STOP, text=text, token_ids=[tok])
            elif len(req.output_ids) >= req.max_new or req.computed + 1 >= self.runner.max_context:
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
        """End a request; its last token rides on the final output (one message less to relay)."""
        req.drop_leases()
        self.scheduler.finish(req)
        req.finished_at = time.perf_counter()
        if finish in (Finish.STOP, Finish.LENGTH):
            text += req.detok.flush()
        req.emit(Output(text, token_ids or [], finish=finish, error=error))
