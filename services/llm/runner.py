"""The model runner: decoder weights, the paged KV pool, and a step as prepare -> forward -> sample.

A step is what the scheduler planned. `prepare` stages every host-made input in one buffer and
copies it once (services/llm/transfers.py); `forward` runs the prefill chunks as the rows of one
forward (services/llm/packed.py, graph-captured per row bucket on CUDA) with the decodes riding
in its last rows when they fit, or, with `--prefill chunks` (the CPU's default, the reference),
one eager SDPA per chunk; decodes not riding run as the decode step (services/llm/decode.py,
graph-captured per batch bucket). `sample` picks one token per completing chunk and decode; the
tokens come back in one copy, the step's only host sync (services/llm/transfers.py).

A step may be launched before the tokens of the one before it are back (the engine's `OneAhead`
pacing): a decode whose last token is unseen is fed it on the device, from the tokens the last
step left there, by one gather after the upload.

Only the runner changes KV state: `Request.computed`, and the features it copies (`copy_features`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from services.llm.attention import FlexDecode, GatherDecode, Span, prefill_attention, prefill_in, prefill_out
from services.llm.decode import DecodeStep, ban_eos
from services.llm.kv_cache import KvConfig, PagedKvCache, pool_pages, pool_slots
from services.llm.packed import PackedStep, fixed_words
from services.llm.request import Request
from services.llm.sampler import new_generator, sample
from services.llm.scheduler import Chunk
from services.llm.transfers import Staging, TokenFetch
from services.model import gemv
from services.model.checkpoint import load_decoder
from services.model.llama import rope_rows, rope_tables
from services.model.mrope import mrope_columns
from services.model.quantize import quantize_decoder
from services.model.spec import ModelSpec
from services.model.stored_fp8 import check_quantize

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerConfig:
    """What a model runner is built with (services/llm/engines.py makes it from the llm's flags)."""

    max_batch: int
    kv: KvConfig
    max_prefill_tokens: int
    enforce_eager: bool = False  # CUDA without torch.compile and graphs (debugging)
    quantize: str = "none"  # none, int8, int4 (weight-only), fp8
    packed: bool | None = None  # prefill as one packed forward; None: where CUDA graphs run
    skinny_gemv: bool = True  # the decode step's linears through services/model/gemv.py


@dataclass
class StepInputs:
    """A prepared step: what it runs, staged and uploaded."""

    chunks: list[Chunk]
    decodes: list[Request]
    sampled: list[Request]  # the completing chunks' requests, then the decodes: the tokens' order
    packed: bool  # the chunks run as the packed forward
    riding: bool  # the decodes are rows of the packed forward
    chunked: tuple | None  # the per-chunk prefill's staged inputs (`_stage_chunks`)
    greedy: bool
    temperature: torch.Tensor | None = None  # [sampled] when not greedy
    top_p: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype, cfg: RunnerConfig) -> None:
        self.spec, self.device, self.dtype, self.cfg = spec, device, dtype, cfg
        self.max_context, self.max_batch = spec.text.max_context, cfg.max_batch
        self.page_size = cfg.kv.page_size
        self.max_pages = -(-self.max_context // self.page_size)  # block-table width
        self.graphs = device.type == "cuda" and not cfg.enforce_eager
        self._init_model()
        self._init_kv_pool()
        self._init_inputs()
        self._init_decode()
        self._init_packed()
        log.info(
            "decoder loaded: %d layers x %d, %s on %s; decode %s; prefill %s",
            *(spec.text.layers, spec.text.hidden, dtype, device),
            f"graph-captured for batches {self.decode.buckets}" if self.graphs else "eager",
            "per chunk" if self.packed is None else f"packed, graph-captured in row buckets {self.packed.buckets}",
        )

    # ---- start-up ----
    def _init_model(self) -> None:
        """Weights (quantized where asked), RoPE tables, EOS ids, and the prefill's compiled layer halves."""
        spec, device, dtype = self.spec, self.device, self.dtype
        check_quantize(spec, self.cfg.quantize)
        self.model = load_decoder(spec, device, dtype, keep_fp8=self.cfg.quantize == "fp8")
        quantize_decoder(self.model.layers, self.cfg.quantize, device, dtype)  # "none" leaves it
        self.rope = rope_tables(spec, device, dtype)
        self.mrope = mrope_columns(spec, device)  # None for plain RoPE
        eos = list(spec.text.eos_token_ids)
        self.eos = torch.tensor(eos, dtype=torch.int64, device=device) if eos else None  # banned under min_tokens
        # The layer halves around a prefill's attention, compiled once for any token count:
        # inductor fuses the norms, RoPE, residuals and SiLU that eager runs as separate passes.
        self.prefill_in, self.prefill_out = prefill_in, prefill_out
        if self.graphs:
            self.prefill_in = torch.compile(prefill_in, dynamic=True)
            self.prefill_out = torch.compile(prefill_out, dynamic=True)

    def _init_kv_pool(self) -> None:
        """The paged pool, sized by what the weights and the largest prefill leave (on CUDA). On the
        CPU the largest prefill runs too, so the held heap (services/common/glibc_malloc.py) has its
        share of the working set before the first request (the rest comes within about a minute)."""
        own = self._warm_up(self.cfg.max_prefill_tokens)
        self.n_pages = pool_pages(self.spec, self.dtype, self.device, self.cfg.kv, self.max_batch, own)
        self.kv = PagedKvCache(self.spec, self.device, self.dtype, self.n_pages, self.page_size)

    def _init_inputs(self) -> None:
        """The staging buffer (the decode step's fixed inputs first, then the packed step's, then a
        step's other values) and the two token fetches a step and the one after it take in turn."""
        b, p, cfg = self.max_batch, self.max_pages, self.cfg
        self.use_packed = self.graphs if cfg.packed is None else cfg.packed
        self.rows = cfg.max_prefill_tokens + b  # a full budget, and every decode riding
        mrope = self.mrope is not None
        self.decode_words = b * (3 + p + mrope)  # tokens, positions, block tables, EOS bans (M-RoPE: deltas)
        packed_words = fixed_words(self.rows, b, self.n_pages, mrope) if self.use_packed else 0
        extra = (3 + 3 * mrope) * cfg.max_prefill_tokens + b * self.max_context + 8 * b
        fixed = self.decode_words + packed_words
        self.staging = Staging(fixed + extra, fixed, self.device)
        self.fetches = (TokenFetch(b, self.device), TokenFetch(b, self.device))
        self._turn = 0
        spans = [(0, b), (b, b), (2 * b, b * p), (b * (2 + p), b)] + ([(b * (3 + p), b)] if mrope else [])
        views = [self.staging.fixed_view(at, n) for at, n in spans]
        self._tok, self._pos, tab, self._ban = (host for host, _ in views[:4])
        self._delta = views[4][0] if mrope else None
        self._tab = tab.reshape(b, p)
        self._decode_inputs = tuple(dev for _, dev in views)
        # The last step launched: its fetch (its tokens stay on the device) and the row of each
        # request it samples, for the next step's decodes to be fed from.
        self._last: tuple[TokenFetch | None, dict[int, int]] = (None, {})

    def _init_decode(self) -> None:
        b, t = self.max_batch, self.spec.text
        linear = gemv.linear if self.cfg.skinny_gemv else F.linear
        if self.graphs:
            attn = FlexDecode(self.page_size, t.heads, t.kv_heads, self.n_pages, b, self.device, linear=linear)
        else:
            attn = GatherDecode(self.page_size, t.heads, t.kv_heads, linear=linear)
        tok, pos, tables, ban, *delta = self._decode_inputs
        inputs = (tok, pos, tables.view(b, self.max_pages), ban)
        self.decode = DecodeStep(self.model, self.kv, attn, self.rope, inputs, self.eos, b, *delta)
        if self.graphs:
            self.decode.capture(self.page_size)

    def _init_packed(self) -> None:
        self.packed = None
        if not self.use_packed:
            return
        self.packed = PackedStep(
            *(self.model, self.kv, self.rope, self.staging, self.decode_words, self.eos, self.rows),
            *(self.max_batch, self.decode, self.prefill_in, self.prefill_out, self.mrope),
        )
        if self.graphs:  # where the graphs cannot be captured and packed was not asked for, run per chunk
            self.packed = self.packed.capture(fallback=self.cfg.packed is None)

    # ---- the step ----
    def step(self, chunks: list[Chunk], decodes: list[Request]) -> list[int]:
        """Run the planned chunks and decodes and wait for them; one token per completing chunk, then per decode."""
        return self.launch(chunks, decodes).wait()

    @torch.inference_mode()
    def launch(self, chunks: list[Chunk], decodes: list[Request]) -> TokenFetch:
        """Queue the planned chunks and decodes without a host sync; returns the step's fetch:
        `wait()` gives one token for each completing chunk, then each decode.

        A decode whose last token is unseen must have been sampled by the step launched last.
        """
        fetch = self.fetches[self._turn]
        self._turn ^= 1
        step = self.prepare(chunks, decodes, fetch)
        logits, argmax = self.forward(step)
        tokens = self.sample(step, logits, argmax)
        for c in chunks:
            c.req.computed = c.end
        for r in decodes:
            r.computed += 1
        fetch.start(tokens)
        self._last = (fetch, {id(r): i for i, r in enumerate(step.sampled)})
        return fetch

    def prepare(self, chunks: list[Chunk], decodes: list[Request], fetch: TokenFetch) -> StepInputs:
        """Stage the step's inputs and upload them; feed unseen tokens from the last step's on the device."""
        sampled = [c.req for c in chunks if c.completes] + decodes
        if len(sampled) > self.max_batch:  # the scheduler runs at most max_batch sequences
            raise ValueError(f"a step samples {len(sampled)} sequences; this runner holds {self.max_batch}")
        fed = [(i, r) for i, r in enumerate(decodes) if r.unseen]
        last, rows_of = self._last
        if any(id(r) not in rows_of for _, r in fed):
            raise RuntimeError("a decode's unseen token is not from the step launched last")
        for r in [c.req for c in chunks] + decodes:  # before any forward of the step (it may write the source)
            if r.kv_copy:  # a cached part of its next page (services/llm/prefix.py)
                src, n = r.kv_copy
                self.kv.copy_page(src, r.blocks[r.computed // self.page_size], n)
                r.kv_copy = None
        staging = self.staging
        staging.begin()
        packed = bool(chunks) and self.packed is not None and self.packed.stage(chunks, decodes)
        riding = packed and self.packed.decode_rows > 0
        chunked = self._stage_chunks(chunks) if chunks and not packed else None
        if decodes:
            self._stage_decode(decodes, self.packed.decode_rows if riding else self.decode.bucket(len(decodes)))
        step = StepInputs(chunks, decodes, sampled, packed, riding, chunked, all(r.sampling.greedy for r in sampled))
        if not step.greedy:
            step.temperature = staging.floats([r.sampling.temperature for r in sampled])
            step.top_p = staging.floats([r.sampling.top_p for r in sampled])
        if fed:  # decode rows, and where their tokens are in the last step's
            feed_rows = staging.ints([i for i, _ in fed])
            feed_from = staging.ints([rows_of[id(r)] for _, r in fed])
        fetch.mark()
        staging.upload()
        if fed:
            ids = self.packed.decode_ids() if riding else self.decode.tokens
            ids.index_copy_(0, feed_rows.long(), last.tokens.index_select(0, feed_from.long()).to(ids.dtype))
        return step

    def forward(self, step: StepInputs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Run the prepared step: logits [sampled, V] (fp32) and greedy tokens, in pieces in the tokens' order."""
        logits, argmax = [], []  # the completing chunks', then the decodes'
        completing = len(step.sampled) - len(step.decodes)
        if step.packed:
            x, row = self.packed.embed(), 0
            for c in step.chunks:
                self._scatter_features(x, c, row)
                row += c.end - c.start
            self.packed.run()
            n = len(step.sampled) if step.riding else completing
            logits.append(self.packed.logits[:n])
            argmax.append(self.packed.greedy[:n])  # taken inside the captured step
        elif step.chunked:
            logits.append(self._prefill_chunks(step.chunks, *step.chunked))
            if step.greedy:
                argmax.append(logits[-1].argmax(-1))
        if step.decodes and not step.riding:
            self.decode.run(len(step.decodes), max_len=max(r.computed for r in step.decodes) + 1)
            logits.append(self.decode.logits[: len(step.decodes)])
            argmax.append(self.decode.greedy[: len(step.decodes)])
        return logits, argmax

    def sample(self, step: StepInputs, logits: list[torch.Tensor], argmax: list[torch.Tensor]) -> torch.Tensor | None:
        """One token per sampled row [sampled] (None when the step samples none)."""
        if not step.sampled:
            return None
        if step.greedy:
            return argmax[0] if len(argmax) == 1 else torch.cat(argmax)
        gens = [None if r.sampling.greedy else r.generator for r in step.sampled]
        any_top_p = any(r.sampling.top_p < 1.0 for r in step.sampled)
        return sample(torch.cat(logits), step.temperature, step.top_p, gens, any_top_p)

    # ---- inputs ----
    def _stage_decode(self, reqs: list[Request], b: int) -> None:
        """The decodes' inputs, padded to b rows (the decode step's bucket, or the packed step's decode rows)."""
        self._tok[:b] = 0
        self._pos[:b] = 0
        self._tab[:b] = 0  # padding rows and unused entries point at the null page
        self._ban[:b] = 0
        if self._delta is not None:
            self._delta[:b] = 0
        for i, r in enumerate(reqs):
            # Its last token, or a prompt's last position (Scheduler._one_left); unseen: fed on the device.
            self._tok[i] = 0 if r.unseen else r.token_at(r.computed)
            self._pos[i] = r.computed
            self._tab[i, : len(r.blocks)] = r.blocks
            self._ban[i] = r.generated < r.sampling.min_tokens
            if self._delta is not None:
                self._delta[i] = r.rope_delta

    def _stage_chunks(self, chunks: list[Chunk]) -> tuple:
        """A per-chunk prefill's inputs: ids, positions, pool slots, each chunk's span (with the pool
        positions it reads when it continues its sequence), and the sampled rows and their EOS bans
        (None when no chunk completes)."""
        staging, page = self.staging, self.page_size
        ids, positions, rope, slots, spans, last_rows, bans = [], [], [], [], [], [], []
        row = 0
        for c in chunks:
            req = c.req
            seq = req.prompt_ids + req.output_ids if req.output_ids else req.prompt_ids
            ids.extend(seq[c.start : c.end])
            pos = np.arange(c.start, c.end)
            positions.append(pos)
            if self.mrope is not None:
                rope.append(req.rope_positions(c.start, c.end).ravel())
            slots.append(pool_slots(req.blocks, pos, page))
            context = None
            if c.start > 0:  # attends to earlier positions, already in the pool
                context = staging.ints(pool_slots(req.blocks, np.arange(c.end), page))
            spans.append(Span(row, c.end - c.start, c.start, context))
            row += c.end - c.start
            if c.completes:
                last_rows.append(row - 1)
                bans.append(len(req.output_ids) < req.sampling.min_tokens)
        rope_positions = staging.ints(np.concatenate(rope)).view(-1, 3) if rope else None
        return (
            staging.ints(ids),
            staging.ints(np.concatenate(positions)),
            rope_positions,
            staging.ints(np.concatenate(slots)),
            spans,
            staging.ints(last_rows) if last_rows else None,
            staging.ints(bans) if last_rows else None,
        )

    def _scatter_features(self, x: torch.Tensor, chunk: Chunk, row: int) -> None:
        """Write the image features that fall inside the chunk over their placeholder embeddings."""
        req = chunk.req
        if req.copy_features:
            # They alias memory whose lease ends after this step, and the request may be
            # recomputed later (preemption): keep a copy, made before the lease goes. Also when
            # this chunk reads none of them (its prefix was cached): a resume may need them.
            req.image_features = [f.to(self.device, self.dtype).clone() for f in req.image_features]
            req.copy_features = False
        for pos, feats in zip(req.image_positions, req.image_features, strict=True):
            lo, hi = max(pos, chunk.start), min(pos + feats.shape[0], chunk.end)
            if lo < hi:
                x[row + lo - chunk.start : row + hi - chunk.start] = feats[lo - pos : hi - pos].to(
                    self.device, self.dtype, non_blocking=True
                )

    # ---- the per-chunk prefill (the reference) ----
    def _prefill_chunks(
        self, chunks: list[Chunk], ids, positions, rope_positions, slots, spans, last_rows, bans
    ) -> torch.Tensor:
        """Packed chunks -> logits [completing chunks, V] (fp32), EOS banned where min_tokens says."""
        x = self.model.embed_tokens(ids)  # [N, H]
        for c, span in zip(chunks, spans, strict=True):
            self._scatter_features(x, c, span.row)
        rope = positions if rope_positions is None else rope_positions
        hidden = self._chunks_forward(self.kv, x, positions.long(), slots.long(), spans, rope.long())
        if last_rows is None:
            return hidden.new_zeros(0, self.model.lm_head.out_features, dtype=torch.float32)
        logits = self.model.logits(hidden[last_rows.long()])
        ban_eos(logits, self.eos, bans)
        return logits

    def _chunks_forward(self, kv: PagedKvCache, x: torch.Tensor, positions, slots, spans: list[Span], rope=None):
        """Chunks x [N, H] at `positions` [N], stored at pool positions `slots` [N] of `kv` -> hidden [N, H].
        `rope`: the rotary positions where they differ from `positions` ([N, 3] under M-RoPE)."""
        cos, sin = rope_rows(self.rope, positions if rope is None else rope, self.mrope)
        for i, layer in enumerate(self.model.layers):
            k_pool, v_pool = kv.k[i], kv.v[i]
            q, k, v = self.prefill_in(layer, x, cos, sin, k_pool, v_pool, slots)
            x = self.prefill_out(layer, x, prefill_attention(q, k, v, k_pool, v_pool, spans))
        return x

    def _warm_up(self, tokens: int) -> int:
        """Run a prefill of `tokens` positions on a small pool; return this process's peak memory:
        what the weights and the largest prefill take is what the KV pool must leave free (0 off CUDA)."""
        device, page = self.device, self.page_size
        cuda = device.type == "cuda"
        if cuda:  # what loading freed (a quantized engine's full-precision weights) is not this process's to keep
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        per_seq = min(tokens, self.max_context)
        kv = PagedKvCache(self.spec, device, self.dtype, -(-per_seq // page) + 1, page)
        spans, row = [], 0
        while row < tokens:
            n = min(per_seq, tokens - row)
            spans.append(Span(row, n, 0, None))
            row += n
        positions = torch.cat([torch.arange(s.length, device=device) for s in spans])
        with torch.inference_mode():
            x = self.model.embed_tokens(torch.zeros(tokens, dtype=torch.int64, device=device))
            self.model.logits(self._chunks_forward(kv, x, positions, positions + page, spans)[-1:])
            # A one-token prefill too: compiled code specialises a size of 1, and that compile
            # belongs before `ready`, not in the middle of serving.
            self._chunks_forward(kv, x[:1], positions[:1], positions[:1] + page, [Span(0, 1, 0, None)])
        if not cuda:
            return 0
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_reserved(device)
        del kv
        torch.cuda.empty_cache()
        return peak

    # ---- device ----
    def synchronize(self) -> None:
        """Wait for everything queued on the device (after a launch that failed half-way)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def new_generator(self, seed: int | None) -> torch.Generator:
        return new_generator(self.device, seed)
