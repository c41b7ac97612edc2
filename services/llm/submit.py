"""From a Job to the engine's Request, and the native engine's stream of outputs.

`new_request` is shared by both engines, so that prompts, token budgets and request ids
are the same whichever engine serves.

Outputs cross from the engine thread to the servicer's event loop through one `Mailbox` per
loop: the first output of a burst wakes the loop, the rest of the step's outputs join it. A
wake-up per output (`call_soon_threadsafe`, a write to the loop's self-pipe) would cost the
engine thread per sequence per step, and its time between two steps leaves the GPU idle
(docs/PERF.md).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import weakref
from collections.abc import AsyncIterator, Callable

from services.common.errors import InvalidArgument
from services.llm.detokenizer import Detokenizer
from services.llm.interface import Job
from services.llm.request import Output, Request
from services.model.mrope import prompt_positions
from services.model.prompt import PromptBuilder

_ids = itertools.count()


def new_request(prompts: PromptBuilder, default_max_tokens: int, job: Job, emit: Callable[[Output], None]) -> Request:
    """The engine's Request for a job; INVALID_ARGUMENT if the prompt leaves no room."""
    spec = prompts.spec
    # A picture's features are [tokens, H], or [rows, cols, H] where pictures take positions by
    # their size: flattened here (a view), the grid kept for the multimodal rotary positions.
    grids = [(f.shape[0], f.shape[1]) for f in job.features if f.dim() == 3]
    features = [f.flatten(0, 1) if f.dim() == 3 else f for f in job.features]
    built = prompts.build(job.prompt, [f.shape[0] for f in features])
    context, used = spec.text.max_context, len(built.ids)
    room = context - used
    sampling = job.sampling
    if job.max_prompt_tokens and used > job.max_prompt_tokens:
        raise InvalidArgument(
            f"the prompt takes {used} tokens (image tokens included); this request's tenant may send at most "
            f"{job.max_prompt_tokens} (its max_prompt_tokens)"
        )
    if room < 1:  # image positions included: they are part of what the model reads
        raise InvalidArgument(
            f"the prompt takes {used} tokens; the model's context is {context}, "
            "which leaves no room for an answer: shorten the prompt"
        )
    if sampling.max_tokens is not None and sampling.max_tokens > room:
        raise InvalidArgument(
            f"sampling.max_tokens={sampling.max_tokens} does not fit after this prompt: it takes {used} of the "
            f"model's {context} context tokens, leaving room for at most {room}"
        )
    mrope, delta = None, 0
    if spec.text.mrope_section is not None:
        if len(grids) != len(features):
            raise InvalidArgument("image_features: this model reads each picture's grid of tokens ([rows, cols, H])")
        mrope, delta = prompt_positions(used, built.image_positions, grids)
    return Request(
        id=f"{job.request_id or 'req'}#{next(_ids)}",
        prompt_ids=built.ids,
        image_positions=built.image_positions,
        image_features=features,
        mrope=mrope,
        rope_delta=delta,
        image_keys=list(job.feature_keys),
        text_tokens=built.text_tokens,
        sampling=sampling,
        max_new=sampling.max_tokens if sampling.max_tokens is not None else min(default_max_tokens, room),
        qos=job.qos,
        detok=Detokenizer(prompts.tokenizer, sampling.stop),
        emit=emit,
    )


class QueuedSubmission:
    """A request in the native engine: its outputs arrive from the engine thread on an asyncio queue."""

    def __init__(self, req: Request, outputs: asyncio.Queue[Output], abort: Callable[[str], None]) -> None:
        self.req, self._outputs, self._abort = req, outputs, abort

    async def outputs(self) -> AsyncIterator[Output]:
        """Coalesced outputs (all that is already queued, in one): the last has `finish` set.

        Leaving early (cancellation, a deadline, an error) aborts the request in the engine,
        which frees its KV slot within one step.
        """
        finished = False
        try:
            while not finished:
                out = await self._outputs.get()
                text, ids = out.text, list(out.token_ids)
                while out.finish is None and not self._outputs.empty():
                    out = self._outputs.get_nowait()
                    text += out.text
                    ids.extend(out.token_ids)
                finished = out.finish is not None
                yield Output(text, ids, out.finish, out.error)
        finally:
            if not finished:
                self._abort(self.req.id)


class Mailbox:
    """Outputs posted from any thread to the queues of one event loop, one wake-up per burst."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # Weakly: `_mailboxes` is keyed by the loop, and a value that held it would keep it alive.
        self._loop = weakref.ref(loop)
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, Output]] = []
        self._woken = False  # a delivery is scheduled and has not taken the items yet

    def post(self, queue: asyncio.Queue, out: Output) -> None:
        """Put `out` on `queue` in the loop, after every output posted before it (RuntimeError: loop closed)."""
        with self._lock:
            self._items.append((queue, out))
            if self._woken:
                return
            self._woken = True
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("Event loop is closed")
            loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: nothing posted to it can be delivered
            with self._lock:
                self._items, self._woken = [], False
            raise

    def _deliver(self) -> None:
        with self._lock:
            items, self._items, self._woken = self._items, [], False
        for queue, out in items:
            queue.put_nowait(out)


_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()


def queued_emit() -> tuple[asyncio.Queue[Output], Callable[[Output], None]]:
    """A queue on the running loop, and the thread-safe callback that fills it from the engine thread."""
    loop = asyncio.get_running_loop()
    outputs: asyncio.Queue[Output] = asyncio.Queue()
    mailbox = _mailboxes.get(loop)
    if mailbox is None:
        mailbox = _mailboxes[loop] = Mailbox(loop)

    def emit(out: Output) -> None:  # engine thread -> this loop
        mailbox.post(outputs, out)

    return outputs, emit
