"""Attention over the paged KV pool: decode (one query per sequence) and prefill (chunks).

Decode has two implementations of one interface, `DecodeAttention`:
- `FlexDecode` (CUDA): `flex_attention` reads the pages in place. Its block mask is built
  from the block tables on the device: each of a sequence's pages is one block, and the mask
  keeps every offset of a page but the last, and the last's up to the query's position. Its
  buffers are allocated once for the largest batch, so a CUDA graph captures the step and
  replays it with new block tables. Each layer runs as one `torch.compile`d function around it.
  No page is marked a full block, though most are: flex's decode kernel splits a sequence's
  keys across CTAs by the count of its partial blocks, but its full blocks by the whole pool's
  length, so full blocks put a sequence's pages all on one CTA and leave most SMs idle.
- `GatherDecode` (the reference, and the CPU's): gathers each sequence's pages into a
  contiguous [b, g, L, d] and runs SDPA with a length mask. Same function, simpler.

Prefill attends per chunk with SDPA: a chunk that starts a sequence attends causally to its
own keys (no pool read); a later chunk reads its sequence's earlier positions from the pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from services.model.llama import DecoderLayer


class DecodeAttention(Protocol):
    """How a decode step reads the pool: q [b, h, d] against each sequence's pages."""

    def prepare(self, positions: torch.Tensor, tables: torch.Tensor, max_len: int) -> None:
        """Once per step, before the layers: positions [b] (int64, the query's), tables [b, max_pages].

        `max_len` bounds the positions attended (a host hint; an implementation may ignore it,
        and a captured step must not depend on it).
        """

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        """q [b, h, d], one layer's pool k/v [g, S, d] -> out [b, h, d]."""

    def run_layer(self, layer: DecoderLayer, x, cos, sin, k_pool, v_pool, slots) -> torch.Tensor:
        """One decoder layer of the step around this attention: x [b, H] -> [b, H].

        It stores the step's K/V at pool positions `slots` [b] before attending.
        """


def prefill_in(layer: DecoderLayer, x, cos, sin, k_pool, v_pool, slots):
    """A prefill layer up to its attention: x [N, H] -> q, k, v; K/V stored at pool positions `slots` [N]."""
    q, k, v = layer.attn_in(x, cos, sin)
    write_kv(k_pool, v_pool, slots, k, v)
    return q, k, v


def prefill_out(layer: DecoderLayer, x, o) -> torch.Tensor:
    """A prefill layer after its attention: x [N, H], o [N, h, d] -> [N, H]."""
    return layer.attn_out(x, o)


def decode_layer(layer: DecoderLayer, x, cos, sin, k_pool, v_pool, slots, attend, linear=F.linear) -> torch.Tensor:
    q, k, v = layer.attn_in(x, cos, sin, linear)
    write_kv(k_pool, v_pool, slots, k, v)
    return layer.attn_out(x, attend(q, k_pool, v_pool), linear)


def flex_decode_layer(layer: DecoderLayer, x, cos, sin, k_pool, v_pool, slots, mask, linear=F.linear) -> torch.Tensor:
    """`decode_layer` with flex_attention inline, for torch.compile: one graph per layer call."""
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = layer.attn_in(x, cos, sin, linear)
    write_kv(k_pool, v_pool, slots, k, v)
    return layer.attn_out(x, grouped_flex(flex_attention, q, k_pool, v_pool, mask), linear)


def grouped_flex(flex, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, mask) -> torch.Tensor:
    """One decode token's attention, q [B, Hq, D] over the pool's [Hkv, S, D] -> [B, Hq, D].

    The Hq / Hkv query heads that share a KV head ride as that head's query rows ([B, Hkv, G, D]),
    so flex runs without GQA. inductor's flex decoding kernel (which splits the pages across the
    GPU) takes GQA only for a power-of-two group, else falls back to its prefill kernel, one query
    head a program reading the pool once per head: Qwen2.5-VL-7B's 28 / 4 heads spent 41% of a
    batch-32 decode step there (H100). As rows, every group runs the decoding kernel and the
    pool is read once per KV head."""
    b, hq, d = q.shape
    o = flex(q.view(b, k_pool.shape[0], hq // k_pool.shape[0], d), k_pool[None], v_pool[None], block_mask=mask)
    return o.view(b, hq, d)


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Store k, v [N, g, d] at pool positions `slots` [N] (index_put_, in place also when compiled)."""
    k_pool[:, slots] = k.transpose(0, 1)
    v_pool[:, slots] = v.transpose(0, 1)


def page_slots(tables: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pool positions of `positions` [N] in the sequences whose block tables are `tables` [N, max_pages]."""
    page = tables.gather(1, (positions // page_size)[:, None])[:, 0]
    return page * page_size + positions % page_size


class GatherDecode:
    def __init__(self, page_size: int, heads: int, kv_heads: int, linear=F.linear) -> None:
        """`linear`: the layers' projections (F.linear's signature)."""
        self.page_size, self.gqa, self.linear = page_size, heads != kv_heads, linear
        self._slots = self._mask = None

    def prepare(self, positions: torch.Tensor, tables: torch.Tensor, max_len: int) -> None:
        pages = -(-max_len // self.page_size)
        offsets = torch.arange(self.page_size, device=tables.device)
        self._slots = (tables[:, :pages, None] * self.page_size + offsets).flatten(1)  # [b, L]
        span = torch.arange(self._slots.shape[1], device=tables.device)
        self._mask = (span[None, :] <= positions[:, None])[:, None, None, :]  # [b, 1, 1, L]

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        keys = k_pool[:, self._slots].transpose(0, 1)  # [b, g, L, d]
        values = v_pool[:, self._slots].transpose(0, 1)
        out = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=self._mask, enable_gqa=self.gqa)
        return out[:, :, 0]

    def run_layer(self, layer: DecoderLayer, x, cos, sin, k_pool, v_pool, slots) -> torch.Tensor:
        return decode_layer(layer, x, cos, sin, k_pool, v_pool, slots, self, self.linear)


class FlexDecode:
    def __init__(
        self,
        page_size: int,
        heads: int,
        kv_heads: int,
        n_pages: int,
        max_batch: int,
        device,
        fuse_layer: bool = True,
        linear=F.linear,
    ) -> None:
        """`fuse_layer`: compile each layer whole around flex (CUDA); else only flex is compiled.
        `linear`: the layers' projections (F.linear's signature; services/model/gemv.py's on CUDA).

        Inductor's CPU flex template cannot take the query as a view of the RoPE's output
        (torch 2.13), so the CPU tests of this path compile flex alone.
        """
        # Compiled once per batch bucket: static shapes (dynamic=False), and no automatic
        # dynamic recompile, whose flex kernel failed to build (CPU, torch 2.13). The same code
        # for every layer, so it compiles per bucket, not per layer; inductor fuses the norms,
        # RoPE, residuals and SiLU between the matmuls.
        self._layer = torch.compile(flex_decode_layer, dynamic=False) if fuse_layer else None
        self._flex = None  # attention alone (__call__), compiled on first use
        self.page_size, self.n_pages, self.linear = page_size, n_pages, linear
        self.group = heads // kv_heads  # query heads per KV head: the query rows flex sees (grouped_flex)
        i32 = {"dtype": torch.int32, "device": device}
        # Block-mask tensors for the largest batch; a batch of b uses rows [:b]. The index
        # rows span the whole pool, as flex requires; only their first entries are read.
        self.kv_num = torch.ones(max_batch, 1, 1, **i32)  # the sequence's pages, up to its last
        self.kv_idx = torch.zeros(max_batch, 1, 1, n_pages, **i32)
        self.last_page = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.last_offset = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self._masks: dict = {}

    def prepare(self, positions: torch.Tensor, tables: torch.Tensor, max_len: int) -> None:
        b, width = tables.shape
        last = positions // self.page_size
        self.kv_num[:b, 0, 0] = (last + 1).to(torch.int32)
        self.kv_idx[:b, 0, 0, :width] = tables.to(torch.int32)
        self.last_page[:b] = tables.gather(1, last[:, None])[:, 0]
        self.last_offset[:b] = positions % self.page_size
        if b not in self._masks:
            self._masks[b] = self._block_mask(b)

    def _block_mask(self, b: int):
        """The mask over the pool for a batch of b (made once per size, over the shared buffers)."""
        from torch.nn.attention.flex_attention import BlockMask

        page, last, offset = self.page_size, self.last_page, self.last_offset

        def up_to_position(batch, head, q_idx, kv_idx):
            return (kv_idx // page != last[batch]) | (kv_idx % page <= offset[batch])

        return BlockMask.from_kv_blocks(
            self.kv_num[:b],
            self.kv_idx[:b],
            BLOCK_SIZE=(128, page),
            mask_mod=up_to_position,
            seq_lengths=(self.group, self.n_pages * page),
            compute_q_blocks=False,
        )

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        if self._flex is None:  # eager flex would ignore the block mask's pages: compiled only
            from torch.nn.attention.flex_attention import flex_attention

            self._flex = torch.compile(flex_attention, dynamic=False)
        return grouped_flex(self._flex, q, k_pool, v_pool, self._masks[q.shape[0]])

    def run_layer(self, layer: DecoderLayer, x, cos, sin, k_pool, v_pool, slots) -> torch.Tensor:
        if self._layer is None:
            return decode_layer(layer, x, cos, sin, k_pool, v_pool, slots, self, self.linear)
        mask = self._masks[x.shape[0]]
        return self._layer(layer, x, cos, sin, k_pool, v_pool, slots, mask, self.linear)


@dataclass(frozen=True)
class Span:
    """One chunk's rows in a packed prefill: rows [row, row + length) are positions [start, start + length)."""

    row: int
    length: int
    start: int
    context: torch.Tensor | None  # pool positions of [0, start + length) when start > 0, else None


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, spans: list[Span]
) -> torch.Tensor:
    """q [N, h, d], k/v [N, g, d] (already in the pool) -> out [N, h, d], causal within each sequence."""
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    for s in spans:
        rows = slice(s.row, s.row + s.length)
        qi = q[rows].transpose(0, 1)[None]  # [1, h, T, d]
        if s.context is None:  # the sequence starts here: its own keys are all it sees
            ki, vi = k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]
            oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=gqa)
        else:  # a later chunk: earlier positions come from the pool; query i sees keys up to start + i
            ki, vi = k_pool[:, s.context][None], v_pool[:, s.context][None]
            seen = torch.arange(s.context.shape[0], device=q.device)[None, :]
            mask = seen <= torch.arange(s.start, s.start + s.length, device=q.device)[:, None]
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, enable_gqa=gqa)
        out[rows] = oi[0].transpose(0, 1)
    return out
