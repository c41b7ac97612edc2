"""Submitting a request to the engine and relaying its outputs to an asyncio caller.

Shared by the gRPC servicer and the benchmark's in-process target, so that the two run
the same code around the engine.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable

import torch

from services.common.errors import InvalidArgument
from services.common.qos import QosLevel
from services.common.sampling import Sampling
from services.llm.detokenizer import Detokenizer
from services.llm.engine import Engine
from services.llm.request import Output, Request
from services.model.prompt import PromptBuilder

_ids = itertools.count()


class Submission:
    """One request in the engine, with the queue its outputs arrive on."""

    def __init__(self, engine: Engine, req: Request, outputs: asyncio.Queue[Output]) -> None:
        self.engine, self.req, self._outputs = engine, req, outputs

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
                self.engine.abort(self.req.id)


def new_request(
    prompts: PromptBuilder,
    default_max_tokens: int,
    request_id: str,
    prompt: str,
    features: list[torch.Tensor],
    sampling: Sampling,
    qos: QosLevel,
    emit: Callable[[Output], None],
) -> Request:
    """The engine's Request for a prompt and its images; INVALID_ARGUMENT if the prompt leaves no room.

    Shared by both engines, so that prompts, token budgets and request ids are the same.
    """
    spec = prompts.spec
    built = prompts.build(prompt, len(features))
    room = spec.text.max_context - len(built.ids)
    if sampling.max_tokens is not None and sampling.max_tokens > room:
        raise InvalidArgument(
            f"sampling.max_tokens={sampling.max_tokens} does not fit: the prompt takes {len(built.ids)} of the "
            f"model's {spec.text.max_context} context tokens, leaving {room}"
        )
    if room < 1:
        raise InvalidArgument(f"the prompt takes {len(built.ids)} tokens, the model's whole context")
    return Request(
        id=f"{request_id or 'req'}#{next(_ids)}",
        prompt_ids=built.ids,
        image_positions=built.image_positions,
        image_features=features,
        text_tokens=built.text_tokens,
        sampling=sampling,
        max_new=sampling.max_tokens if sampling.max_tokens is not None else min(default_max_tokens, room),
        qos=qos,
        detok=Detokenizer(prompts.tokenizer, sampling.stop),
        emit=emit,
    )


def submit(
    engine: Engine,
    prompts: PromptBuilder,
    default_max_tokens: int,
    request_id: str,
    prompt: str,
    features: list[torch.Tensor],
    sampling: Sampling,
    qos: QosLevel,
    lease_hooks: tuple[Callable[[], None], Callable[[], None]] | None = None,
) -> Submission:
    """Build the prompt (INVALID_ARGUMENT if it leaves no room) and hand the request to the engine.

    `lease_hooks` (verify, release) go with features that alias the vision arena.
    """
    loop = asyncio.get_running_loop()
    outputs: asyncio.Queue[Output] = asyncio.Queue()

    def emit(out: Output) -> None:  # engine thread -> this loop
        loop.call_soon_threadsafe(outputs.put_nowait, out)

    req = new_request(prompts, default_max_tokens, request_id, prompt, features, sampling, qos, emit)
    if lease_hooks is not None:
        req.verify_leases, req.release_leases = lease_hooks
    engine.add(req)
    return Submission(engine, req, outputs)
