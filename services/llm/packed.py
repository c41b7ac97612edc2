"""The packed step: a step's prefill chunks as the rows of one forward, graph-captured.

Rows: the chunks' positions in plan order, then padding up to the row bucket (`row_buckets`).
Every row first stores its K/V in the pool (padding rows in the null page), then attends
through `flex_attention` to the pool itself, with a block mask made on the host
(services/llm/packed_mask.py). A step whose one chunk starts its sequence (a fresh prompt, the
common step under W1 load) attends instead with SDPA, causal over the step's own keys: its rows
see nothing in the pool, and row i sees rows 0..i of the bucket, which are its positions 0..i
(the padding and decode rows after the prompt see garbage that nothing reads). SDPA is faster
than flex there, and the step stages no block mask (docs/PERF.md). Each row bucket has a
graph of each kind.

The step's decodes ride in the last rows of the bucket (`decode_rows` of them, padding
included): their tokens go through every matmul with the prompts' rows, so the weights are read
once a step, not once for the prefill and again for a decode step after it (docs/PERF.md).
Their attention is not the prefill's: a decode's query block would list all of its pages, so a
block holding a prompt's last rows and the decodes would walk all their key blocks in one
thread block. They attend through the decode step's own attention (services/llm/attention.py,
`DecodeAttention`: flex's paged decode kernel on CUDA) over the decode step's static inputs,
and their rows of the prefill attention (rank -1: no pages) are overwritten with it. A step
whose decodes do not fit (more than the largest `decode_rows`, or past the top row bucket; the
runner sizes the top bucket for a full prefill budget and a full batch) runs them in the decode
step's graph after this one (services/llm/decode.py).

Every input lives at a fixed address (the runner's staging buffer, one upload per step), so
on CUDA each bucket's layers and head are captured in one CUDA graph: one replay where an
eager prefill launches many kernels per layer from Python and is bound by the host. The
embedding and the image features are written into the static input rows before the replay.
On the CPU the same forward runs eagerly (flex compiled alone), which is how the tests check
it against the per-chunk reference (services/llm/attention.py).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from services.common.buckets import capture_graphs
from services.llm.attention import prefill_in, prefill_out
from services.llm.decode import DecodeStep, ban_eos
from services.llm.kv_cache import PagedKvCache, pool_slot, pool_slots
from services.llm.packed_mask import Q_BLOCK, block_mask, stage_blocks, stage_pages
from services.llm.request import Request
from services.llm.scheduler import Chunk
from services.llm.transfers import Staging
from services.model.llama import LlamaDecoder, rope_rows

log = logging.getLogger(__name__)


def row_buckets(max_rows: int) -> list[int]:
    """Captured row counts: every 128 up to 768, every 256 up to 2048, then a third more each, up to max_rows."""
    top = -(-max_rows // Q_BLOCK) * Q_BLOCK
    sizes, b = [], Q_BLOCK
    while b < top:
        sizes.append(b)
        b = b + Q_BLOCK if b < 768 else b + 256 if b < 2048 else -(-b * 4 // 3 // Q_BLOCK) * Q_BLOCK
    return [*sizes, top]


def decode_row_sizes(max_seqs: int) -> list[int]:
    """Decode rows a step carries (padding included), each a captured variant of every row bucket.

    Few sizes, as each compiles the decode attention for its shape. 16 as well as 8 and 32: the
    riding decodes' attention runs over every padding row too, so a dozen decodes padded to 32
    make a slower step than padded to 16 (docs/PERF.md).
    """
    return sorted({min(s, max_seqs) for s in (8, 16, max_seqs)})


def fixed_words(max_rows: int, max_seqs: int, n_pages: int, mrope: bool = False) -> int:
    """Staging words the packed step's inputs take (see `PackedStep.__init__`)."""
    rows = row_buckets(max_rows)[-1]
    blocks = rows // Q_BLOCK
    return (4 + 3 * mrope) * rows + 3 * n_pages + 2 * blocks * (1 + n_pages) + 2 * max_seqs


class PackedStep:
    def __init__(
        self,
        model: LlamaDecoder,
        kv: PagedKvCache,
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [max_context, d]
        staging: Staging,
        at: int,  # where its inputs start in the staging buffer's fixed front (`fixed_words` long)
        eos: torch.Tensor | None,
        max_rows: int,
        max_seqs: int,
        decode: DecodeStep | None = None,  # whose attention and inputs the decodes riding in the rows use
        layer_in=prefill_in,  # the layer halves around the attention: compiled (dynamic rows) on CUDA
        layer_out=prefill_out,
        mrope: torch.Tensor | None = None,  # M-RoPE's channel columns (services/model/mrope.py); None: plain
    ) -> None:
        self.model, self.kv, self.rope, self.eos, self.mrope = model, kv, rope, eos, mrope
        self.page, self.n_pages, self.max_seqs = kv.page_size, kv.n_pages, max_seqs
        self.buckets = row_buckets(max_rows)
        rows, s, blocks = self.buckets[-1], max_seqs, self.buckets[-1] // Q_BLOCK
        sizes = {
            "ids": rows,
            "pos": rows,
            "slots": rows,
            "rank": rows,  # each row's sequence's rank (see the module's docstring); padding: -1, in no page
            "lo": self.n_pages,  # the ranks that hold each page: lo..hi
            "hi": self.n_pages,
            "logical": self.n_pages,  # each page's index in the tables that hold it
            "kv_num": blocks,
            "kv_idx": blocks * self.n_pages,
            "full_num": blocks,
            "full_idx": blocks * self.n_pages,
            "last": s,  # the rows whose logits are sampled
            "ban": s,
        }
        if mrope is not None:
            sizes["rope"] = rows * 3  # each row's (t, h, w) rotary position
        self._host, dev = {}, {}
        for name, n in sizes.items():
            self._host[name], dev[name] = staging.fixed_view(at, n)
            at += n
        for name in ("kv_idx", "full_idx"):
            self._host[name] = self._host[name].reshape(blocks, self.n_pages)
        if mrope is not None:
            self._host["rope"], dev["rope"] = self._host["rope"].reshape(rows, 3), dev["rope"].view(rows, 3)
        self._dev = dev
        device = kv.k[0].device
        self.x = torch.zeros(rows, model.embed_tokens.embedding_dim, device=device, dtype=kv.k[0].dtype)
        self.logits = torch.zeros(s, model.lm_head.out_features, device=device)
        self.greedy = torch.zeros(s, dtype=torch.int64, device=device)
        self._in, self._out = layer_in, layer_out
        from torch.nn.attention.flex_attention import flex_attention

        # Static shapes: one compile per bucket. Pages smaller than flex's default key block
        # need a key block of their size.
        self._options = None if self.page % 64 == 0 else {"BLOCK_N": self.page}
        self._flex = torch.compile(flex_attention, dynamic=False)
        self.gqa = model.layers[0].self_attn.h != model.layers[0].self_attn.g
        self._masks = {b: block_mask(dev, b, self.page, self.n_pages) for b in self.buckets}
        self.decode = decode
        self.decode_sizes = decode_row_sizes(max_seqs) if decode is not None else []
        self._graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}  # (rows, decode rows, fresh)
        self.rows = 0  # the bucket of the rows staged for the next run
        self.decode_rows = 0  # of them, the last ones that are the decodes' (0: the decodes run apart)
        self.fresh = False  # the staged rows are one fresh prompt's: SDPA over their own keys, no mask
        self.fresh_sdpa = True  # take that path where it applies (off: flex for every step)
        self._decode_len = 0  # the decodes' longest context (a host hint for the CPU's attention)

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    # ---- host side ----
    def stage(self, chunks: list[Chunk], decodes: list[Request] = ()) -> bool:
        """Write the chunks' rows, pages and block mask into the staging buffer (before its upload).

        The decodes ride in the rows too when they fit (`decode_rows` > 0 after it); the runner
        stages their decode inputs, padded to `decode_rows`, in the same step. False (nothing
        usable staged) when the chunks do not fit: more rows than the largest bucket, or pages
        shared other than as the leading runs the mask assumes; the runner then runs the step
        per chunk.
        """
        h, page = self._host, self.page
        reqs = [c.req for c in chunks]
        n = sum(c.end - c.start for c in chunks)
        if n > self.buckets[-1] or len(reqs) > self.max_seqs:
            return False
        fresh = self.fresh_sdpa and len(chunks) == 1 and chunks[0].start == 0
        ranks = None if fresh else stage_pages(h, reqs)
        if ranks is None and not fresh:
            return False
        d = next((s for s in self.decode_sizes if s >= len(decodes)), 0) if decodes else 0
        if n + d > self.buckets[-1]:
            d = 0
        ids, pos, slots, last, ban = [], [], [], [], []
        for c in chunks:
            r = c.req
            tokens = r.prompt_ids + r.output_ids if r.output_ids else r.prompt_ids
            ids.extend(tokens[c.start : c.end])
            pos.append(np.arange(c.start, c.end))
            slots.append(pool_slots(r.blocks, pos[-1], page))
            if c.completes:
                last.append(len(ids) - 1)
                ban.append(len(r.output_ids) < r.sampling.min_tokens)
        positions = np.concatenate(pos)
        rows = self.bucket(n + d)
        h["ids"][:n], h["pos"][:n] = ids, positions
        if self.mrope is not None:
            h["rope"][:n] = np.concatenate([c.req.rope_positions(c.start, c.end) for c in chunks])
            h["rope"][n:rows] = 0
        h["rank"][:n] = 0 if fresh else ranks[np.repeat(np.arange(len(reqs)), [len(p) for p in pos])]
        h["slots"][:n] = np.concatenate(slots)
        h["ids"][n:rows] = 0
        h["pos"][n:rows] = 0
        h["rank"][n:rows] = -1  # in no page's range: padding (and the decodes) attend to no page here
        h["slots"][n:rows] = np.arange(rows - n) % page  # the null page
        if d:
            first = rows - d
            at = first + np.arange(len(decodes))
            h["ids"][at] = [0 if r.unseen else r.token_at(r.computed) for r in decodes]  # unseen: fed on the device
            h["pos"][at] = [r.computed for r in decodes]
            if self.mrope is not None:
                h["rope"][at] = np.array([r.computed + r.rope_delta for r in decodes])[:, None]
            h["slots"][at] = [pool_slot(r.blocks, r.computed, page) for r in decodes]
            last.extend(at.tolist())
            ban.extend(r.generated < r.sampling.min_tokens for r in decodes)
            self._decode_len = max(r.computed for r in decodes) + 1
        h["last"][: len(last)], h["last"][len(last) :] = last, 0
        h["ban"][: len(ban)], h["ban"][len(ban) :] = ban, 0
        if not fresh:
            stage_blocks(h, reqs, positions, [len(p) for p in pos], rows, page)
        self.rows, self.decode_rows, self.fresh = rows, d, fresh
        return True

    # ---- device side ----
    def decode_ids(self) -> torch.Tensor:
        """The device inputs' token ids of the staged step's decode rows (valid after the upload)."""
        return self._dev["ids"][self.rows - self.decode_rows : self.rows]

    def embed(self) -> torch.Tensor:
        """The staged rows' token embeddings, into the static input; returns it (rows [:bucket])."""
        x = self.x[: self.rows]
        torch.index_select(self.model.embed_tokens.weight, 0, self._dev["ids"][: self.rows], out=x)
        return x

    @torch.inference_mode()
    def forward(self, size: tuple[int, int, bool]) -> None:
        """Input rows [:rows], the last `decodes` of them the decodes' -> `logits` and `greedy` of the
        sampled rows. Capturable: static shapes, no syncs."""
        rows, decodes, fresh = size
        d = self._dev
        positions, slots = d["pos"][:rows].long(), d["slots"][:rows].long()
        rotary = positions if self.mrope is None else d["rope"][:rows].long()
        cos, sin = rope_rows(self.rope, rotary, self.mrope)
        mask = self._masks[rows]
        if decodes:  # the decode step's inputs, staged by the runner for these rows
            attn, first = self.decode.attn, rows - decodes
            attn.prepare(self.decode.positions[:decodes].long(), self.decode.tables[:decodes].long(), self._decode_len)
        x = self.x[:rows]
        for i, layer in enumerate(self.model.layers):
            k_pool, v_pool = self.kv.k[i], self.kv.v[i]
            q, k, v = self._in(layer, x, cos, sin, k_pool, v_pool, slots)
            if fresh:  # one prompt from position 0: causal over the rows themselves
                t = [a.transpose(0, 1)[None] for a in (q, k, v)]  # [1, heads, rows, d]
                o = F.scaled_dot_product_attention(*t, is_causal=True, enable_gqa=self.gqa)[0].transpose(0, 1)
            else:  # q [1, h, rows, d] over the pool, as the block mask says -> [rows, h, d]
                qt = q.transpose(0, 1)[None]
                o = self._flex(
                    qt, k_pool[None], v_pool[None], block_mask=mask, enable_gqa=self.gqa, kernel_options=self._options
                )
                o = o[0].transpose(0, 1)
            if decodes:
                o[first:] = attn(q[first:], k_pool, v_pool)
            x = self._out(layer, x, o)
        self.logits.copy_(self.model.logits(x.index_select(0, d["last"].long())))
        ban_eos(self.logits, self.eos, d["ban"])
        torch.argmax(self.logits, dim=-1, out=self.greedy)

    def run(self) -> None:
        """Run the staged rows (uploaded, embedded, features written): a graph replay when captured."""
        size = (self.rows, self.decode_rows, self.fresh)
        graph = self._graphs.get(size)
        if graph is None:
            self.forward(size)
        else:
            graph.replay()

    def capture(self, fallback: bool = False, stream: torch.cuda.Stream | None = None) -> PackedStep | None:
        """Compile and capture graphs per row bucket and decode rows, flex's and a fresh prompt's
        (services/common/buckets.py), on `stream` when given (the prefill lane's SMs); returns self.

        `fallback`: if compiling or capturing flex's fails, log it and return None (the runner
        then prefills per chunk) instead of raising. If only the fresh prompts' graphs fail, flex
        serves every step (logged). The staged inputs must be valid while capturing: zeros are
        (every page's range is rank 0, every row at position 0 of the null page).
        """
        sizes = [(r, d) for r in self.buckets for d in (0, *self.decode_sizes) if d < r]
        try:
            self._graphs = capture_graphs(
                [(*s, False) for s in sizes], self.forward, "packed step, (rows, decodes, -)", stream
            )
        except Exception:
            if not fallback:
                raise
            log.exception("the packed step could not be captured: prefill runs per chunk (--prefill chunks)")
            return None
        if self.fresh_sdpa:
            try:
                fresh = capture_graphs(
                    [(*s, True) for s in sizes], self.forward, "packed step, (rows, decodes, fresh)", stream
                )
                self._graphs.update(fresh)
            except Exception:
                log.exception("a fresh prompt's packed step (SDPA) could not be captured: flex serves every prefill")
                self.fresh_sdpa = False
        return self
