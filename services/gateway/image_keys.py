"""Images a worker's llm has read, by their bytes: a repeat goes to the llm without the vision.

When the llm's prefix cache holds every image position of a prompt, it needs no features. The
gateway then sends it the images' content keys alone (LlmGenerateRequest.cached_image_keys) and
saves the vision call: a gRPC round trip, the feature cache's lookup, the hand-off's import,
which are most of a cache hit's TTFT besides its prompt step (docs/PERF.md). vLLM's scheduler
likewise skips the encoder for an image whose positions its prefix cache already covers.

The gateway learns each key from the vision's answer (TensorRef.content_key, a hash of the bytes
with the vision's model and preprocessing, so the gateway need not know them), per worker. The
llm may have evicted that KV since: it then answers FAILED_PRECONDITION before any token, the
entry is forgotten and the request goes the usual way (one llm round trip more).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from services.common import metrics
from services.gateway.config import IMAGE_KEY_CACHE
from vlmesh.v1 import common_pb2 as pb

DIGEST_BYTES = 16
INLINE_HASH_BYTES = 1 << 20  # larger images are hashed off the event loop: hashing them would stall it


class ImageKeys:
    """(worker, digest of the image bytes) -> the content key its vision gave them; least recently used out."""

    def __init__(self, enabled: bool = True, capacity: int = IMAGE_KEY_CACHE) -> None:
        self.enabled, self.capacity = enabled, capacity
        self._keys: OrderedDict[tuple[str, bytes], bytes] = OrderedDict()

    async def digests(self, images: Sequence[pb.Image]) -> list[bytes] | None:
        """A digest of each image's bytes (None when off)."""
        if not self.enabled:
            return None
        out = []
        for image in images:
            if len(image.data) > INLINE_HASH_BYTES:
                out.append(await asyncio.to_thread(_digest, image.data))
            else:
                out.append(_digest(image.data))
        return out

    def get(self, worker: str, digests: list[bytes] | None) -> list[bytes] | None:
        """The content keys of every image, if the worker's llm has read them all before; else None."""
        if not digests:
            return None
        keys = [self._keys.get((worker, d)) for d in digests]
        if not all(keys):
            return None
        for d in digests:
            self._keys.move_to_end((worker, d))
        return keys  # type: ignore[return-value]

    def learn(self, worker: str, digests: list[bytes] | None, refs: Sequence[pb.TensorRef]) -> None:
        """Remember the keys the vision gave (a producer that computes none gives b"": not kept)."""
        for d, ref in zip(digests or (), refs, strict=False):
            if ref.content_key:
                self._keys[(worker, d)] = ref.content_key
                self._keys.move_to_end((worker, d))
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def forget(self, worker: str, digests: list[bytes]) -> None:
        """The llm no longer holds these images' positions (counted as a fallback)."""
        for d in digests:
            self._keys.pop((worker, d), None)
        metrics.VISION_SKIPS.labels("fallback").inc()


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()
