"""Batches waiting images for the ViT, in QoS order.

Images wait in a queue ordered by QoS class (aged by waiting time, as in the llm
scheduler), then arrival. Whenever the encoder is free it takes up to `max_batch` of
them, so batches grow with load and a lone request never waits for a timer.
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


@dataclass
class _Item:
    qos: QosLevel
    seq: int
    pixels: Pixels = field(compare=False)
    future: asyncio.Future = field(compare=False)
    enqueued: float = field(compare=False)
    trace: object = field(compare=False)  # the requester's span context (None when tracing is off)


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

    async def submit(self, pixels: Pixels, qos: QosLevel) -> EncodeResult:
        future = asyncio.get_running_loop().create_future()
        item = _Item(qos, next(self._seq), pixels, future, time.perf_counter(), telemetry.current_context())
        self._waiting.append(item)
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
            while self._waiting:
                batch: list[_Item] = []
                now = time.perf_counter()
                self._waiting.sort(key=lambda it: (effective_class(it.qos, now - it.enqueued), it.seq))
                while self._waiting and len(batch) < self.max_batch:
                    item = self._waiting.pop(0)
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
