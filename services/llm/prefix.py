"""Keys of a prompt's full KV pages, for the prefix cache (pure Python, no torch).

Page i's key hashes the key of page i-1 with the token ids of page i, so equal keys mean
equal prompts up to the end of that page: a request whose leading pages have keys the pool
holds can start its prefill after them. Image positions all hold the same placeholder id,
so a page that holds image positions also hashes each such image's content key (a hash of
the image bytes, the preprocessing and the vision model, made by the vision service) and
where that image starts. Two requests with the same image and the same leading text share
pages; two images of equal size never do.

A page that reads an image without a content key (its producer computes none) ends the
chain: what follows cannot be told apart from another image's.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

KEY_BYTES = 16


def page_keys(prompt_ids: Sequence[int], images: Sequence[tuple[int, int, bytes]], page_size: int) -> list[bytes]:
    """One chained key per full page of the prompt; `images` are (first position, positions, content key)."""
    keys: list[bytes] = []
    prev = b""
    for lo in range(0, len(prompt_ids) - page_size + 1, page_size):
        hi = lo + page_size
        h = hashlib.blake2b(prev, digest_size=KEY_BYTES)
        h.update(array("q", prompt_ids[lo:hi]).tobytes())
        for pos, n, key in images:
            if pos < hi and pos + n > lo:
                if not key:
                    return keys
                h.update(key)
                h.update(pos.to_bytes(8, "little"))
        prev = h.digest()
        keys.append(prev)
    return keys
