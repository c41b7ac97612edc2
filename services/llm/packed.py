"""The packed step: a step's prefill chunks as the rows of one forward, graph-captured.

Rows: the chunks' positions in plan order, then padding up to the row bucket (`row_buckets`).
Every row first stores its K/V in the pool (padding rows in the null page), then attends
through `flex_attention` to the pool itself, with a block mask made on the host:
- per block of `Q_BLOCK` rows, the pages of the sequences those rows belong to (each page
  once, also when two sequences share it through the prefix cache);
- a mask that keeps, for row r of sequence rank[r] and pool position kv in page p:

      lo[p] <= rank[r] <= hi[p]                              (p is a page of r's sequence)
      and logical[p] * page_size + kv % page_size <= pos[r]  (at or before r's position)

  The step's sequences are ranked by their block tables, in lexicographic order. Pages are
  shared only as leading runs (the prefix cache matches a prompt's first pages), so the
  sequences that hold a page are ranks lo[p]..hi[p] with no gap, and a shared page sits at
  the same logical index in each. Three loads per key column: an earlier mask that looked
  up `tables[seq[r], logical[p]]` per score made each key block cost some 25 us on the
  H200, eight times the block's arithmetic. Pages that every row of a one-sequence block
  sees whole are full blocks: flex skips their mask.

The step's decodes do not ride in these rows: a decode's query block would list all of its
pages, and one block holding the last rows of a prompt and 16 decodes walked some 85 key
blocks in one thread block (74.7 ms a step where the decode graph after the prefill takes
6). They run in the decode step's graph after this one (services/llm/decode.py).

Every input lives at a fixed address (the runner's staging buffer, one upload per step), so
on CUDA each bucket's layers and head are captured in one CUDA graph: one replay where the
eager prefill launched some ten kernels per layer from Python and was bound by the host. The
embedding and the image features are written into the static input rows before the replay.
On the CPU the same forward runs eagerly (flex compiled alone), which is how the tests check
it against the per-chunk reference (services/llm/attention.py).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from services.common.buckets import capture_graphs
from services.llm.attention import prefill_in, prefill_out
from services.llm.decode import ban_eos
from services.llm.kv_cache import PagedKvCache, pool_slots
from services.llm.request import Request
from services.llm.scheduler import Chunk
from services.llm.staging import Staging
from services.model.llama import LlamaDecoder

log = logging.getLogger(__name__)

Q_BLOCK = 128  # query rows per block-mask block (a multiple of flex's BLOCK_M)


def row_buckets(max_rows: int) -> list[int]:
    """Captured row counts: every 128 up to 768, every 256 up to 2048, then a third more each, up to max_rows."""
    top = -(-max_rows // Q_BLOCK) * Q_BLOCK
    sizes, b = [], Q_BLOCK
    while b < top:
        sizes.append(b)
        b = b + Q_BLOCK if b < 768 else b + 256 if b < 2048 else -(-b * 4 // 3 // Q_BLOCK) * Q_BLOCK
    return [*sizes, top]


def fixed_words(max_rows: int, max_seqs: int, n_pages: int) -> int:
    """Staging words the packed step's inputs take (see `PackedStep.__init__`)."""
    rows = row_buckets(max_rows)[-1]
    blocks = rows // Q_BLOCK
    return 4 * rows + 3 * n_pages + 2 * blocks * (1 + n_pages) + 2 * max_seqs


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
        layer_in=prefill_in,  # the layer halves around the attention: compiled (dynamic rows) on CUDA
        layer_out=prefill_out,
    ) -> None:
        self.model, self.kv, self.rope, self.eos = model, kv, rope, eos
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
        self._host, dev = {}, {}
        for name, n in sizes.items():
            self._host[name], dev[name] = staging.fixed_view(at, n)
            at += n
        for name in ("kv_idx", "full_idx"):
            self._host[name] = self._host[name].reshape(blocks, self.n_pages)
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
        self._masks = {b: self._block_mask(b) for b in self.buckets}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.rows = 0  # the bucket of the rows staged for the next run
        self._ranks = np.zeros(0, dtype=np.int64)  # each staged sequence's rank (`_stage_pages`)

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _block_mask(self, rows: int):
        from torch.nn.attention.flex_attention import BlockMask

        d, page, blocks = self._dev, self.page, rows // Q_BLOCK
        rank, pos, lo, hi, logical = d["rank"], d["pos"], d["lo"], d["hi"], d["logical"]

        def own_positions(b, h, q_idx, kv_idx):
            p = kv_idx // page
            r = rank[q_idx]
            return (lo[p] <= r) & (r <= hi[p]) & (logical[p] * page + kv_idx % page <= pos[q_idx])

        def view(name, width=None):
            t = d[name][: blocks * (width or 1)]
            return t.view(1, 1, blocks, width) if width else t.view(1, 1, blocks)

        return BlockMask.from_kv_blocks(
            view("kv_num"),
            view("kv_idx", self.n_pages),
            view("full_num"),
            view("full_idx", self.n_pages),
            BLOCK_SIZE=(Q_BLOCK, page),
            mask_mod=own_positions,
            seq_lengths=(rows, self.n_pages * page),
            compute_q_blocks=False,
        )

    # ---- host side ----
    def stage(self, chunks: list[Chunk]) -> bool:
        """Write the chunks' rows, pages and block mask into the staging buffer (before its upload).

        False (nothing usable staged) when they do not fit: more rows than the largest bucket,
        or pages shared other than as the leading runs the mask assumes; the runner then runs
        the step per chunk.
        """
        h, page = self._host, self.page
        reqs = [c.req for c in chunks]
        n = sum(c.end - c.start for c in chunks)
        if n > self.buckets[-1] or len(reqs) > self.max_seqs or not self._stage_pages(reqs):
            return False
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
        seqs = np.repeat(np.arange(len(reqs)), [len(p) for p in pos])
        rows = self.bucket(n)
        h["ids"][:n], h["pos"][:n], h["rank"][:n] = ids, positions, self._ranks[seqs]
        h["slots"][:n] = np.concatenate(slots)
        h["ids"][n:rows] = 0
        h["pos"][n:rows] = 0
        h["rank"][n:rows] = -1  # in no page's range: padding attends to nothing
        h["slots"][n:rows] = np.arange(rows - n) % page  # the null page
        h["last"][: len(last)], h["last"][len(last) :] = last, 0
        h["ban"][: len(ban)], h["ban"][len(ban) :] = ban, 0
        self._stage_mask(reqs, positions, seqs, rows)
        self.rows = rows
        return True

    def _stage_pages(self, reqs: list[Request]) -> bool:
        """Rank the sequences by block table and stage each page's lo, hi and logical index."""
        h = self._host
        order = sorted(range(len(reqs)), key=lambda i: reqs[i].blocks)
        self._ranks = np.empty(len(reqs), dtype=np.int64)
        self._ranks[order] = np.arange(len(reqs))
        holders: dict[int, list[int]] = {}
        for i, r in enumerate(reqs):
            for lp, p in enumerate(r.blocks):
                holders.setdefault(p, []).append(int(self._ranks[i]))
                h["logical"][p] = lp
        for p, ranks in holders.items():
            lo, hi = min(ranks), max(ranks)
            if hi - lo + 1 != len(ranks):
                return False  # a page shared by ranks with a gap: not a leading run
            h["lo"][p], h["hi"][p] = lo, hi
        return True

    def _stage_mask(self, reqs: list[Request], positions: np.ndarray, seqs: np.ndarray, rows: int) -> None:
        h, page = self._host, self.page
        for b in range(rows // Q_BLOCK):
            lo, hi = b * Q_BLOCK, min((b + 1) * Q_BLOCK, len(positions))
            partial, full = [], []
            if lo < hi:
                block_seqs = seqs[lo:hi]
                one = hi - lo == Q_BLOCK and block_seqs[0] == block_seqs[-1]  # one sequence, no padding
                first = int(positions[lo:hi].min())
                seen: set[int] = set()
                for s in np.unique(block_seqs):
                    top = int(positions[lo:hi][block_seqs == s].max()) // page
                    for lp, p in enumerate(reqs[s].blocks[: top + 1]):
                        if p in seen:
                            continue
                        seen.add(p)
                        (full if one and (lp + 1) * page - 1 <= first else partial).append(p)
            h["kv_num"][b], h["full_num"][b] = len(partial), len(full)
            h["kv_idx"][b, : len(partial)] = partial
            h["full_idx"][b, : len(full)] = full

    # ---- device side ----
    def embed(self) -> torch.Tensor:
        """The staged rows' token embeddings, into the static input; returns it (rows [:bucket])."""
        x = self.x[: self.rows]
        torch.index_select(self.model.embed_tokens.weight, 0, self._dev["ids"][: self.rows], out=x)
        return x

    @torch.inference_mode()
    def forward(self, rows: int) -> None:
        """Input rows [:rows] -> `logits` and `greedy` of the sampled rows. Capturable: static shapes, no syncs."""
        d = self._dev
        positions, slots = d["pos"][:rows].long(), d["slots"][:rows].long()
        cos, sin = self.rope[0][positions], self.rope[1][positions]
        mask = self._masks[rows]
        x = self.x[:rows]
        for i, layer in enumerate(self.model.layers):
            k_pool, v_pool = self.kv.k[i], self.kv.v[i]
            q, _, _ = self._in(layer, x, cos, sin, k_pool, v_pool, slots)
            o = self._flex(
                q.transpose(0, 1)[None],  # [1, h, rows, d]
                k_pool[None],
                v_pool[None],
                block_mask=mask,
                enable_gqa=self.gqa,
                kernel_options=self._options,
            )
            x = self._out(layer, x, o[0].transpose(0, 1))
        self.logits.copy_(self.model.logits(x.index_select(0, d["last"].long())))
        ban_eos(self.logits, self.eos, d["ban"])
        torch.argmax(self.logits, dim=-1, out=self.greedy)

    def run(self) -> None:
        """Run the staged rows (uploaded, embedded, features written): a graph replay when captured."""
        graph = self._graphs.get(self.rows)
        if graph is None:
            self.forward(self.rows)
        else:
            graph.replay()

    def capture(self, fallback: bool = False) -> PackedStep | None:
        """Compile and capture one graph per bucket (services/common/buckets.py); returns self.

        `fallback`: if compiling or capturing fails, log it and return None (the runner then
        prefills per chunk) instead of raising. The staged inputs must be valid while
        capturing: zeros are (every page's range is rank 0, every row at position 0 of the
        null page).
        """
        try:
            self._graphs = capture_graphs(self.buckets, self.forward, "packed step, rows")
        except Exception:
            if not fallback:
                raise
            log.exception("the packed step could not be captured: prefill runs per chunk (--prefill chunks)")
            return None
        return self
