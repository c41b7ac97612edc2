"""Helpers shared by test modules: the only thing under `tests.` a test module may import.

Test modules never import each other (tests/unit/test_layout.py checks); anything two of them
need lives here. Heavy imports (torch, transformers, the engine) stay inside the functions that
use them, so importing this module (conftest does, for every test) stays cheap.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from services.common.qos import QosLevel
from services.launcher import MeshOptions
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, vision_pb2, vision_pb2_grpc

if TYPE_CHECKING:
    import torch

    from services.handoff.consumer import Consumer
    from services.handoff.producer import Producer
    from services.llm.request import Request
    from services.vision.encoder import VisionEncoder

ROOT = Path(__file__).resolve().parents[1]
"""The repository root."""


# --- pictures and processors ---------------------------------------------------------------


def image_bytes(seed: int, size: tuple[int, int] = (48, 40), fmt: str = "PNG") -> bytes:
    """A random-noise picture (width, height) encoded as `fmt`."""
    rng = np.random.default_rng(seed)
    arr = (rng.random((size[1], size[0], 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


def pil_clip_processor_class():
    """transformers' PIL implementation of CLIPImageProcessor: the reference we match.

    Where torchvision is installed (the GPU machine), `CLIPImageProcessor` is the
    torchvision backend, whose bicubic resize differs from Pillow's.
    """
    try:
        from transformers import CLIPImageProcessorPil

        return CLIPImageProcessorPil
    except ImportError:  # older transformers: the class is the PIL one
        from transformers import CLIPImageProcessor

        return CLIPImageProcessor


# --- a mesh of real processes --------------------------------------------------------------


def mesh_options(model, **overrides) -> MeshOptions:
    """A CPU mesh on ephemeral ports, one torch thread per service (CI has 2 cores)."""
    opts = {
        "model": str(model),
        "gateway_port": 0,
        "vision_port": 0,
        "llm_port": 0,
        "device": "cpu",
        "threads": 1,
        "metrics_ports": (0, 0, 0),
        "warmup_requests": 1,
        "log_level": "warning",
        "extra_env": {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
    }
    opts.update(overrides)
    return MeshOptions.from_flags(**opts)


def serving(mesh) -> bool:
    """Whether gateway, vision and llm of `mesh` all answer health checks with SERVING."""
    for name in ("gateway", "vision", "llm"):
        with grpc.insecure_channel(mesh.target(name)) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            if resp.status != health_pb2.HealthCheckResponse.SERVING:
                return False
    return True


# --- servers in this process --------------------------------------------------------------


@contextlib.asynccontextmanager
async def local_server(add: Callable[[object, grpc.aio.Server], None], servicer: object) -> AsyncIterator[str]:
    """A grpc.aio server on 127.0.0.1 and a port the kernel picks, serving `servicer`; yields its target.

    `add` is the generated registration, e.g. `vision_pb2_grpc.add_VisionServicer_to_server`.
    Port sharing is off, so the port is this server's alone (see ARCHITECTURE.md's pitfalls).
    """
    from services.common.server import GRPC_OPTIONS

    server = grpc.aio.server(options=[*GRPC_OPTIONS, ("grpc.so_reuseport", 0)])
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    assert port, "could not bind 127.0.0.1:0"
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def eventually(check: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """Poll `check` on the running loop until it holds (True) or `timeout_s` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


class FakeVision(vision_pb2_grpc.VisionServicer):
    """The vision service's gRPC face without a model, for testing its callers (gateway, llm).

    Encode records the request and its metadata, then answers `encoded` (or aborts with
    `encode_error`, a (code, details) pair). Release records the lease ids once it has
    handed them to `producer` (when given), after `release_delay_s`: a slow release shows
    whether a caller waits for it.
    """

    def __init__(
        self,
        encoded: vision_pb2.EncodeResponse | None = None,
        producer: Producer | None = None,
        release_delay_s: float = 0.0,
        encode_error: tuple[grpc.StatusCode, str] | None = None,
    ) -> None:
        self.encoded = encoded or vision_pb2.EncodeResponse()
        self.producer = producer
        self.release_delay_s = release_delay_s
        self.encode_error = encode_error
        self.encodes: list[tuple[vision_pb2.EncodeRequest, dict[str, str]]] = []
        self.releases: list[list[int]] = []

    async def Encode(self, request, context):
        self.encodes.append((request, dict(context.invocation_metadata())))
        if self.encode_error is not None:
            await context.abort(*self.encode_error)
        return self.encoded

    async def Release(self, request, context):
        await asyncio.sleep(self.release_delay_s)
        ids = list(request.lease_ids)
        released = self.producer.release(ids) if self.producer is not None else len(ids)
        self.releases.append(ids)
        return vision_pb2.ReleaseResponse(released=released)


# --- metrics -------------------------------------------------------------------------------


def scrape(port: int) -> str:
    """One Prometheus /metrics page of a mesh server."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def sample(text: str, series: str) -> float | None:
    """The value of one exposition line, e.g. `vlmesh_kv_slots{state="used"}`; None if absent."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def settle(port: int, series: str, want: float, timeout: float = 10.0, absent_is_zero: bool = False) -> float | None:
    """Poll a series until it equals `want` (releases are asynchronous); return the last value seen.

    `absent_is_zero`: a labelled gauge that was never touched is not exported; count it as 0.
    """
    deadline = time.monotonic() + timeout
    while True:
        got = sample(scrape(port), series)
        if got == want or (absent_is_zero and got is None and want == 0) or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


# --- the transformers oracle ---------------------------------------------------------------

CASES = [
    (image_bytes(1, (48, 40), "PNG"), "What is in the image?"),
    (image_bytes(2, (64, 96), "JPEG"), "Describe the picture in detail."),
    (image_bytes(3, (40, 40), "WEBP"), "What color is the shape?"),
    (image_bytes(4, (100, 37), "PNG"), "What is in the image?"),
]
"""(encoded picture, prompt) pairs the mesh is checked against transformers on."""


def _model_type(model_dir) -> str:
    return json.loads((Path(model_dir) / "config.json").read_text())["model_type"]


def hf_processor(model_dir):
    """transformers' own processor of the checkpoint's family, with the PIL image processor
    (the GPU machine's torchvision one resizes differently)."""
    from transformers import AutoConfig, AutoTokenizer, LlavaProcessor

    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = AutoConfig.from_pretrained(model_dir)
    if cfg.model_type == "llava":
        return LlavaProcessor(
            image_processor=pil_clip_processor_class().from_pretrained(model_dir),
            tokenizer=tok,
            patch_size=cfg.vision_config.patch_size,
            vision_feature_select_strategy="default",
            chat_template=tok.chat_template,
            num_additional_image_tokens=1,
        )
    from transformers import DeepseekVLHybridProcessor, DeepseekVLProcessor
    from transformers.models.deepseek_vl.image_processing_pil_deepseek_vl import DeepseekVLImageProcessorPil
    from transformers.models.deepseek_vl_hybrid.image_processing_pil_deepseek_vl_hybrid import (
        DeepseekVLHybridImageProcessorPil,
    )

    hybrid = cfg.model_type == "deepseek_vl_hybrid"
    images = (DeepseekVLHybridImageProcessorPil if hybrid else DeepseekVLImageProcessorPil).from_pretrained(model_dir)
    tokens = (cfg.vision_config.image_size // cfg.vision_config.patch_size) ** 2
    cls = DeepseekVLHybridProcessor if hybrid else DeepseekVLProcessor
    return cls(images, tok, chat_template=tok.chat_template, num_image_tokens=tokens)


def hf_inputs(model_dir, data: bytes | list[bytes], prompt: str, max_pixels: int | None = None):
    """transformers' own processor on the same bytes (one picture or several, before the text):
    input_ids and pixel values."""
    pictures = [data] if isinstance(data, bytes) else data
    if _model_type(model_dir) == "qwen2_5_vl":
        return _qwen_inputs(model_dir, pictures, prompt, max_pixels)
    proc = hf_processor(model_dir)
    content = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": prompt}]
    text = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    kwargs = {"add_special_tokens": not text.startswith(proc.tokenizer.bos_token)}  # as apply_chat_template does
    images = [Image.open(io.BytesIO(d)).convert("RGB") for d in pictures]
    return proc(images=images if len(images) > 1 else images[0], text=text, return_tensors="pt", **kwargs)


def _qwen_inputs(model_dir, pictures: list[bytes], prompt: str | list[dict], max_pixels: int | None = None):
    """What Qwen2_5_VLProcessor computes (it cannot be built without torchvision's video processor):
    the chat template, each <|image_pad|> repeated for its picture's tokens, the PIL image
    processor's patches and grids, and the token types M-RoPE reads."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = AutoTokenizer.from_pretrained(model_dir)
    limits = {} if max_pixels is None else {"max_pixels": max_pixels}
    images = Qwen2VLImageProcessorPil.from_pretrained(model_dir, **limits)(
        images=[Image.open(io.BytesIO(d)).convert("RGB") for d in pictures], return_tensors="pt"
    )
    if isinstance(prompt, str):  # one user turn, its pictures first; else a conversation as the template takes it
        content = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": prompt}]
        prompt = [{"role": "user", "content": content}]
    text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    parts = text.split("<|image_pad|>")
    counts = (images["image_grid_thw"].prod(-1) // 4).tolist()
    text = parts[0] + "".join("<|image_pad|>" * n + rest for n, rest in zip(counts, parts[1:], strict=True))
    enc = tok(text, return_tensors="pt")
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    return {
        **enc,
        "pixel_values": images["pixel_values"],
        "image_grid_thw": images["image_grid_thw"],
        "mm_token_type_ids": (enc["input_ids"] == image_id).int(),
    }


def hf_model(model_dir, **kwargs):
    """transformers' model class of the checkpoint's family, loaded from it."""
    from transformers import (
        DeepseekVLForConditionalGeneration,
        DeepseekVLHybridForConditionalGeneration,
        LlavaForConditionalGeneration,
        Qwen2_5_VLForConditionalGeneration,
    )

    classes = {
        "llava": LlavaForConditionalGeneration,
        "deepseek_vl": DeepseekVLForConditionalGeneration,
        "deepseek_vl_hybrid": DeepseekVLHybridForConditionalGeneration,
        "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
    }
    return classes[_model_type(model_dir)].from_pretrained(model_dir, **kwargs).eval()


def multiplied_out(stored: Path, out: Path) -> Path:
    """A copy of a checkpoint stored in compressed-tensors fp8 with each projection written back as
    codes x scales in fp32 and no quantization_config: the full-precision model transformers runs
    as the fp8 checkpoint's reference (written here, independently of vlmesh's loader)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(stored, out)
    for shard in out.glob("*.safetensors"):
        tensors = load_file(shard)
        plain = {
            key: t.float() * tensors[key + "_scale"].float() if t.dtype == torch.float8_e4m3fn else t
            for key, t in tensors.items()
            if not key.endswith(".weight_scale")
        }
        save_file(plain, shard, metadata={"format": "pt"})
    raw = json.loads((out / "config.json").read_text())
    del raw["quantization_config"]
    (out / "config.json").write_text(json.dumps(raw))
    return out


def hf_greedy(model_dir, data: bytes | list[bytes], prompt: str, n: int, max_pixels: int | None = None) -> list[int]:
    """transformers' own generate for the checkpoint's family: n greedy tokens after the prompt
    (`max_pixels`: Qwen2.5-VL's processor with that limit)."""
    import torch

    model = hf_model(model_dir)
    inputs = hf_inputs(model_dir, data, prompt, max_pixels)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def check_against_transformers(stub, tiny_model) -> None:
    """16 greedy tokens per case through `stub` (a gateway) equal transformers' on the checkpoint."""
    ours = []
    for data, prompt in CASES:
        req = gateway_pb2.GenerateRequest(
            images=[pb.Image(data=data)],
            prompt=prompt,
            sampling=pb.SamplingParams(max_tokens=16, min_tokens=16),
        )
        ids: list[int] = []
        final = None
        for msg in stub.Generate(req, timeout=60):
            ids.extend(msg.token_ids)
            final = msg
        assert final.finish_reason == pb.FINISH_REASON_LENGTH
        assert final.usage.output_tokens == 16
        assert final.usage.image_tokens == 16
        ref = hf_greedy(tiny_model, data, prompt, 16)
        assert ids == ref, f"prompt {prompt!r}: mesh {ids} != transformers {ref}"
        ours.append(tuple(ids))
    # The image matters: the same prompt on different pictures gives different tokens,
    # so the comparison above would catch features that are lost or mixed up.
    assert ours[0] != ours[3]


def check_pictures_against_transformers(stub, model_dir) -> None:
    """Two and three pictures of different sizes in one request (the gateway's --max-images at
    least 3): 12 greedy tokens equal transformers' on the same pictures, and their order matters."""
    pictures = [image_bytes(5, (60, 40)), image_bytes(6, (30, 90), "JPEG"), image_bytes(7, (128, 128))]
    got = {}
    for order in ((0, 1), (1, 0), (0, 1, 2)):
        data = [pictures[i] for i in order]
        req = gateway_pb2.GenerateRequest(
            images=[pb.Image(data=d) for d in data],
            prompt="Compare the pictures.",
            sampling=pb.SamplingParams(max_tokens=12, min_tokens=12),
        )
        result = stub.GenerateUnary(req, timeout=120)
        want = hf_greedy(model_dir, data, "Compare the pictures.", 12)
        assert list(result.token_ids) == want, f"pictures {order}: mesh {list(result.token_ids)} != {want}"
        assert result.usage.image_tokens == 16 * len(order)
        got[order] = want
    assert got[(0, 1)] != got[(1, 0)]  # each picture's features sit where its placeholder is


# --- the llm engine in-process -------------------------------------------------------------

PROMPTS = ["What is in the image?", "Describe the picture in detail.", "What shape is it?", "Why?", "What color?"]
"""Prompts of different lengths for the in-process engine tests."""


class Parts:
    """The native llm engine and the vision encoder in this process, without gRPC."""

    def __init__(self, model_dir, max_batch: int, device: str = "cpu", dtype: str = "float32", native=None) -> None:
        from services.llm.engines import build_native
        from services.model.prompt import PromptBuilder
        from services.model.spec import load_spec
        from services.vision.encoder import VisionEncoder

        spec = load_spec(model_dir)
        self.prompts = PromptBuilder(spec)
        self.vision = VisionEncoder(spec, device, dtype)
        self.engine = build_native(
            self.prompts, self.vision.device, self.vision.dtype, max_batch, default_max_tokens=256, cfg=native
        )
        self.engine.start()
        self._n = 0

    def request(
        self, image: int | bytes, prompt: str, qos: QosLevel = QosLevel.STANDARD, **sampling
    ) -> tuple[Request, dict]:
        """`image`: encoded bytes, or a seed for a random-noise picture. The image's content key is a
        hash of its bytes, as the vision service's (so the prefix cache can share its pages)."""
        import hashlib

        from services.common.validation import check_sampling
        from services.llm.interface import Job
        from services.llm.submit import new_request

        data = image_bytes(image) if isinstance(image, int) else image
        feats = self.vision.encode([self.vision.pixels(data)])[0]
        s = check_sampling(pb.SamplingParams(**sampling), 512)
        done = threading.Event()
        box = {"ids": [], "text": "", "finish": None, "done": done}

        def emit(out):
            box["ids"] += out.token_ids
            box["text"] += out.text
            if out.finish is not None:
                box["finish"] = out.finish
                done.set()

        self._n += 1
        key = hashlib.blake2b(data, digest_size=16).digest()
        req = new_request(self.prompts, 64, Job(f"r{self._n}", prompt, [feats], s, qos, [key]), emit)
        req.id = f"r{self._n}"
        return req, box

    def run(self, *pairs) -> None:
        for req, _ in pairs:
            self.engine.add(req)
        for _, box in pairs:
            assert box["done"].wait(60)


def demo_answers(seed: int, n: int, max_tokens: int = 8) -> tuple[list, list[tuple[bytes, str]], list[str]]:
    """n pictures of the demo task, their (PNG, prompt) jobs, and the native CPU engine's answers.

    The reference for the tests that run the same jobs through another path (vLLM, the GPU mesh).
    The jobs go through the in-process pipeline (services/pipeline.py), one after another, greedy.
    """
    from services.common.validation import check_sampling
    from services.llm.request import Finish
    from services.model import shapes
    from services.pipeline import Pipeline

    pics = [shapes.render(np.random.default_rng([seed, i])) for i in range(n)]
    jobs = [(shapes.encode(p.image, "PNG"), list(shapes.PROMPTS)[i % len(shapes.PROMPTS)]) for i, p in enumerate(pics)]

    async def answer() -> list[str]:
        pipeline = Pipeline(str(ROOT / "models" / "demo"), device="cpu", dtype="float32", max_llm_batch=8)
        try:
            sampling = check_sampling(pb.SamplingParams(max_tokens=max_tokens), pipeline.max_context)
            answers = []
            for i, (data, prompt) in enumerate(jobs):
                run = await pipeline.submit(data, prompt, sampling, request_id=f"demo-{i}")
                outs = [out async for out in run.outputs()]
                assert outs[-1].finish in (Finish.LENGTH, Finish.STOP), f"job {i}: {outs[-1]}"
                answers.append("".join(out.text for out in outs))
            return answers
        finally:
            await pipeline.close()

    return pics, jobs, asyncio.run(answer())


# --- the vision servicer in this process (tests/unit/vision) ---


def vision_reference(encoder: VisionEncoder, data: bytes) -> torch.Tensor:
    """The features of one picture encoded alone, without the service: [image_tokens, H]."""
    return encoder.encode([encoder.pixels(data)])[0]


def consumer_info(consumer: Consumer, accept=None) -> pb.ConsumerInfo:
    return pb.ConsumerInfo(host_id=consumer.host, gpu_uuid=consumer.gpu_uuid, accept=accept or consumer.transports)


@contextlib.asynccontextmanager
async def vision_service(encoder: VisionEncoder, producer: Producer, memory=None):
    """A stub of the real VisionServicer on a local port (batcher started on this loop, stopped after)."""
    from services.vision.batcher import VisionBatcher
    from services.vision.servicer import VisionServicer

    batcher = VisionBatcher(encoder, max_batch=4)
    batcher.start()
    servicer = VisionServicer(encoder, batcher, producer, workers=1, memory=memory)
    try:
        async with local_server(vision_pb2_grpc.add_VisionServicer_to_server, servicer) as target:
            async with grpc.aio.insecure_channel(target) as channel:
                yield vision_pb2_grpc.VisionStub(channel)
    finally:
        await batcher.stop()
        servicer.close()


def encode_request(consumer_info: pb.ConsumerInfo, pictures: list[bytes]) -> vision_pb2.EncodeRequest:
    return vision_pb2.EncodeRequest(
        request_id="v-1", images=[pb.Image(data=d) for d in pictures], consumer=consumer_info
    )


def record_decode_rows(runner, fresh: list[bool] | None = None) -> list[int]:
    """The decode rows of each packed step the runner runs from now on (in the list returned);
    into `fresh`, whether each step took the fresh prompt's path (SDPA, services/llm/packed.py)."""
    rows: list[int] = []
    if runner.packed is not None:
        run = runner.packed.run
        seen = fresh if fresh is not None else []
        runner.packed.run = lambda: (rows.append(runner.packed.decode_rows), seen.append(runner.packed.fresh), run())
    return rows


# --- on the GPU: our tokens against transformers' -----------------------------------------


def assert_greedy_under_transformers(model_dir, data: bytes, prompt: str, ids: list[int], device: str) -> None:
    """Teacher-force our tokens through transformers on `device`: each must be its argmax, or
    within float noise of it. Exact equality across devices is not a fair demand: a random
    model has near-ties that last-bit differences between CPU and GPU kernels flip."""
    import torch

    model = hf_model(model_dir).to(device)
    inputs = {k: v.to(device) for k, v in hf_inputs(model_dir, data, prompt).items()}
    with torch.no_grad():
        # The prompt with its picture, then our tokens on its KV cache: a random model may well
        # generate the <image> token id, which transformers refuses to see beside pixel_values.
        prompt_out = model(**inputs, use_cache=True)
        rest = model(
            input_ids=torch.tensor([ids[:-1]], device=device), past_key_values=prompt_out.past_key_values
        ).logits[0]
        logits = torch.cat([prompt_out.logits[0, -1:], rest]).float()
    logits[:, model.generation_config.eos_token_id] = float("-inf")  # the request set min_tokens = 16
    chosen = logits.gather(1, torch.tensor(ids, device=device)[:, None])[:, 0]
    best = logits.max(-1).values
    gap = (best - chosen).max().item()
    assert gap <= 1e-3 * max(1.0, best.abs().max().item()), f"a token was not greedy: logit gap {gap}"
    exact = logits.argmax(-1).tolist() == ids
    print(f"{prompt!r}: exact argmax match={exact}, worst gap {gap:.2e}")


def assert_idle(parts) -> None:
    engine = parts.engine
    assert engine.stats().running == engine.stats().waiting == 0
    pages = engine.scheduler.blocks
    assert pages.free == pages.capacity, f"{pages.capacity - pages.free} KV pages still held"


def ours(parts, cases, tokens: int = 32, **sampling) -> list[list[int]]:
    pairs = [parts.request(data, prompt, max_tokens=tokens, min_tokens=tokens, **sampling) for data, prompt in cases]
    parts.run(*pairs)
    return [box["ids"] for _, box in pairs]


def hf_model_on_gpu(model_dir, dtype):
    """transformers' own model of the checkpoint's family, on the GPU."""
    return hf_model(model_dir, dtype=dtype).to("cuda")


def teacher_forced_argmax(model, model_dir, data: bytes, prompt: str, ids: list[int], ban_eos: bool = False):
    """transformers' argmax at each of our tokens' positions, given our tokens before it (EOS
    masked with `ban_eos`, as min_tokens masks it in the engine)."""
    inputs = {k: v.to("cuda") for k, v in hf_inputs(model_dir, data, prompt).items()}
    inputs = {k: v.to(model.dtype) if v.is_floating_point() else v for k, v in inputs.items()}  # pixels
    import torch

    with torch.no_grad():
        first = model(**inputs, use_cache=True)
        logits = first.logits[0, -1:]
        if len(ids) > 1:
            rest = model(input_ids=torch.tensor([ids[:-1]], device="cuda"), past_key_values=first.past_key_values)
            logits = torch.cat([logits, rest.logits[0]])
    logits = logits.float()
    if ban_eos:
        logits[:, model.generation_config.eos_token_id] = float("-inf")
    return logits.argmax(-1).tolist()


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def check_fp32_tokens_on_gpu(model_dir, cases) -> list[list[int]]:
    """The CUDA engine in fp32 (graphs, packed prefill) gives transformers' greedy tokens, 32 a case
    (TF32 off: the `exact_fp32` fixture); returns ours."""
    import torch

    from services.llm.config import NativeEngineConfig

    native = NativeEngineConfig(max_prefill_tokens=1024)
    parts = Parts(model_dir, max_batch=4, device="cuda", dtype="float32", native=native)
    try:
        got = ours(parts, cases)
        assert_idle(parts)
    finally:
        parts.engine.stop()
    model = hf_model_on_gpu(model_dir, torch.float32)
    for (data, prompt), ids in zip(cases, got, strict=True):
        inputs = {k: v.to("cuda") for k, v in hf_inputs(model_dir, data, prompt).items()}
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        want = out[0, inputs["input_ids"].shape[1] :].tolist()
        assert ids == want, f"{prompt!r}: engine {ids} != transformers {want}"
    return got


def check_bf16_agreement(label: str, model_dir, cases, got: list[list[int]]) -> None:
    """Our bf16 tokens agree with transformers' fp32 about as often as transformers' own bf16 does
    (random weights have near-ties that bf16 rounding flips); the three figures printed."""
    ours_vs_hf16, hf16_vs_hf32, ours_vs_hf32 = bf16_agreement(model_dir, cases, got)
    print(
        f"{label}, bf16, teacher-forced over {sum(map(len, got))} tokens: ours = transformers-bf16 argmax "
        f"{ours_vs_hf16:.1%}; transformers-bf16 = transformers-fp32 {hf16_vs_hf32:.1%}; "
        f"ours = transformers-fp32 {ours_vs_hf32:.1%}"
    )
    assert ours_vs_hf32 >= hf16_vs_hf32 - 0.03


def bf16_agreement(model_dir, cases, got: list[list[int]]) -> tuple[float, float, float]:
    """Our bf16 tokens teacher-forced through transformers in bf16 and in fp32 (EOS banned, as
    min_tokens bans it): (ours = its bf16, its bf16 = its fp32, ours = its fp32) argmax agreement."""
    import torch

    forced = {}
    for dtype in (torch.bfloat16, torch.float32):
        model = hf_model_on_gpu(model_dir, dtype)
        forced[dtype] = [
            teacher_forced_argmax(model, model_dir, data, prompt, ids, ban_eos=True)
            for (data, prompt), ids in zip(cases, got, strict=True)
        ]
        del model
    bf16, fp32 = forced[torch.bfloat16], forced[torch.float32]
    return agreement(got, bf16), agreement(bf16, fp32), agreement(got, fp32)
