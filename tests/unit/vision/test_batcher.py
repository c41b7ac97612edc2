"""The vision batcher's groups: a request's pictures share a batch, and nobody else waits for them."""

from __future__ import annotations

import asyncio

import torch

from services.common.qos import QosLevel
from services.vision.batcher import VisionBatcher


class CountingEncoder:
    """Features that say which picture they are; records each batch's pictures."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def encode(self, batch):
        self.batches.append([int(p[0]) for p in batch])
        return torch.stack([p[0].float().reshape(1, 1) for p in batch])


def pic(n: int):
    return (torch.tensor(n),)


def run(scenario):
    encoder = CountingEncoder()

    async def main():
        batcher = VisionBatcher(encoder, max_batch=8)
        batcher.start()
        try:
            return await scenario(batcher)
        finally:
            await batcher.stop()

    return encoder.batches, asyncio.run(main())


async def later(delay: float, coro):
    await asyncio.sleep(delay)
    return await coro


def test_a_request_s_pictures_share_a_batch_though_one_comes_late():
    async def scenario(b: VisionBatcher):
        one, two = b.group(2)
        first = asyncio.create_task(b.submit(pic(1), QosLevel.STANDARD, one))
        second = later(0.2, b.submit(pic(2), QosLevel.STANDARD, two))  # an encode's time later
        return await asyncio.gather(first, second)

    batches, (one, two) = run(scenario)
    assert batches == [[1, 2]]
    assert (one.batch_size, two.batch_size) == (2, 2)
    assert (float(one.features), float(two.features)) == (1.0, 2.0)
    assert one.queue_s >= 0.15  # it waited for its sibling, and says so


def test_without_a_group_the_first_picture_goes_alone():  # the control: the test above can fail
    async def scenario(b: VisionBatcher):
        first = asyncio.create_task(b.submit(pic(1), QosLevel.STANDARD))
        second = later(0.2, b.submit(pic(2), QosLevel.STANDARD))
        return await asyncio.gather(first, second)

    batches, _ = run(scenario)
    assert batches == [[1], [2]]


def test_a_member_that_leaves_frees_the_ones_that_came():
    async def scenario(b: VisionBatcher):
        one, two, three = b.group(3)
        first = asyncio.create_task(b.submit(pic(1), QosLevel.STANDARD, one))
        await asyncio.sleep(0.05)
        assert not first.done()  # held for the other two
        two.leave()  # a cache hit
        two.leave()  # leaving twice counts once
        one.leave()  # and leaving after coming counts not at all
        await asyncio.sleep(0.05)
        assert not first.done()
        three.leave()  # waits for another encode of its picture...
        result = await asyncio.wait_for(first, 5)
        late = await asyncio.wait_for(b.submit(pic(3), QosLevel.STANDARD, three), 5)  # ...and comes alone after
        return result, late

    batches, (result, late) = run(scenario)
    assert batches == [[1], [3]] and result.batch_size == late.batch_size == 1


def test_others_pictures_do_not_wait_for_a_group():
    async def scenario(b: VisionBatcher):
        one, two = b.group(2)
        held = asyncio.create_task(b.submit(pic(1), QosLevel.STANDARD, one))
        other = await asyncio.wait_for(b.submit(pic(9), QosLevel.BEST_EFFORT, None), 5)
        assert not held.done()
        two.leave()
        return other, await asyncio.wait_for(held, 5)

    batches, (other, held) = run(scenario)
    assert batches == [[9], [1]]
    assert float(other.features) == 9.0 and float(held.features) == 1.0
