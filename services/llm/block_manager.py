"""The paged KV pool's accounting: which pages are free, which are shared, which are cached.

Pure Python (no torch): the scheduler plans with it, and the model runner reads each
request's pages (`Request.blocks`, its block table) to address the pool's tensors.

A page holds `page_size` consecutive positions of one sequence, in every layer. Page 0 is
never handed out: the model runner points unused block-table entries and the padding rows
of a captured decode batch at it, so their writes land nowhere that matters.

Prefix caching: a full prompt page, once computed, is registered under its key, and a
prompt page (full or the prompt's last) under the keys of its leading parts
(services/llm/prefix.py). Pages are reference counted; a later request whose leading keys
match shares those pages (read only: it starts its prefill after them), and one whose prompt
matches part of a page copies that part into a page of its own. A registered page that
nobody holds stays cached, and counts as free: `allocate` takes truly free pages first, then
evicts cached ones (with all their keys), least recently released first.

The key of a whole prompt (its last page's, or the part where it ends) may also hold that
prompt's greedy first token (`note_first`), which goes with the key: a repeat of the prompt
needs no forward before its first decode (services/llm/prefix.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

NULL_PAGE = 0


class BlockManager:
    def __init__(self, n_pages: int, page_size: int) -> None:
        if n_pages < 2:
            raise ValueError(f"a KV pool needs at least 2 pages (one is reserved), got {n_pages}")
        self.n_pages, self.page_size = n_pages, page_size
        # Popped from the end: low page numbers first, which keeps a lightly used pool compact.
        self._free = list(range(n_pages - 1, NULL_PAGE, -1))
        self._refs = [0] * n_pages
        self._page_of: dict[bytes, int] = {}  # key (a page's, or a part's) -> the page that holds it
        self._keys_of: dict[int, list[bytes]] = {}  # page -> the keys it holds
        self._cached: OrderedDict[int, None] = OrderedDict()  # registered, held by nobody; LRU first
        # A whole prompt's key -> its greedy first token, by whether EOS was banned (min_tokens > 0).
        self._first: dict[bytes, dict[bool, int]] = {}
        self.evictions = 0

    @property
    def capacity(self) -> int:
        """Pages that sequences can hold (all but the reserved one)."""
        return self.n_pages - 1

    @property
    def free(self) -> int:
        """Pages a request can be given: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._cached)

    @property
    def cached(self) -> int:
        """Pages registered under a key (held or not)."""
        return len(self._keys_of)

    def pages_for(self, tokens: int) -> int:
        """Pages that `tokens` positions occupy."""
        return -(-tokens // self.page_size)

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The pages of the longest leading run of `keys` the pool holds (nothing changes)."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def find(self, keys: Sequence[tuple[int, bytes]]) -> tuple[int, int] | None:
        """(page, positions) of the first of these part keys (longest first) the pool holds, or None."""
        for n, key in keys:
            page = self._page_of.get(key)
            if page is not None:
                return page, n
        return None

    def can_allocate(self, pages: int, sharing: Sequence[int] = ()) -> bool:
        """Whether `pages` new pages fit once the cached pages of `sharing` are taken out of the free count."""
        unheld = sum(1 for p in sharing if self._refs[p] == 0)
        return pages <= self.free - unheld

    def share(self, pages: Sequence[int]) -> None:
        """Hold cached pages (from `lookup`) for one more sequence."""
        for p in pages:
            if self._refs[p] == 0:
                del self._cached[p]
            self._refs[p] += 1

    def allocate(self, pages: int) -> list[int]:
        """Take `pages` pages (the caller checked `can_allocate`): free ones, then the oldest cached."""
        if pages > self.free:
            raise RuntimeError(f"asked for {pages} KV pages, {self.free} free")
        n = min(pages, len(self._free))
        taken = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        taken.reverse()
        while len(taken) < pages:
            page, _ = self._cached.popitem(last=False)
            for key in self._keys_of.pop(page):
                del self._page_of[key]
                self._first.pop(key, None)
            self.evictions += 1
            taken.append(page)
        for p in taken:
            self._refs[p] = 1
        return taken

    def register(self, page: int, keys: Sequence[bytes]) -> None:
        """A held page now holds what `keys` name (a computed prompt page, leading parts of one):
        later requests may share or copy it.

        A key another page holds already stays with that page (two requests computed the same
        prefix at once); a page that holds no key stays private and is freed as usual.
        """
        for key in keys:
            if key not in self._page_of:
                self._page_of[key] = page
                self._keys_of.setdefault(page, []).append(key)

    def note_first(self, key: bytes, eos_banned: bool, token: int) -> None:
        """The greedy first token of the whole prompt that `key` names, if the pool holds the key (the
        first one noted stays: a step's batch may move a near tie)."""
        if key in self._page_of:
            self._first.setdefault(key, {}).setdefault(eos_banned, token)

    def first_token(self, key: bytes, eos_banned: bool) -> int | None:
        """What `note_first` noted for this key and EOS ban, or None."""
        first = self._first.get(key)
        return None if first is None else first.get(eos_banned)

    def release(self, pages: Sequence[int]) -> None:
        """Drop one holder of each page (a finished, aborted or preempted sequence's)."""
        for p in reversed(pages):
            self._refs[p] -= 1
            if self._refs[p] > 0:
                continue
            if p in self._keys_of:
                self._cached[p] = None  # most recently released last
            else:
                self._free.append(p)
