"""The llm's room check (new_request): one limit, the room this prompt leaves, in the words a user reads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.common.errors import InvalidArgument
from services.common.qos import QosLevel
from services.common.sampling import Sampling
from services.llm.interface import Job
from services.llm.submit import new_request
from services.model.prompt import PromptBuilder
from services.model.spec import load_spec
from tests.helpers import ROOT


@pytest.fixture(scope="module")
def prompts() -> PromptBuilder:
    return PromptBuilder(load_spec(ROOT / "models" / "demo"))


def job(prompts: PromptBuilder, prompt: str, max_tokens: int | None) -> Job:
    spec = prompts.spec
    features = [torch.zeros(spec.image_tokens, spec.text.hidden)]
    sampling = Sampling(max_tokens, 0.0, 1.0, None, (), 0, False)
    return Job("r1", prompt, features, sampling, QosLevel.STANDARD)


def test_max_tokens_past_the_room_names_the_room(prompts):
    prompt = "What is in the image?"
    used, context = len(prompts.build(prompt, 1).ids), prompts.spec.text.max_context
    room = context - used
    new_request(prompts, 16, job(prompts, prompt, room), lambda out: None)  # exactly the room fits
    with pytest.raises(InvalidArgument) as info:
        new_request(prompts, 16, job(prompts, prompt, room + 1), lambda out: None)
    assert info.value.message == (
        f"sampling.max_tokens={room + 1} does not fit after this prompt: it takes {used} of the model's "
        f"{context} context tokens, leaving room for at most {room}"
    )


@pytest.mark.parametrize("max_tokens", [None, 5])
def test_a_prompt_longer_than_the_context_names_the_context(prompts, max_tokens):
    prompt = "colour " * 400
    used, context = len(prompts.build(prompt, 1).ids), prompts.spec.text.max_context
    assert used > context
    with pytest.raises(InvalidArgument) as info:
        new_request(prompts, 16, job(prompts, prompt, max_tokens), lambda out: None)
    # The prompt is the problem whatever max_tokens says (not "leaving room for at most -300").
    assert info.value.message.startswith(f"the prompt takes {used} tokens; the model's context is {context}")


def test_a_prompt_over_its_tenants_max_prompt_tokens_is_refused(prompts):
    prompt = "What is in the image?"
    used = len(prompts.build(prompt, 1).ids)  # image tokens included
    for limit, ok in ((used, True), (used - 1, False), (0, True)):  # 0: no limit
        j = dataclasses.replace(job(prompts, prompt, 4), max_prompt_tokens=limit)
        if ok:
            new_request(prompts, 16, j, lambda out: None)
            continue
        with pytest.raises(InvalidArgument) as info:
            new_request(prompts, 16, j, lambda out: None)
        assert info.value.message == (
            f"the prompt takes {used} tokens (image tokens included); this request's tenant may send at most "
            f"{used - 1} (its max_prompt_tokens)"
        )


def test_a_burst_of_outputs_arrives_in_order_with_one_wake_up():
    """The engine thread posts a step's outputs while the loop is busy: they all arrive, in order, per
    request, and the loop is woken once for the burst, not once per output."""
    import asyncio
    import threading

    from services.llm.request import Output
    from services.llm.submit import queued_emit

    async def main():
        loop = asyncio.get_running_loop()
        wakes = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakes.append(1), real(*a))[1]
        pairs = [queued_emit() for _ in range(4)]

        def engine():
            for step in range(50):
                for i, (_, emit) in enumerate(pairs):
                    emit(Output(f"{i}:{step}", [step]))

        thread = threading.Thread(target=engine)
        thread.start()
        thread.join()  # the loop is blocked here: every post lands in one burst
        await asyncio.sleep(0.01)
        got = [[q.get_nowait().text for _ in range(q.qsize())] for q, _ in pairs]
        assert got == [[f"{i}:{s}" for s in range(50)] for i in range(4)]
        assert len(wakes) == 1
        # After the delivery a new burst wakes the loop again.
        threading.Thread(target=lambda: pairs[0][1](Output("again", []))).start()
        await asyncio.sleep(0.05)
        assert pairs[0][0].get_nowait().text == "again" and len(wakes) == 2

    asyncio.run(main())
