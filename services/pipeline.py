"""The mesh's stages in one process: preprocess -> batched ViT -> engine, with no gRPC and
no hand-off. The same model code the services run, in the same order and queues; the
benchmark's `--target inprocess` and the tests use it to measure or check the model path
without the mesh around it.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

from services.common.config import SWITCH_INTERVAL_MS
from services.common.priority_pool import PriorityPool
from services.common.qos import QosLevel
from services.common.sampling import Sampling
from services.common.timings import Timings
from services.llm.engines import build_engine
from services.llm.interface import Engine, Job, Submission
from services.llm.request import Output
from services.model.prompt import PromptBuilder
from services.model.spec import load_spec
from services.vision.batcher import VisionBatcher
from services.vision.encoder import VisionEncoder


@dataclass
class PipelineRun:
    """One request in the pipeline: stream `outputs()`; `timings` is complete once it finished."""

    submission: Submission
    vision: Timings  # preprocess, vision queue and encode

    def outputs(self) -> AsyncIterator[Output]:
        return self.submission.outputs()

    @property
    def timings(self) -> Timings:
        return self.vision.merge(self.submission.req.timings())


class Pipeline:
    """Vision encoder, batcher and llm engine of one checkpoint in this process."""

    def __init__(
        self,
        model_dir: str,
        device: str = "auto",
        dtype: str = "auto",
        max_vision_batch: int = 4,
        max_llm_batch: int = 8,
        default_max_tokens: int = 256,
        engine: str = "native",
        preprocess_workers: int = 2,
    ) -> None:
        sys.setswitchinterval(SWITCH_INTERVAL_MS / 1000)  # as the servers do: the same runtime, minus gRPC
        spec = load_spec(model_dir)
        self.prompts = PromptBuilder(spec)
        self.encoder = VisionEncoder(spec, device, dtype, graphs_up_to=max_vision_batch)  # as the server's default
        self.batcher = VisionBatcher(self.encoder, max_vision_batch)
        self.engine: Engine = build_engine(
            engine,
            self.prompts,
            self.encoder.device,
            self.encoder.dtype,
            max_llm_batch,
            default_max_tokens,
        )
        self._preprocess = PriorityPool(preprocess_workers, "preprocess")
        self._started = False

    @property
    def max_context(self) -> int:
        return self.prompts.spec.text.max_context

    async def submit(
        self, image: bytes, prompt: str, sampling: Sampling, qos: QosLevel = QosLevel.STANDARD, request_id: str = ""
    ) -> PipelineRun:
        """Encode the image and queue the request; raises InvalidArgument for a bad image or prompt."""
        if not self._started:  # the batcher's task needs the caller's running loop
            self.batcher.start()
            self._started = True
        loop = asyncio.get_running_loop()
        start = loop.time()
        pixels = await asyncio.wrap_future(self._preprocess.submit(qos, self.encoder.pixels, image))
        preprocess = loop.time() - start
        encoded = await self.batcher.submit(pixels, qos)
        vision = Timings(preprocess=preprocess, vision_queue=encoded.queue_s, vision=encoded.encode_s)
        job = Job(request_id, prompt, [encoded.features], sampling, qos)
        return PipelineRun(self.engine.submit(job), vision)

    async def close(self) -> None:
        if self._started:
            await self.batcher.stop()
        self._preprocess.shutdown()
        self.engine.stop()
