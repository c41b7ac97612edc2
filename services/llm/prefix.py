"""The prefix cache: keys of a prompt's KV pages and of their leading parts, what the pool holds of
a prompt, and registering what a prefill computed (pure Python, no torch).

Page i's key hashes the key of page i-1 with the token ids of page i, so equal keys mean
equal prompts up to the end of that page: a request whose leading pages have keys the pool
holds can start its prefill after them. Image positions all hold the same placeholder id,
so a page that holds image positions also hashes each such image's content key (a hash of
the image bytes, the preprocessing and the vision model, made by the vision service) and
where that image starts. Two requests with the same image and the same leading text share
pages; two images of equal size never do.

A page's leading parts have keys too (`part_keys`): its first 16, 32, ... positions, and where
the prompt or an image ends inside the page. A request whose prompt leaves the cached pages
part-way through a page (another question about the same image; or the very same prompt, whose
last page is never full) copies the matching part of that page into a page of its own and
computes only the rest. A page holds 128 positions on CUDA, so without parts a repeated
prompt would recompute up to 127 of them.

A page that reads an image without a content key (its producer computes none) ends the
chain: what follows cannot be told apart from another image's.

The key of a whole prompt also keeps the prompt's greedy first token (`answered`), as long as
the pool keeps the key. A greedy repeat of the whole prompt then computes nothing before its
first decode: its first token comes at admission, without a forward (`first_token`), which
cuts a repeat's time to first token (docs/PERF.md). The token is a function of the
prompt (what the key names) and of whether min_tokens bans EOS, not of the page. A sampled
request computes its last position, and samples it with its own generator.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.llm.block_manager import BlockManager
    from services.llm.request import Request

KEY_BYTES = 16
PART = 16  # a page's leading parts are keyed every PART positions (and where the prompt or an image ends)

Images = Sequence[tuple[int, int, bytes]]  # (first position, positions, content key) of each image


def _key(prev: bytes, prompt_ids: Sequence[int], images: Images, lo: int, hi: int) -> bytes | None:
    """The key of positions [lo, hi) after the chain key `prev`; None if they read a keyless image."""
    h = hashlib.blake2b(prev, digest_size=KEY_BYTES)
    h.update(array("q", prompt_ids[lo:hi]).tobytes())
    for pos, n, key in images:
        if pos < hi and pos + n > lo:
            if not key:
                return None
            h.update(key)
            h.update(pos.to_bytes(8, "little"))
    return h.digest()


def page_keys(prompt_ids: Sequence[int], images: Images, page_size: int) -> list[bytes]:
    """One chained key per full page of the prompt, up to the first page that reads a keyless image."""
    keys: list[bytes] = []
    prev = b""
    for lo in range(0, len(prompt_ids) - page_size + 1, page_size):
        key = _key(prev, prompt_ids, images, lo, lo + page_size)
        if key is None:
            break
        keys.append(prev := key)
    return keys


def part_keys(
    prompt_ids: Sequence[int], images: Images, page_size: int, page: int, prev: bytes
) -> list[tuple[int, bytes]]:
    """(positions, key) of the leading parts of prompt page `page`, longest first: every multiple of
    PART shorter than the page and than the prompt's share of it, that share when the prompt ends
    inside the page, and the end of each image that ends inside it (so that another question about
    the same picture finds every image position cached). `prev` is the key of page - 1 (b"" for
    page 0). A part that reads a keyless image has no key, nor has any longer one."""
    lo = page * page_size
    held = min(page_size, len(prompt_ids) - lo)
    ends = {pos + n - lo for pos, n, _ in images if 0 < pos + n - lo < min(held + 1, page_size)}
    lengths = sorted(
        {*range(PART, min(held, page_size - 1) + 1, PART), *ends, *([held] if 0 < held < page_size else [])}
    )
    keys = []
    for n in lengths:
        key = _key(prev, prompt_ids, images, lo, lo + n)
        if key is None:
            break
        keys.append((n, key))
    return keys[::-1]


class PrefixCache:
    """A request's prompt against the pool's registered pages (services/llm/block_manager.py)."""

    def __init__(self, blocks: BlockManager, enabled: bool = True) -> None:
        self.blocks, self.enabled = blocks, enabled

    def lookup(self, req: Request, whole: bool = False) -> tuple[list[int], tuple[int, int] | None, int]:
        """The pool's pages of the request's leading prompt pages; (page, positions) of the longest
        cached leading part of its next page, or None; and where its prefill starts after them. At
        least one prompt position is left to compute (its logits give the first token), unless
        `whole` (its first token is known: `first_token`).

        It changes nothing but the request's own keys: a peek from another thread is safe."""
        if not self.enabled:
            return [], None, 0
        size = self.blocks.page_size
        end = req.prompt_len if whole else req.prompt_len - 1  # the positions the pool may give
        shared = self.blocks.lookup(self._keys(req)[: end // size])
        page, part = len(shared), None
        left = end - page * size
        if left >= 1 and page <= len(req.page_keys):  # else the chain ended before this page
            found = self.blocks.find(self._parts(req, page))
            part = (found[0], min(found[1], left)) if found else None
        return shared, part, page * size + (part[1] if part else 0)

    def holds_images(self, req: Request) -> bool:
        """Whether the pool holds the KV of every image position of the request's prompt now."""
        return self.lookup(req)[2] >= req.features_end

    def computed(self, req: Request) -> None:
        """Register the prompt pages a step computed, so that later prompts may share them: full
        pages as they complete, and the leading parts of its own pages once the prompt has."""
        keys = req.page_keys
        if keys is None or not req.blocks:  # preempted, or released: no pages to register
            return
        size = self.blocks.page_size
        done = min(req.computed // size, len(keys))
        for i in range(req.registered, done):
            self.blocks.register(req.blocks[i], [keys[i]])
        req.registered = max(req.registered, done)
        if req.parts_registered or req.computed < req.prompt_len:
            return
        req.parts_registered = True
        for i in range(req.cached_tokens // size, min(self.blocks.pages_for(req.prompt_len), len(keys) + 1)):
            self.blocks.register(req.blocks[i], [k for _, k in self._parts(req, i)])

    def first_token(self, req: Request) -> int | None:
        """The first token of a greedy request's whole prompt, if the pool holds its key and one."""
        key = self._whole_key(req) if self._greedy_prompt(req) else None
        return None if key is None else self.blocks.first_token(key, req.sampling.min_tokens > 0)

    def answered(self, req: Request, token: int) -> None:
        """Keep a prompt's first token with the key of the whole prompt, once `computed` registered it:
        a greedy one only (a sampled token is one draw of many)."""
        key = self._whole_key(req) if self._greedy_prompt(req) else None
        if key is not None:
            self.blocks.note_first(key, req.sampling.min_tokens > 0, token)

    def _greedy_prompt(self, req: Request) -> bool:
        """Whether the request's next token is its first, drawn greedily (and the cache is on)."""
        return self.enabled and not req.output_ids and req.sampling.greedy

    def _whole_key(self, req: Request) -> bytes | None:
        """The key of all of the prompt's positions: its last page's, when the prompt fills it, else its
        last page's part where the prompt ends; None when the chain ends before (a keyless image)."""
        keys, size = self._keys(req), self.blocks.page_size
        last = (req.prompt_len - 1) // size
        n = req.prompt_len - last * size  # the prompt's positions in its last page
        if n == size:
            return keys[last] if last < len(keys) else None
        if last > len(keys):
            return None
        parts = self._parts(req, last)
        return parts[0][1] if parts and parts[0][0] == n else None

    def _keys(self, req: Request) -> list[bytes]:
        """The request's page keys, computed once."""
        if req.page_keys is None:
            req.page_keys = page_keys(req.prompt_ids, req.images, self.blocks.page_size)
        return req.page_keys

    def _parts(self, req: Request, page: int) -> list[tuple[int, bytes]]:
        """`part_keys` of one of the request's prompt pages, kept on it: a waiting request is looked up
        at every plan, and a registration wants the keys its admission computed."""
        if page not in req.part_keys:
            prev = req.page_keys[page - 1] if page else b""
            req.part_keys[page] = part_keys(req.prompt_ids, req.images, self.blocks.page_size, page, prev)
        return req.part_keys[page]
