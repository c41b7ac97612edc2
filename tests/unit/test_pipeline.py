"""The in-process pipeline (services/pipeline.py) runs the same model path as the engine's parts."""

from __future__ import annotations

import asyncio

from services.common.validation import check_sampling
from services.llm.request import Finish
from services.pipeline import Pipeline
from tests.helpers import PROMPTS, Parts, image_bytes
from vlmesh.v1 import common_pb2 as pb

N = 12


def test_a_picture_through_the_pipeline_decodes_as_through_the_parts(tiny_model):
    data = image_bytes(5, (56, 44))
    parts = Parts(tiny_model, max_batch=2)
    try:
        req, box = parts.request(data, PROMPTS[1], max_tokens=N, min_tokens=N)
        parts.run((req, box))
    finally:
        parts.engine.stop()

    async def main():
        pipeline = Pipeline(str(tiny_model), "cpu", "float32", max_llm_batch=2, preprocess_workers=1)
        try:
            sampling = check_sampling(pb.SamplingParams(max_tokens=N, min_tokens=N), pipeline.max_context)
            run = await pipeline.submit(data, PROMPTS[1], sampling, request_id="picture")
            return [out async for out in run.outputs()], run.timings
        finally:
            await pipeline.close()

    outs, timings = asyncio.run(main())
    assert [i for out in outs for i in out.token_ids] == box["ids"]
    assert len(box["ids"]) == N
    assert "".join(out.text for out in outs) == box["text"]
    assert outs[-1].finish is Finish.LENGTH and box["finish"] is Finish.LENGTH
    for stage in ("preprocess", "vision", "prefill", "decode"):
        assert getattr(timings, stage) > 0, f"{stage}: {timings}"
    assert timings.vision_queue >= 0 and timings.llm_queue >= 0
