"""The paged KV pool's accounting: which pages are free, and how many a sequence needs.

Pure Python (no torch): the scheduler plans with it, and the model runner reads each
request's pages (`Request.blocks`, its block table) to address the pool's tensors.

A page holds `page_size` consecutive positions of one sequence, in every layer. Page 0 is
never handed out: the model runner points unused block-table entries and the padding rows
of a captured decode batch at it, so their writes land nowhere that matters.
"""

from __future__ import annotations

NULL_PAGE = 0


class BlockManager:
    def __init__(self, n_pages: int, page_size: int) -> None:
        if n_pages < 2:
            raise ValueError(f"a KV pool needs at least 2 pages (one is reserved), got {n_pages}")
        self.n_pages, self.page_size = n_pages, page_size
        # Popped from the end: low page numbers first, which keeps a lightly used pool compact.
        self._free = list(range(n_pages - 1, NULL_PAGE, -1))

    @property
    def capacity(self) -> int:
        """Pages that sequences can hold (all but the reserved one)."""
        return self.n_pages - 1

    @property
    def free(self) -> int:
        return len(self._free)

    def pages_for(self, tokens: int) -> int:
        """Pages that `tokens` positions occupy."""
        return -(-tokens // self.page_size)

    def can_allocate(self, pages: int) -> bool:
        return pages <= len(self._free)

    def allocate(self, pages: int) -> list[int]:
        """Take `pages` free pages (the caller checked `can_allocate`)."""
        if pages > len(self._free):
            raise RuntimeError(f"asked for {pages} KV pages, {len(self._free)} free")
        taken = self._free[len(self._free) - pages :]
        del self._free[len(self._free) - pages :]
        taken.reverse()
        return taken

    def release(self, pages: list[int]) -> None:
        """Give pages back (a finished, aborted or preempted sequence's)."""
        self._free.extend(reversed(pages))
