"""The model runner: decoder weights, the paged KV pool, the step's forwards and sampling.

A step is what the scheduler planned. Its prefill chunks run as the rows of one forward
(services/llm/packed.py; graph-captured per row bucket on CUDA), its decodes in the last rows
of that forward when they fit; or, with `--prefill chunks` (the CPU's default, the
reference), packed in one eager forward with one SDPA per chunk. Decodes not in a packed
forward run as the decode step (services/llm/decode.py: graph-captured per batch bucket on
CUDA). Then sampling for every row that wants a token. The host stages all of the
step's inputs in one buffer and copies it once (services/llm/staging.py); the tokens come
back in one copy, the step's only host sync. With `--lanes split` a prefill step and a decode
step run at once, each in its lane (services/llm/lane.py): its stream, buffer and token copy.

A step may be launched before the tokens of the one before it are back (on CUDA the shared lane
runs a step ahead, services/llm/shared_loop.py): a decode whose last token is still unseen is fed
it on the device, from the tokens the last step on the lane left there, by one gather after the
upload.

Only the runner changes KV state: `Request.computed`, and the features it copies
(`copy_features`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from services.llm.attention import FlexDecode, GatherDecode, prefill_in, prefill_out
from services.llm.chunked import forward, stage_chunks, warm_up
from services.llm.decode import DecodeStep, ban_eos
from services.llm.fetch import TokenFetch
from services.llm.kv_cache import KvConfig, PagedKvCache, pool_pages
from services.llm.lane import Lane, build_lanes
from services.llm.packed import PackedStep, fixed_words
from services.llm.request import Request
from services.llm.sampler import new_generator, sample
from services.llm.scheduler import Chunk
from services.model import gemv
from services.model.checkpoint import load_decoder
from services.model.llama import rope_tables
from services.model.quantize import quantize_decoder
from services.model.spec import LlavaSpec

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        spec: LlavaSpec,
        device: torch.device,
        dtype: torch.dtype,
        max_batch: int,
        kv: KvConfig,
        max_prefill_tokens: int,
        enforce_eager: bool = False,
        quantize: str = "none",
        packed: bool | None = None,
        skinny_gemv: bool = True,
        lanes: str = "shared",
        prefill_sms: int = 0,
        decode_priority: str = "normal",
    ) -> None:
        """`packed`: run prefill steps as one packed forward (services/llm/packed.py); by default
        where CUDA graphs are on. Off, a prefill runs per chunk, eagerly (the reference).
        `skinny_gemv`: the decode step's linears through services/model/gemv.py (else F.linear).
        `lanes`: split runs prefill and decode as two lanes (services/llm/lane.py), on CUDA the
        prefill on `prefill_sms` SMs of its own (0: three quarters; all of them: no partition), the
        decode on a stream of `decode_priority`; shared runs them in one step."""
        self.spec, self.device, self.dtype = spec, device, dtype
        t = spec.text
        self.max_context, self.max_batch = t.max_context, max_batch
        self.page_size = kv.page_size
        self.max_pages = -(-t.max_context // kv.page_size)  # block-table width
        self.model = load_decoder(spec, device, dtype)
        quantize_decoder(self.model.layers, quantize, device, dtype)  # weight-only; "none" leaves it
        self.rope = rope_tables(spec, device, dtype)
        eos = list(t.eos_token_ids)
        self.eos = torch.tensor(eos, dtype=torch.int64, device=device) if eos else None  # banned under min_tokens
        cuda = device.type == "cuda"
        self.graphs = cuda and not enforce_eager
        # Prefill: the layer halves around its attention compiled once for any token count
        # (dynamic): inductor fuses the norms, RoPE, residuals and SiLU that eager would run
        # as some twenty passes over [N, H] per layer.
        self.prefill_in, self.prefill_out = prefill_in, prefill_out
        if self.graphs:
            self.prefill_in = torch.compile(prefill_in, dynamic=True)
            self.prefill_out = torch.compile(prefill_out, dynamic=True)
        own = warm_up(self, max_prefill_tokens) if cuda else 0
        self.n_pages = pool_pages(spec, dtype, device, kv, max_batch, own)
        self.kv = PagedKvCache(spec, device, dtype, self.n_pages, kv.page_size)
        # Decode inputs at fixed addresses: tokens, positions, block tables, EOS-ban flags; then
        # the packed step's (services/llm/packed.py), when it runs the prefill; then a chunked
        # prefill's ids, positions, slots, continued chunks' context and per-row values. Split, the
        # decode's inputs are the decode lane's, the rest the prefill lane's.
        b, p = max_batch, self.max_pages
        auto, packed = packed is None, self.graphs if packed is None else packed
        self.split = lanes == "split"
        rows = max_prefill_tokens + (0 if self.split else max_batch)  # a full budget, and every decode riding
        decode_words = b * (3 + p)
        packed_words = fixed_words(rows, max_batch, self.n_pages) if packed else 0
        extra = 3 * max_prefill_tokens + max_batch * t.max_context + 8 * max_batch
        self.lanes = build_lanes(
            self.split, device, max_batch, decode_words, packed_words, extra, prefill_sms, decode_priority
        )
        self.decode_lane = self.lanes["decode" if self.split else "shared"]
        self.prefill_lane = self.lanes["prefill" if self.split else "shared"]
        views = [
            self.decode_lane.staging.fixed_view(at, n) for at, n in ((0, b), (b, b), (2 * b, b * p), (b * (2 + p), b))
        ]
        self._tok, self._pos, tab, self._ban = (host for host, _ in views)
        self._tab = tab.reshape(b, p)
        tok, pos, tables, ban = (dev for _, dev in views)
        self._tok_dev = tok
        # Per lane, the last step launched there: its fetch (its tokens stay on the device) and
        # the row of each request it samples, for the next step's decodes to be fed from.
        self._last: dict[str, tuple[TokenFetch, dict[int, int]]] = {}
        linear = gemv.linear if skinny_gemv else F.linear
        if self.graphs:
            attn = FlexDecode(kv.page_size, t.heads, t.kv_heads, self.n_pages, max_batch, device, linear=linear)
        else:
            attn = GatherDecode(kv.page_size, t.heads, t.kv_heads, linear=linear)
        inputs = (tok, pos, tables.view(b, p), ban)
        self.decode = DecodeStep(self.model, self.kv, attn, self.rope, inputs, self.eos, max_batch)
        self.packed = None
        if packed:  # split, no decode rides in its rows: the decode lane runs them beside it
            self.packed = PackedStep(
                self.model,
                self.kv,
                self.rope,
                self.prefill_lane.staging,
                0 if self.split else decode_words,
                self.eos,
                rows,
                max_batch,
                None if self.split else self.decode,
                self.prefill_in,
                self.prefill_out,
            )
        if self.graphs:  # each lane's graphs on its own stream: a graph keeps the SMs it was captured on
            self.decode.capture(kv.page_size, self.decode_lane.stream)
            if self.packed is not None:
                self.packed = self.packed.capture(fallback=auto, stream=self.prefill_lane.stream)
        log.info(
            "decoder loaded: %d layers x %d, %s on %s; lanes %s; decode %s; prefill %s",
            *(t.layers, t.hidden, dtype, device),
            ", ".join(f"{n} on {lane.sms or 'all'} SMs" for n, lane in self.lanes.items()),
            f"graph-captured for batches {self.decode.buckets}" if self.graphs else "eager",
            "per chunk" if self.packed is None else f"packed, graph-captured in row buckets {self.packed.buckets}",
        )

    # ---- the step ----
    def step(self, chunks: list[Chunk], decodes: list[Request]) -> list[int]:
        """Run the planned chunks and decodes and wait for them; return one token for each
        completing chunk, then each decode. Split, the two lanes run at once."""
        if not self.split:
            return self.launch(chunks, decodes, self.prefill_lane).wait()
        fetches = [self.launch(chunks, [], self.prefill_lane)] if chunks else []
        if decodes:
            fetches.append(self.launch([], decodes, self.decode_lane))
        return [token for fetch in fetches for token in fetch.wait()]

    @torch.inference_mode()
    def launch(self, chunks: list[Chunk], decodes: list[Request], lane: Lane) -> TokenFetch:
        """Queue the planned chunks and decodes on `lane`, without a host sync; returns the step's
        fetch: `wait()` gives one token for each completing chunk, then each decode.

        A decode whose last token is unseen must have been sampled by the step launched last on
        this lane. Until the step ends its requests' pages must not be given to a step on another
        stream (the engine holds them: `Request.in_flight`).
        """
        sampled = [c.req for c in chunks if c.completes] + decodes
        if len(sampled) > self.max_batch:  # the scheduler runs at most max_batch sequences
            raise ValueError(f"a step samples {len(sampled)} sequences; this runner holds {self.max_batch}")
        if decodes and lane is not self.decode_lane:
            raise ValueError(f"the {lane.name} lane runs no decodes")
        fed = [(i, r) for i, r in enumerate(decodes) if r.unseen]
        if fed:
            last, rows_of = self._last.get(lane.name, (None, {}))
            if any(id(r) not in rows_of for _, r in fed):
                raise RuntimeError("a decode's unseen token is not from the step launched last on its lane")
        fetch, staging = lane.take(), lane.staging
        with lane.on():
            for r in [c.req for c in chunks] + decodes:  # before any forward of the step (it may write the source)
                if r.kv_copy:  # a cached part of its next page (services/llm/prefix.py)
                    src, n = r.kv_copy
                    self.kv.copy_page(src, r.blocks[r.computed // self.page_size], n)
                    r.kv_copy = None
            staging.begin()
            packed = bool(chunks) and self.packed is not None and self.packed.stage(chunks, decodes)
            riding = packed and self.packed.decode_rows > 0  # the decodes are rows of the packed forward
            prefill = stage_chunks(chunks, staging, self.page_size) if chunks and not packed else None
            if decodes:
                self._stage_decode(decodes, self.packed.decode_rows if riding else self.decode.bucket(len(decodes)))
            greedy = all(r.sampling.greedy for r in sampled)
            if not greedy:
                temperature = staging.floats([r.sampling.temperature for r in sampled])
                top_p = staging.floats([r.sampling.top_p for r in sampled])
            if fed:  # decode rows, and where their tokens are in the last step's
                feed_rows = staging.ints([i for i, _ in fed])
                feed_from = staging.ints([rows_of[id(r)] for _, r in fed])
            fetch.mark()
            staging.upload()
            if fed:
                ids = self.packed.decode_ids() if riding else self._tok_dev
                ids.index_copy_(0, feed_rows.long(), last.tokens.index_select(0, feed_from.long()).to(ids.dtype))
            logits, argmax = [], []  # the completing chunks', then the decodes'
            completing = len(sampled) - len(decodes)
            if packed:
                self._run_packed(chunks)
                n = len(sampled) if riding else completing
                logits.append(self.packed.logits[:n])
                argmax.append(self.packed.greedy[:n])  # taken inside the captured step
            elif prefill:
                logits.append(self._prefill(chunks, *prefill))
                if greedy:
                    argmax.append(logits[-1].argmax(-1))
            if decodes and not riding:
                self.decode.run(len(decodes), max_len=max(r.computed for r in decodes) + 1)
                logits.append(self.decode.logits[: len(decodes)])
                argmax.append(self.decode.greedy[: len(decodes)])
            if not sampled:
                tokens = None
            elif greedy:
                tokens = argmax[0] if len(argmax) == 1 else torch.cat(argmax)
            else:
                gens = [None if r.sampling.greedy else r.generator for r in sampled]
                any_top_p = any(r.sampling.top_p < 1.0 for r in sampled)
                tokens = sample(torch.cat(logits), temperature, top_p, gens, any_top_p)
            for c in chunks:
                c.req.computed = c.end
            for r in decodes:
                r.computed += 1
            fetch.start(tokens)
        self._last[lane.name] = (fetch, {id(r): i for i, r in enumerate(sampled)})
        return fetch

    def _run_packed(self, chunks: list[Chunk]) -> None:
        """The staged packed step: embeddings and features into its input rows, then the forward."""
        x, row = self.packed.embed(), 0
        for c in chunks:
            self._scatter_features(x, c, row)
            row += c.end - c.start
        self.packed.run()

    # ---- decode ----
    def _stage_decode(self, reqs: list[Request], b: int) -> None:
        """The decodes' inputs, padded to b rows (the decode step's bucket, or the packed step's decode rows)."""
        self._tok[:b] = 0
        self._pos[:b] = 0
        self._tab[:b] = 0  # padding rows and unused entries point at the null page
        self._ban[:b] = 0
        for i, r in enumerate(reqs):
            # Its last token, or a prompt's last position (Scheduler._one_left); unseen: fed on the device.
            self._tok[i] = 0 if r.unseen else r.token_at(r.computed)
            self._pos[i] = r.computed
            self._tab[i, : len(r.blocks)] = r.blocks
            self._ban[i] = r.generated < r.sampling.min_tokens

    # ---- prefill ----
    def _prefill(self, chunks: list[Chunk], ids, positions, slots, spans, last_rows, bans) -> torch.Tensor:
        """Packed chunks -> logits [completing chunks, V] (fp32), EOS banned where min_tokens says."""
        x = self.model.embed_tokens(ids)  # [N, H]
        for c, span in zip(chunks, spans, strict=True):
            self._scatter_features(x, c, span.row)
        hidden = forward(self, self.kv, x, positions.long(), slots.long(), spans)
        if last_rows is None:
            return hidden.new_zeros(0, self.model.lm_head.out_features, dtype=torch.float32)
        logits = self.model.logits(hidden[last_rows.long()])
        ban_eos(logits, self.eos, bans)
        return logits

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

    def synchronize(self) -> None:
        """Wait for everything queued on the device (after a launch that failed half-way)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- request state ----
    def new_generator(self, seed: int | None) -> torch.Generator:
        return new_generator(self.device, seed)
