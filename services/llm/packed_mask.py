"""The packed step's block mask: which pool positions each of its rows attends to.

Made on the host, per step, into the packed step's staged inputs (services/llm/packed.py):
- per block of `Q_BLOCK` rows, the pages of the sequences those rows belong to (each page
  once, also when two sequences share it through the prefix cache);
- a mask that keeps, for row r of sequence rank[r] and pool position kv in page p:

      lo[p] <= rank[r] <= hi[p]                              (p is a page of r's sequence)
      and logical[p] * page_size + kv % page_size <= pos[r]  (at or before r's position)

The step's sequences are ranked by their block tables, in lexicographic order. Pages are
shared only as leading runs (the prefix cache matches a prompt's first pages), so the
sequences that hold a page are ranks lo[p]..hi[p] with no gap, and a shared page sits at the
same logical index in each. Three loads per key column, not a lookup of
`tables[seq[r], logical[p]]` per score, which costs a key block several times its arithmetic
(docs/PERF.md). Pages that every row of a one-sequence block sees whole
are full blocks: flex skips their mask. A row of rank -1 (padding, a decode) is in no page's
range and attends to nothing.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from services.llm.request import Request

Q_BLOCK = 128  # query rows per block-mask block (a multiple of flex's BLOCK_M)


def block_mask(dev: dict[str, torch.Tensor], rows: int, page: int, n_pages: int):
    """The flex BlockMask of `rows` rows over the staged device views (made once per row bucket)."""
    from torch.nn.attention.flex_attention import BlockMask

    blocks = rows // Q_BLOCK
    rank, pos, lo, hi, logical = dev["rank"], dev["pos"], dev["lo"], dev["hi"], dev["logical"]

    def own_positions(b, h, q_idx, kv_idx):
        p = kv_idx // page
        r = rank[q_idx]
        return (lo[p] <= r) & (r <= hi[p]) & (logical[p] * page + kv_idx % page <= pos[q_idx])

    def view(name, width=None):
        t = dev[name][: blocks * (width or 1)]
        return t.view(1, 1, blocks, width) if width else t.view(1, 1, blocks)

    return BlockMask.from_kv_blocks(
        view("kv_num"),
        view("kv_idx", n_pages),
        view("full_num"),
        view("full_idx", n_pages),
        BLOCK_SIZE=(Q_BLOCK, page),
        mask_mod=own_positions,
        seq_lengths=(rows, n_pages * page),
        compute_q_blocks=False,
    )


def stage_pages(host: dict[str, np.ndarray], reqs: list[Request]) -> np.ndarray | None:
    """Rank the sequences by block table and stage each page's lo, hi and logical index.

    Returns each sequence's rank, or None for a page shared by ranks with a gap (not a leading run).
    """
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].blocks)
    ranks = np.empty(len(reqs), dtype=np.int64)
    ranks[order] = np.arange(len(reqs))
    holders: dict[int, list[int]] = {}
    for i, r in enumerate(reqs):
        for lp, p in enumerate(r.blocks):
            holders.setdefault(p, []).append(int(ranks[i]))
            host["logical"][p] = lp
    for p, held in holders.items():
        lo, hi = min(held), max(held)
        if hi - lo + 1 != len(held):
            return None
        host["lo"][p], host["hi"][p] = lo, hi
    return ranks


def stage_blocks(
    host: dict[str, np.ndarray], reqs: list[Request], positions: np.ndarray, lengths: list[int], rows: int, page: int
) -> None:
    """Each query block's pages, partial and full, for the chunks' rows (`lengths` [chunks] of
    them, in order, at `positions`; padding after them up to `rows`).

    Plain integers, no numpy per block: a chunk's rows are consecutive and its positions
    increase, so a block's last row of each chunk gives that chunk's top page.
    """
    ends = list(itertools.accumulate(lengths))  # each chunk's end row
    n, c = ends[-1] if ends else 0, 0  # c: the chunk of the block's first row
    for b in range(rows // Q_BLOCK):
        lo, hi = b * Q_BLOCK, min((b + 1) * Q_BLOCK, n)
        partial, full = [], []
        if lo < hi:
            while ends[c] <= lo:
                c += 1
            one = hi - lo == Q_BLOCK and ends[c] >= hi  # one chunk's rows, no padding
            first = int(positions[lo])
            seen: set[int] = set()
            s = c
            while True:
                top = int(positions[min(hi, ends[s]) - 1]) // page
                for lp, p in enumerate(reqs[s].blocks[: top + 1]):
                    if p in seen:  # a prefix page another chunk of this block listed
                        continue
                    seen.add(p)
                    (full if one and (lp + 1) * page - 1 <= first else partial).append(p)
                if ends[s] >= hi:
                    break
                s += 1
        host["kv_num"][b], host["full_num"][b] = len(partial), len(full)
        host["kv_idx"][b, : len(partial)] = partial
        host["full_idx"][b, : len(full)] = full
