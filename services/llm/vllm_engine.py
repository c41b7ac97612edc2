"""vLLM as the llm engine (`--llm-engine vllm`): the mesh's QoS, tracing and hand-off around it.

vLLM serves the checkpoint's language model alone, as a Llama checkpoint exported once next
to the run (`.cache/vllm-text/`); the prompt goes to it as `prompt_embeds`: the token
embeddings of the chat prompt from the checkpoint's own embedding table, with each image's
features written over its placeholder positions ([T, H], the same tensor the native engine
builds). Requests run under vLLM's `AsyncLLM` with the priority scheduling policy, the
`qos-level` as the priority (realtime 0 first), streamed as deltas; closing the stream early
(cancel, deadline) aborts the request in vLLM.

Limit: vLLM's front end copies `prompt_embeds` to its engine core (another process unless
VLLM_ENABLE_V1_MULTIPROCESSING=0), so zero copy ends at the front end. The copy is counted
in vlmesh_handoffs_total{transport="VLLM_PROMPT_EMBEDS"} and its bytes.

KV space: vLLM reserves a fraction of the whole device (on a CPU host, of the memory node)
unless told a size. We tell it what this config needs, max batch x the model's context
(`--vllm-kv-cache-gib` overrides it; so does vLLM's own VLLM_CPU_KVCACHE_SPACE).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import AsyncIterator
from pathlib import Path

import torch
from safetensors import safe_open

from services.common.metrics import HANDOFF_BYTES, HANDOFFS, KV_SLOTS
from services.common.sampling import Sampling
from services.llm.interface import EngineStats, Job, Leases
from services.llm.request import Finish, Output, Request
from services.llm.submit import new_request
from services.model.checkpoint import load_decoder
from services.model.prompt import PromptBuilder
from services.model.spec import ModelSpec

log = logging.getLogger(__name__)

TRANSPORT = "VLLM_PROMPT_EMBEDS"
FINISH = {"stop": Finish.STOP, "length": Finish.LENGTH, "abort": Finish.ABORT}
# On vLLM's CPU backend a tiny test model (head_dim 32) needs about 4/3 of our count per token.
KV_HEADROOM_BYTES = 64 * 2**20


def export_text_model(spec: ModelSpec, dtype: torch.dtype, root: Path = Path(".cache/vllm-text")) -> Path:
    """The checkpoint's decoder as a LlamaForCausalLM directory (weights, config, tokenizer); made once."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    key = hashlib.sha256(f"{spec.model_dir.resolve()}|{spec.model_id}|{dtype}".encode()).hexdigest()[:16]
    out = root / key
    if (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    decoder = load_decoder(spec, torch.device("cpu"), dtype, fuse=False)
    # Our module names are the Llama ones: embed_tokens, layers.N.*, norm under `model.`, then lm_head.
    state = {(k if k.startswith("lm_head.") else f"model.{k}"): v.contiguous() for k, v in decoder.state_dict().items()}
    if spec.text.tie_embeddings:
        state.pop("lm_head.weight", None)
    text = spec.hf_config.text_config
    text.architectures = ["MistralForCausalLM" if text.model_type == "mistral" else "LlamaForCausalLM"]
    text.tie_word_embeddings = spec.text.tie_embeddings  # DeepSeek-VL ties at the top of its config
    if hasattr(text, "quantization_config"):  # stored fp8 codes are multiplied out above: the export is dense
        del text.quantization_config
    text.torch_dtype = dtype
    text.save_pretrained(out)
    AutoTokenizer.from_pretrained(spec.model_dir, local_files_only=True).save_pretrained(out)
    save_file(state, str(out / "model.safetensors"))
    log.info("exported the language model for vLLM to %s", out)
    return out


class VllmSubmission:
    """One request in vLLM: `outputs()` as the native engine's, and a Request for timings and usage."""

    def __init__(self, engine: VllmEngine, req: Request, embeds: torch.Tensor, params) -> None:
        self.engine, self.req, self._embeds, self._params = engine, req, embeds, params

    async def outputs(self) -> AsyncIterator[Output]:
        req, finished = self.req, False
        stream = self.engine.llm.generate({"prompt_embeds": self._embeds}, self._params, req.id, priority=int(req.qos))
        self._embeds = None  # vLLM holds its copy now
        try:
            req.scheduled_at = time.perf_counter()
            async for out in stream:
                done = out.outputs[0]
                if req.prefill_done_at == 0.0:
                    req.prefill_done_at = time.perf_counter()
                req.output_ids.extend(done.token_ids)
                finish = FINISH.get(done.finish_reason) if out.finished else None
                if out.finished:
                    finished = True
                    req.finished_at = time.perf_counter()
                    finish = finish or Finish.STOP
                    self._engine_times(out.metrics)
                yield Output(done.text, list(done.token_ids), finish)
        finally:
            if not finished:
                await self.engine.llm.abort(req.id)

    def _engine_times(self, stats) -> None:
        """vLLM's own queue, prefill and decode boundaries, where it recorded them.

        Its engine core stamps them with time.monotonic(), the clock of our perf_counter on
        Linux (both CLOCK_MONOTONIC), so they replace the front end's view: without them, vLLM's
        queueing would count as prefill.
        """
        if stats is None or not (0.0 < stats.scheduled_ts <= stats.first_token_ts <= stats.last_token_ts):
            return
        req = self.req
        if not req.arrival <= stats.scheduled_ts <= req.finished_at:
            return  # not our clock after all (another platform): keep the front end's figures
        req.scheduled_at, req.prefill_done_at, req.finished_at = (
            stats.scheduled_ts,
            stats.first_token_ts,
            stats.last_token_ts,
        )


def kv_cache_bytes(spec: ModelSpec, dtype: torch.dtype, max_batch: int) -> int:
    """K and V of every layer for `max_batch` sequences of the whole context."""
    t = spec.text
    return 2 * t.layers * t.kv_heads * t.head_dim * dtype.itemsize * max_batch * t.max_context


class VllmEngine:
    """vLLM's AsyncLLM over the exported language model, behind the Engine interface."""

    reads_in_place = False  # the features are copied into prompt_embeds at submit
    reads_cached_images = False  # prompt_embeds: nothing to key its prefix cache by

    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype,
        max_batch: int,
        prompts: PromptBuilder,
        default_max_tokens: int,
        kv_cache_gib: float = 0.0,
    ) -> None:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.spec, self.dtype, self.max_batch = spec, dtype, max_batch
        self.prompts, self.default_max_tokens = prompts, default_max_tokens
        self.device = torch.device("cpu")  # features are imported to the host: prompt_embeds are copied anyway
        if kv_cache_gib > 0:
            kv_bytes = math.ceil(kv_cache_gib * 2**30)
        else:  # vLLM lays the cache out in blocks and pads small heads: a little headroom on top
            kv_bytes = kv_cache_bytes(spec, dtype, max_batch) + KV_HEADROOM_BYTES
        text_dir = export_text_model(spec, dtype)
        with safe_open(str(text_dir / "model.safetensors"), framework="pt") as f:
            self.embed_table = f.get_tensor("model.embed_tokens.weight")  # [vocab, H], for prompt_embeds
        args = AsyncEngineArgs(
            model=str(text_dir),
            dtype={torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype],
            max_model_len=spec.text.max_context,
            max_num_seqs=max_batch,
            enable_prompt_embeds=True,
            scheduling_policy="priority",
            enforce_eager=True,
            enable_prefix_caching=False,
            # Per-request stats on: vLLM then stamps each request's queue, first and last token
            # times (RequestOutput.metrics), which become our spans and timings. AsyncLLM alone
            # does not print the periodic stats lines (vLLM's API server asks for those).
            disable_log_stats=False,
            kv_cache_memory_bytes=kv_bytes,
        )
        try:
            self.llm = AsyncLLM.from_engine_args(args)
        except Exception as err:
            # vLLM's own message is many lines under a traceback; name the setting to change.
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(
                f"vLLM did not start with {kv_bytes / 2**30:.2f} GiB of KV space for {max_batch} sequences "
                f"(--vllm-kv-cache-gib, --max-llm-batch): {first}"
            ) from err
        # Requests vLLM holds (each with its KV blocks), in the native engine's gauge.
        held = self.llm.output_processor.get_num_unfinished_requests
        KV_SLOTS.labels("used").set_function(held)
        KV_SLOTS.labels("free").set_function(lambda: max(0, max_batch - held()))
        log.info(
            "vLLM engine ready: %s, max %d sequences, %s, KV space %.2f GiB",
            text_dir,
            max_batch,
            dtype,
            kv_bytes / 2**30,
        )
        self._aborts: set[asyncio.Task] = set()

    def start(self) -> None:
        """Nothing to start: AsyncLLM runs from construction."""

    def stats(self) -> EngineStats:
        # vLLM tells only how many requests it holds, queued or running: all count as running.
        held = self.llm.output_processor.get_num_unfinished_requests()
        return EngineStats(running=held, waiting=0, free_slots=max(0, self.max_batch - held))

    def abort(self, request_id: str) -> None:
        """On the event loop: vLLM's abort is a coroutine."""
        task = asyncio.get_running_loop().create_task(self.llm.abort(request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    @torch.inference_mode()
    def _embeds(self, ids: list[int], positions: list[int], features: list[torch.Tensor]) -> torch.Tensor:
        """[T, H]: token embeddings with each image's features over its placeholders."""
        embeds = self.embed_table[torch.tensor(ids)]
        for pos, feats in zip(positions, features, strict=True):
            embeds[pos : pos + feats.shape[0]] = feats.to(self.device, self.dtype)
        return embeds

    def _params(self, sampling: Sampling, max_new: int):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        greedy = sampling.greedy
        return SamplingParams(
            temperature=0.0 if greedy else sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p,
            seed=sampling.seed,
            max_tokens=max_new,
            min_tokens=sampling.min_tokens,
            ignore_eos=sampling.ignore_eos,
            stop=list(sampling.stop) or None,
            stop_token_ids=None if sampling.ignore_eos else list(self.spec.text.eos_token_ids) or None,
            output_kind=RequestOutputKind.DELTA,
        )

    def submit(self, job: Job, leases: Leases | None = None) -> VllmSubmission:
        """Copy the features into the prompt's embeddings; the caller releases any leases after this."""
        if leases is not None:
            raise ValueError("the vLLM engine copies the features at submit: release the leases instead")
        # The detokenizer stays unused (vLLM detokenizes) and outputs arrive through `outputs()`.
        req = new_request(self.prompts, self.default_max_tokens, job, lambda out: None)
        embeds = self._embeds(req.prompt_ids, req.image_positions, job.features)
        HANDOFFS.labels(TRANSPORT).inc()
        HANDOFF_BYTES.labels(TRANSPORT).inc(embeds.numel() * embeds.element_size())
        return VllmSubmission(self, req, embeds, self._params(job.sampling, req.max_new))

    def stop(self) -> None:
        self.llm.shutdown()
        del self.llm  # now, while the interpreter is whole (its __del__ shuts down again)
