"""Keys of a prompt's KV pages, and of their leading parts, for the prefix cache (pure Python, no torch).

Page i's key hashes the key of page i-1 with the token ids of page i, so equal keys mean
equal prompts up to the end of that page: a request whose leading pages have keys the pool
holds can start its prefill after them. Image positions all hold the same placeholder id,
so a page that holds image positions also hashes each such image's content key (a hash of
the image bytes, the preprocessing and the vision model, made by the vision service) and
where that image starts. Two requests with the same image and the same leading text share
pages; two images of equal size never do.

A page's leading parts have keys too (`part_keys`): its first 16, 32, ... positions, and the
prompt's end when it falls inside the page. A request whose prompt leaves the cached pages
part-way through a page (another question about the same image; or the very same prompt, whose
last page is never full) copies the matching part of that page into a page of its own and
computes only the rest. A page holds 128 positions on CUDA, so without parts a repeated
prompt would recompute up to 127 of them.

A page that reads an image without a content key (its producer computes none) ends the
chain: what follows cannot be told apart from another image's.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

KEY_BYTES = 16
PART = 16  # a page's leading parts are keyed every PART positions (and at the prompt's end)

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
    PART shorter than the page and than the prompt's share of it, and that share when the prompt
    ends inside the page. `prev` is the key of page - 1 (b"" for page 0). A part that reads a
    keyless image has no key, nor has any longer one."""
    lo = page * page_size
    held = min(page_size, len(prompt_ids) - lo)
    lengths = list(range(PART, min(held, page_size - 1) + 1, PART))
    if 0 < held < page_size and (not lengths or lengths[-1] != held):
        lengths.append(held)
    keys = []
    for n in lengths:
        key = _key(prev, prompt_ids, images, lo, lo + n)
        if key is None:
            break
        keys.append((n, key))
    return keys[::-1]
