"""Batches waiting images for the ViT, in QoS order.

Images wait in a queue ordered by QoS class (aged by waiting time, as in the llm
scheduler), then arrival. Whenever the encoder is free it takes up to `max_batch` of
them, so batches grow with load and a lone request never waits for a timer.

A request's pictures are one `Group`: the ones ready are held until every other picture of
the request has come too (or left: a cache hit, a bad image, a cancel), so they share a batch
rather than the second waiting out the first's encode.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from services.common import metrics, telemetry
from services.common.qos import QosLevel, effective_class
from services.vision.encoder import Pixels, VisionEncoder


class Group:
    """The pictures of one request still to come to the batcher: those that came wait for them."""

    def __init__(self, batcher: VisionBatcher, members: int) -> None:
        self._batcher = batcher
        self.pending = members  # members that have neither come nor left

    def _arrive(self) -> None:
        self.pending -= 1
        if self.pending == 0:
            self._batcher._wake.set()


class Member:
    """One picture of a `Group`: it comes once (`VisionBatcher.submit`) or leaves once (`leave`).

    A member must leave whenever it will not come soon (a cache hit, an error, a cancel, a wait
    for another request's encode of the same picture); then it may still come, outside the group.
    """

    def __init__(self, group: Group) -> None:
        self.group = group
        self.done = False

    def leave(self) -> None:
        if not self.done:
            self.done = True
            self.group._arrive()

    def come(self) -> Group | None:
        """Its group, to wait with, as it comes to the batcher; None if it left before."""
        if self.done:
            return None
        self.leave()  # no longer pending, either way
        return self.group


@dataclass
class _Item:
    qos: QosLevel
    seq: int
    pixels: Pixels = field(compare=False)
    future: asyncio.Future = field(compare=False)
    enqueued: float = field(compare=False)
    trace: object = field(compare=False)  # the requester's span context (None when tracing is off)
    group: Group | None = field(compare=False, default=None)

    @property
    def held(self) -> bool:
        return self.group is not None and self.group.pending > 0


@dataclass
class EncodeResult:
    features: torch.Tensor  # [image_tokens, H]
    queue_s: float
    encode_s: float
    batch_size: int


class VisionBatcher:
    def __init__(self, encoder: VisionEncoder, max_batch: int) -> None:
        self.encoder = encoder
        self.max_batch = max_batch
        self._waiting: list[_Item] = []
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        # One thread runs the model; torch parallelises inside it.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vit")
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="vision-batcher")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        for item in self._waiting:
            if not item.future.done():
                item.future.cancel()
        self._executor.shutdown(wait=True)

    def group(self, members: int) -> list[Member]:
        """A request's `members` pictures, to be batched together (see `Member`)."""
        group = Group(self, members)
        return [Member(group) for _ in range(members)]

    async def submit(self, pixels: Pixels, qos: QosLevel, member: Member | None = None) -> EncodeResult:
        future = asyncio.get_running_loop().create_future()
        group = member.come() if member is not None else None
        item = _Item(qos, next(self._seq), pixels, future, time.perf_counter(), telemetry.current_context(), group)
        self._waiting.append(item)  # before the loop runs again (no await since the group's wake-up)
        metrics.QUEUE_DEPTH.labels("vision", qos.wire).inc()
        self._wake.set()
        result = await future
        started = item.enqueued + result.queue_s
        telemetry.record_span("vision.queue", item.enqueued, started)
        telemetry.record_span(
            "vision.encode",
            started,
            started + result.encode_s,
            {"batch.size": result.batch_size},
        )
        return result

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while any(not item.held for item in self._waiting):
                batch: list[_Item] = []
                now = time.perf_counter()
                self._waiting.sort(key=lambda it: (effective_class(it.qos, now - it.enqueued), it.seq))
                ready = [item for item in self._waiting if not item.held][: self.max_batch]
                taken = {id(item) for item in ready}
                self._waiting = [item for item in self._waiting if id(item) not in taken]
                for item in ready:
                    level = item.qos.wire
                    metrics.QUEUE_DEPTH.labels("vision", level).dec()
                    if not item.future.cancelled():  # the caller went away while waiting
                        batch.append(item)
                        metrics.QUEUE_WAIT.labels("vision", level).observe(time.perf_counter() - item.enqueued)
                if not batch:
                    continue
                start = time.perf_counter()
                pixels = [item.pixels for item in batch]
                try:
                    feats = await loop.run_in_executor(self._executor, self.encoder.encode, pixels)
                except Exception as err:  # a model failure fails this batch, not the server
                    for item in batch:
                        if not item.future.done():
                            item.future.set_exception(err)
                    continue
                end = time.perf_counter()
                metrics.BATCH_SIZE.labels("vision").observe(len(batch))
                metrics.STAGE_DURATION.labels("vision").observe(end - start)
                with telemetry.linked([item.trace for item in batch]) as links:  # one batch, many requests
                    telemetry.record_span("vision.batch", start, end, {"batch.size": len(batch)}, links=links)
                for i, item in enumerate(batch):
                    if not item.future.done():
                        item.future.set_result(EncodeResult(feats[i], start - item.enqueued, end - start, len(batch)))
