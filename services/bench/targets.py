"""What the load generator drives: the mesh over gRPC, the same engine in-process, or
transformers' naive `generate` (an OpenAI-compatible HTTP server: services/bench/http_target.py).
Each `send` returns an Outcome and never raises."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.bench.workloads import BenchRequest
from services.common.config import DEGRADED_METADATA_KEY
from services.common.qos import QOS_METADATA_KEY, metadata_value
from services.common.server import GRPC_OPTIONS
from services.common.timings import Timings
from services.common.tls import aio_channel
from services.common.validation import api_key_metadata
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc

REQUEST_TIMEOUT_S = 120.0
STAGES = ("queue", "preprocess", "vision", "handoff", "prefill", "decode")


@dataclass
class Outcome:
    status: str  # "OK" or a gRPC status name
    e2e_s: float = 0.0
    ttft_s: float | None = None
    output_tokens: int = 0
    timings: Timings | None = None  # the system's own account of where the time went, if it gives one
    text: str = ""  # the answer, for checking that two systems did the same work
    cached_tokens: int = 0  # prompt positions served from the llm's prefix cache (usage.cached_tokens)
    degraded: str = ""  # how overload degraded the answer (x-vlmesh-degraded), "" if it did not

    @property
    def feature_hit(self) -> bool | None:
        """The vision served cached features (it ran no stage); None when the system reports no stages."""
        t = self.timings
        return None if t is None else t.vision == 0 and t.preprocess == 0

    @property
    def stages_ms(self) -> dict[str, float]:
        """The table's stages (STAGES) in ms; empty when the system reports none."""
        t = self.timings
        if t is None:
            return {}
        stages = (t.queue, t.preprocess, t.vision, t.handoff, t.prefill, t.decode)
        return {name: s * 1000 for name, s in zip(STAGES, stages, strict=True)}

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def sampling_for(req: BenchRequest) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=req.max_tokens, min_tokens=req.max_tokens, ignore_eos=True)


def mesh_metadata(qos: str, api_key: str | None) -> tuple[tuple[str, str], ...]:
    """What each request to the gateway carries: its qos-level, and the API key when there is one."""
    return ((QOS_METADATA_KEY, qos), *api_key_metadata(api_key))


class MeshTarget:
    name = "mesh"

    def __init__(self, gateway: str, api_key: str | None = None, tls_ca: str | None = None) -> None:
        """`tls_ca`: TLS to the gateway, verified against this CA (PEM file); None: plaintext."""
        self.gateway = gateway
        self._api_key = api_key  # sent as `authorization: Bearer KEY`; never logged or recorded
        creds = grpc.ssl_channel_credentials(Path(tls_ca).read_bytes()) if tls_ca else None
        self.channel = aio_channel(gateway, creds, options=GRPC_OPTIONS)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    async def send(self, req: BenchRequest) -> Outcome:
        start = time.perf_counter()
        ttft, tokens, final, text = None, 0, None, []
        msg = gateway_pb2.GenerateRequest(
            images=[pb.Image(data=d, mime_type="image/jpeg") for d in req.images],
            prompt=req.prompt,
            sampling=sampling_for(req),
        )
        call = self.stub.Generate(msg, metadata=mesh_metadata(req.qos.wire, self._api_key), timeout=REQUEST_TIMEOUT_S)
        try:
            async for out in call:
                if out.token_ids and ttft is None:
                    ttft = time.perf_counter() - start
                tokens += len(out.token_ids)
                text.append(out.text)
                final = out
            e2e = time.perf_counter() - start  # before any other await: under load the loop may not come back soon
            degraded = metadata_value(await call.initial_metadata(), DEGRADED_METADATA_KEY) or ""
        except grpc.aio.AioRpcError as err:
            return Outcome(err.code().name, time.perf_counter() - start)
        if final is None or final.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
            return Outcome("INCOMPLETE", e2e)
        return Outcome(
            "OK",
            e2e,
            ttft,
            tokens,
            Timings.from_pb(final.timings),
            "".join(text),
            final.usage.cached_tokens,
            degraded,
        )

    async def close(self) -> None:
        await self.channel.close()


class InprocessTarget:
    """The mesh's own pipeline in this process (services/pipeline.py): no gRPC, no hand-off."""

    name = "inprocess"

    def __init__(self, model_dir: str, device: str, dtype: str, max_vision_batch: int, max_llm_batch: int) -> None:
        from services.pipeline import Pipeline

        self.pipeline = Pipeline(model_dir, device, dtype, max_vision_batch, max_llm_batch)

    async def send(self, req: BenchRequest) -> Outcome:
        from services.common.validation import check_sampling
        from services.llm.request import Finish

        start = time.perf_counter()
        try:
            sampling = check_sampling(sampling_for(req), self.pipeline.max_context)
            (image,) = req.images  # one picture a request (`check_pictures`)
            run = await self.pipeline.submit(image, req.prompt, sampling, req.qos, str(req.index))
            ttft, tokens = None, 0
            async with contextlib.aclosing(run.outputs()) as outputs:
                async for out in outputs:
                    if out.token_ids and ttft is None:
                        ttft = time.perf_counter() - start
                    tokens += len(out.token_ids)
                    if out.finish is not None and out.finish not in (Finish.STOP, Finish.LENGTH):
                        return Outcome(out.finish.name, time.perf_counter() - start)
        except Exception as err:  # a benchmark records failures, it does not stop on them
            return Outcome(type(err).__name__, time.perf_counter() - start)
        return Outcome("OK", time.perf_counter() - start, ttft, tokens, run.timings)

    async def close(self) -> None:
        await self.pipeline.close()


class HfTarget:
    """transformers' own model of the checkpoint's family (AutoModelForImageTextToText: LLaVA's,
    DeepSeek-VL's) and its generate, one request at a time: what a user gets without a serving system.

    `static`: with `cache_implementation="static"`, for which transformers compiles the
    decode step itself (`--target hf-static`, the careful user's baseline). The compile takes
    tens of seconds per prompt shape, so `warm_up` runs a request of each workload first.
    """

    def __init__(self, model_dir: str, device: str, static: bool = False) -> None:
        import torch
        from transformers import AutoModelForImageTextToText, AutoTokenizer

        from services.model.family import family_of
        from services.model.presets import is_random
        from services.model.prompt import PromptBuilder
        from services.model.spec import load_spec

        self.torch = torch
        spec = load_spec(model_dir)
        self.device = torch.device(
            "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
        )
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        if is_random(spec.model_dir):  # a preset: transformers' own random init, on the device
            with self.device:
                self.model = AutoModelForImageTextToText.from_config(spec.hf_config).to(dtype).eval()
        else:
            self.model = AutoModelForImageTextToText.from_pretrained(spec.model_dir, dtype=dtype)
            self.model = self.model.to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(spec.model_dir)
        self.prompts = PromptBuilder(spec)
        self.processor = family_of(spec).image_processor(spec)
        self.dtype = dtype
        self.static = static
        self.name = "hf-static" if static else "hf"
        self._lock = asyncio.Lock()

    def _generate(self, req: BenchRequest) -> tuple[float, int]:
        """Return (perf_counter at the first new token, tokens generated)."""
        from transformers.generation.streamers import BaseStreamer

        from services.model.preprocess import decode_image

        torch = self.torch
        first: dict[str, float] = {}

        class FirstToken(BaseStreamer):
            calls = 0

            def put(self, value):  # the first put is the prompt, the second the first new token
                FirstToken.calls += 1
                if FirstToken.calls == 2:
                    first["t"] = time.perf_counter()

            def end(self):
                pass

        # The family's inputs, by transformers' names (the hybrid's SAM pixels come second; a grid
        # family's patches, their grid, and the token types its M-RoPE reads).
        (image,) = req.images  # one picture a request (services/bench/cli.py refuses more)
        pixels = self.processor.tower_inputs([self.processor.pixels(decode_image(image), "image")], self.device)
        spec = self.prompts.spec
        if spec.image_grid:
            patches, grid = pixels
            tokens = int(grid.prod()) // spec.vision.images.merge_size**2  # type: ignore[attr-defined]
            ids = torch.tensor([self.prompts.build(req.prompt, [tokens]).ids], device=self.device)
            images = {
                "pixel_values": patches.to(self.device, self.dtype),
                "image_grid_thw": grid.to(self.device),
                "mm_token_type_ids": (ids == spec.image_token_id).int(),
            }
        else:
            names = ("pixel_values", "high_res_pixel_values")
            images = {name: px.to(self.device, self.dtype) for name, px in zip(names, pixels, strict=False)}
            ids = torch.tensor([self.prompts.build(req.prompt, 1).ids], device=self.device)
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids,
                **images,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=req.max_tokens,
                min_new_tokens=req.max_tokens,
                do_sample=False,
                streamer=FirstToken(),
                pad_token_id=self.tokenizer.pad_token_id,
                **({"cache_implementation": "static"} if self.static else {}),
            )
        return first.get("t", time.perf_counter()), out.shape[1] - ids.shape[1]

    async def warm_up(self, req: BenchRequest, runs: int = 3) -> None:
        """Generate `runs` times untimed: a static cache compiles on the first calls of each shape."""
        if self.static:
            for _ in range(runs):
                await asyncio.get_running_loop().run_in_executor(None, self._generate, req)

    async def send(self, req: BenchRequest) -> Outcome:
        start = time.perf_counter()
        try:
            async with self._lock:  # naive: one request at a time
                first_at, tokens = await asyncio.get_running_loop().run_in_executor(None, self._generate, req)
        except Exception as err:
            return Outcome(type(err).__name__, time.perf_counter() - start)
        return Outcome("OK", time.perf_counter() - start, first_at - start, tokens)

    async def close(self) -> None:
        pass
