"""The llm scheduler: a pure policy over requests, batch places and KV pages (no torch, no metrics).

Each step it plans a `Plan`, the contract with the model runner:
- **prefill chunks** under a token budget (`max_prefill_tokens`; image positions count like
  any other): first the prompts already being prefilled, in admission order, then new
  requests admitted in QoS order (class, aged by waiting time, then arrival). A new prompt
  joins a step that already holds prefill rows only if it fits what is left whole; alone in a
  step, a prompt longer than the budget is split, and its next chunk comes next step. So no
  prompt's head fills a step's leftover: its rows would cost the step as much as anywhere, but
  the prompt would pay a chunk of its own later (a weight read for a few rows) and lose the
  fresh-prompt path (services/llm/packed.py), and each running request waits through every
  step with prompts for its next token (docs/PERF.md has what a large step costs them);
- **decodes**: one token for every running request whose prefill is complete. Decodes run
  every step, beside whatever prefill the step holds.

A request in a launched step whose tokens are not back (the engine's `OneAhead` pacing) is
planned too, as what comes after that step: its next chunk, or a decode fed the token that step
samples; one whose unseen token is its last (`max_new`) is left out. It may be preempted: the
steps run in one stream, so the step in flight is done with its pages before the step that gives
them to another runs; a request preempted by a plan is not admitted again by the same plan.

A request is admitted when a batch place is free (at most `max_batch` run at once) and the
pool has pages for its whole sequence (prompt + max_new); it holds them until it finishes.
So a running request never waits for memory, and a request waits in line rather than
failing when the pool is full.

Prefix cache: at admission the request's leading full prompt pages are looked up by key
(services/llm/prefix.py) and the pool's pages shared, then the longest cached leading part of
its next page, which the runner copies into the request's own page (`Request.kv_copy`); its
prefill starts after them (always leaving one prompt position to compute). As a prefill
completes full prompt pages the engine registers them (`PrefixCache.computed`), and the parts
of the request's pages once its prompt is done, for the requests after it. Preemption and
finishing drop the request's hold on its pages; cached pages nobody holds are evicted only
when the pool needs them (services/llm/block_manager.py). A request sent as its images' content
keys alone (`features_cached`) is admitted only while the pool holds every image position
(else `Plan.refused`), and never preempted.

A greedy repeat of a whole prompt whose first token the pool keeps (and whose features need no
keeping) is admitted with all of its prompt cached and that token (`Plan.answered`), and planned as
a decode at once. Otherwise a prefill's last position, when it reads no image and no features need
keeping (a sampled repeat), is planned as a decode row (`_one_left`): a decode step, or a row
riding in a prompt step, rather than a prompt step of its own.

Preemption: when a realtime request heads the queue and there is no place or no room for
it, the scheduler takes the place and pages of running best-effort requests that still
compete below it (a best-effort request ages into the realtime class after 2 x AGING_S, and
from then on is not preempted, so none is preempted forever), the one with the fewest
generated tokens first (the least work lost). A victim goes back to the queue with its
tokens and is resumed by recomputation: its next prefill covers the prompt and every token
it generated. The plan says what happened (admitted, preempted); the engine records it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.qos import AGING_S, QosLevel, effective_class
from services.llm.block_manager import BlockManager
from services.llm.prefix import PrefixCache
from services.llm.request import Request, Status

DEFAULT_MAX_PREFILL_TOKENS = 1024


@dataclass(frozen=True)
class Chunk:
    """Positions [start, end) of one request's prefill, computed in this step."""

    req: Request
    start: int
    end: int

    @property
    def completes(self) -> bool:
        """The last chunk of its prefill: the step samples the request's next token from it."""
        return self.end == self.req.prefill_target


@dataclass
class Plan:
    prefill: list[Chunk] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)  # their first chunk is in `prefill`
    # Sent as content keys alone, and the pool no longer holds their images' KV: the engine
    # answers them FeaturesNeeded (the caller sends the features).
    refused: list[Request] = field(default_factory=list)
    # Admitted with their whole prompt cached and its first token (the prefix cache's): the engine
    # hands the token out before the step; those with more to generate are in `decode`.
    answered: list[tuple[Request, int]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        """Nothing to run, and nobody to answer."""
        return not self.prefill and not self.decode and not self.refused and not self.answered


class Scheduler:
    def __init__(
        self,
        max_batch: int,
        blocks: BlockManager,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        aging_s: float = AGING_S,
        clock: Callable[[], float] = time.perf_counter,
        prefix_cache: bool = True,
    ) -> None:
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        self.max_batch, self.blocks, self.max_prefill_tokens = max_batch, blocks, max_prefill_tokens
        self._waiting: list[Request] = []
        self.running: list[Request] = []  # in admission order
        self.aging_s, self.clock = aging_s, clock
        self.prefix = PrefixCache(blocks, prefix_cache)
        # Waiting requests per class, kept as the queue changes (read by the engine's gauges).
        self.waiting_by_qos: Counter[QosLevel] = Counter()

    def add(self, req: Request) -> None:
        self._waiting.append(req)
        self.waiting_by_qos[req.qos] += 1

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def free_places(self) -> int:
        return self.max_batch - len(self.running)

    def schedule(self) -> Plan:
        """The next step's plan."""
        plan = Plan()
        budget = self.max_prefill_tokens
        decoding = []
        for req in self.running:  # prompts already part-way through their prefill go on first
            if not self._plannable(req):
                continue
            if not req.prefilling or self._one_left(req):
                decoding.append(req)
            elif budget > 0:
                end = min(req.prefill_target, req.computed + budget)
                plan.prefill.append(Chunk(req, req.computed, end))
                budget -= end - req.computed
        sources: list[int] = []  # the pages admitted requests copy parts from: held while this plan admits
        if self._waiting and budget > 0:
            budget = self._admit(plan, budget, decoding, sources)
        self.blocks.release(sources)  # the runner copies from them before the step's forward, ahead of any write
        if plan.preempted:  # a victim's chunk or decode this step is dropped with it
            gone = {id(r) for r in plan.preempted}
            plan.prefill = [c for c in plan.prefill if id(c.req) not in gone]
            plan.admitted = [r for r in plan.admitted if id(r) not in gone]
            decoding = [r for r in decoding if id(r) not in gone]
        plan.decode = decoding
        return plan

    @staticmethod
    def _plannable(req: Request) -> bool:
        """Whether an admitted request may be in the next step."""
        if req.status is Status.FINISHED:  # its answer is out; its pages wait for its step in flight
            return False
        return req.generated < req.max_new  # else the step in flight samples its last token

    @staticmethod
    def _one_left(req: Request) -> bool:
        """A prefill with one position left, not an image's, whose features nobody needs to keep: that
        position runs as a decode row, not as a prompt step's chunk, which costs more (docs/PERF.md)."""
        return req.prefill_target - req.computed == 1 and req.computed >= req.features_end and req.leases is None

    def _admit(self, plan: Plan, budget: int, decoding: list[Request], sources: list[int]) -> int:
        """Admit waiting requests into the plan, as chunks, or into `decoding`. A part's
        source page stays held (`sources`): a later admission must not take it, and copy into it first."""
        now = self.clock()
        # Sorting a short queue costs less than keeping an aged heap.
        self._waiting.sort(key=lambda r: (self._class(r, now), r.arrival))
        while self._waiting and budget > 0:
            req = self._waiting[0]
            if any(req is v for v in plan.preempted):  # the rest of the queue was admitted before it
                return budget
            # Its features are read in place (leases) only while a prefill reads them: it computes.
            first = None if req.leases is not None else self.prefix.first_token(req)
            shared, part, start = self.prefix.lookup(req, whole=first is not None)
            if start < req.prompt_len:  # a page before the prompt's end was evicted: it computes
                first = None
            if plan.prefill and req.seq_len - start > budget:  # whole, or not yet
                return budget
            if req.features_cached and start < req.features_end:  # evicted while it waited
                plan.refused.append(self._pop())
                continue
            held = [*shared, part[0]] if part else shared
            new_pages = self.blocks.pages_for(self._tokens(req)) - len(shared)
            while not self._room(new_pages, held):
                victim = self._victim(req, now)
                if victim is None:
                    return budget  # the head waits; nothing behind it overtakes it
                self._preempt(victim, now)
                plan.preempted.append(victim)
            self._pop()
            self.blocks.share(held)  # the part's page too, so that no allocation of this plan evicts it
            req.blocks = shared + self.blocks.allocate(new_pages)
            sources += [part[0]] if part else []
            req.kv_copy = part
            req.registered = len(shared)
            req.computed = start  # after the shared pages and the copied part
            if not req.preempted_at:
                req.cached_tokens = req.computed
            req.prefill_target = req.seq_len
            req.status = Status.RUNNING
            self.running.append(req)
            plan.admitted.append(req)
            if first is not None:
                plan.answered.append((req, first))
                if req.max_new > 1:  # else the first token ends it
                    decoding.append(req)
                continue
            if self._one_left(req):
                decoding.append(req)
                continue
            end = min(req.prefill_target, req.computed + budget)
            plan.prefill.append(Chunk(req, req.computed, end))
            budget -= end - req.computed
        return budget

    @staticmethod
    def _tokens(req: Request) -> int:
        """Positions a request may fill: its prompt and every token it may generate."""
        return req.prompt_len + req.max_new

    def _room(self, pages: int, shared: list[int]) -> bool:
        return len(self.running) < self.max_batch and self.blocks.can_allocate(pages, shared)

    def _class(self, req: Request, now: float) -> int:
        return effective_class(req.qos, now - req.arrival, self.aging_s)

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
            r
            for r in self.running
            if r.qos is QosLevel.BEST_EFFORT
            and self._class(r, now) > rank
            and r.status is Status.RUNNING
            and not r.features_cached  # a resume would need its features
        ]
        return min(candidates, key=lambda r: (len(r.output_ids), -r.arrival), default=None)

    def _preempt(self, req: Request, now: float) -> None:
        """Free a running request's place and pages and queue it again; it resumes by recomputation.

        Its KV state is the runner's to reset (the engine tells it, from the plan).
        """
        self._release(req)
        req.computed = 0  # its KV state goes with its pages; admission sets where it resumes
        req.status = Status.WAITING
        req.preempted_at.append(now)
        self.add(req)

    def _release(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.release(req.blocks)
        req.blocks = []

    def finish(self, req: Request) -> None:
        """Free a request's place and pages (finished, aborted or failed)."""
        if req.blocks:
            self._release(req)

    def drop_waiting(self, request_id: str) -> Request | None:
        for i, req in enumerate(self._waiting):
            if req.id == request_id:
                return self._pop(i)
        return None

    def all_waiting(self) -> list[Request]:
        return list(self._waiting)
