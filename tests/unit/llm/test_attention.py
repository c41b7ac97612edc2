"""Attention over the paged pool against a plain causal reference over contiguous K/V.

The CUDA decode path (`FlexDecode`: flex_attention with a block mask built from the block
tables) is compiled here on the CPU too, so its block mask is checked without a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.llm.attention import FlexDecode, GatherDecode, Span, page_slots, prefill_attention, write_kv

# Head dim 64: on an AVX2-only AMD EPYC host, torch 2.13's compiled CPU flex_attention gives
# wrong decode outputs at head dim 16 even for a plain create_block_mask mask (64 is right there;
# 16 passed on earlier CI hosts): a torch bug, not this block mask's. Models' head dims are 64+.
PAGE, N_PAGES, H, G, D = 8, 24, 4, 2, 64


def pool():
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(G, N_PAGES * PAGE, D, generator=gen), torch.randn(G, N_PAGES * PAGE, D, generator=gen))


def tables_for(rows: list[list[int]], width: int = 6) -> torch.Tensor:
    return torch.tensor([r + [0] * (width - len(r)) for r in rows])


def reference(q, k_pool, v_pool, table: list[int], upto: int) -> torch.Tensor:
    """q [h, d] attending to positions [0, upto] of the sequence whose pages are `table`."""
    slots = page_slots(torch.tensor([table]).expand(upto + 1, -1), torch.arange(upto + 1), PAGE)
    k, v = k_pool[:, slots], v_pool[:, slots]  # [g, L, d]
    return F.scaled_dot_product_attention(q[None, :, None], k[None], v[None], enable_gqa=True)[0, :, 0]


# Scattered pages; positions in the middle of a page, on its first and on its last offset.
ROWS = [[5, 3, 17], [1], [9, 2, 11, 4, 20], [7, 8]]
POSITIONS = [19, 0, 39, 8]


# Query heads per KV head: as Llama's MHA, a power of two, and Qwen2.5-VL-7B's 7 (28 / 4), which
# flex's GQA takes only in its prefill kernel; FlexDecode passes the group as query rows instead.
@pytest.mark.parametrize("heads", [G, H, 7 * G], ids=["mha", "group2", "group7"])
@pytest.mark.parametrize("impl", ["gather", "flex"])
def test_decode_attention_reads_exactly_each_sequences_pages(impl, heads):
    k_pool, v_pool = pool()
    q = torch.randn(len(ROWS), heads, D)
    positions, tables = torch.tensor(POSITIONS), tables_for(ROWS)
    if impl == "flex":
        attn = FlexDecode(PAGE, heads, G, N_PAGES, max_batch=8, device=torch.device("cpu"))  # compiled for the CPU
    else:
        attn = GatherDecode(PAGE, heads, G)
    attn.prepare(positions, tables, max_len=max(POSITIONS) + 1)
    out = attn(q, k_pool, v_pool)
    want = torch.stack([reference(q[i], k_pool, v_pool, ROWS[i], POSITIONS[i]) for i in range(len(ROWS))])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_prefill_chunks_match_one_causal_pass():
    """A sequence prefilled in two chunks, beside another in one, equals causal attention over each."""
    k_pool, v_pool = pool()
    gen = torch.Generator().manual_seed(1)
    lens, blocks = [13, 7], [[4, 6], [10]]
    full = [
        (torch.randn(n, H, D, generator=gen), torch.randn(n, G, D, generator=gen), torch.randn(n, G, D, generator=gen))
        for n in lens
    ]
    want = [
        F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, enable_gqa=True
        )[0].transpose(0, 1)
        for q, k, v in full
    ]

    def slots(seq: int, lo: int, hi: int) -> torch.Tensor:
        table = torch.tensor([blocks[seq]]).expand(hi - lo, -1)
        return page_slots(table, torch.arange(lo, hi), PAGE)

    # Step 1: the first 9 positions of sequence 0 and all of sequence 1, packed.
    q = torch.cat([full[0][0][:9], full[1][0]])
    k = torch.cat([full[0][1][:9], full[1][1]])
    v = torch.cat([full[0][2][:9], full[1][2]])
    write_kv(k_pool, v_pool, torch.cat([slots(0, 0, 9), slots(1, 0, 7)]), k, v)
    out = prefill_attention(q, k, v, k_pool, v_pool, [Span(0, 9, 0, None), Span(9, 7, 0, None)])
    torch.testing.assert_close(out[:9], want[0][:9], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[9:], want[1], atol=1e-5, rtol=1e-5)
    # Step 2: the rest of sequence 0, reading its first 9 positions from the pool.
    q, k, v = (t[9:] for t in full[0])
    write_kv(k_pool, v_pool, slots(0, 9, 13), k, v)
    out = prefill_attention(q, k, v, k_pool, v_pool, [Span(0, 4, 9, slots(0, 0, 13))])
    torch.testing.assert_close(out, want[0][9:], atol=1e-5, rtol=1e-5)
