"""The vision feature cache: content keys, one encode per new image, hits counted and traced.

The features live in the producer's arena slots, kept under the key once their readers
are done (services/handoff/leases.py: least recently used eviction among the slots that
nobody reads, inside `--feature-cache-mib`). This module says what the key is and makes
concurrent requests for one new image wait for a single encode.

The key hashes the image bytes with everything that shapes the features: the model id,
the preprocessing config and the encoder's dtype. Equal bytes under another config miss;
equal pixels in other bytes (another JPEG of the same picture) miss too, by design: decoding
to compare would cost what the cache saves.

Used from the server's event loop only (the single-flight table is not locked).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import torch

from services.common import metrics, telemetry
from services.handoff.producer import Producer
from services.handoff.transport import Transport
from services.handoff.wire import CONTENT_KEY_BYTES
from services.model.family import ImageProcessor
from vlmesh.v1 import common_pb2 as pb

T = TypeVar("T")

KEY_BYTES = CONTENT_KEY_BYTES


def config_salt(model_id: str, processor: ImageProcessor, dtype: torch.dtype) -> bytes:
    """What, besides the bytes, decides the features: folded into every key."""
    return repr((model_id, processor.salt(), str(dtype))).encode()


class FeatureCache:
    def __init__(self, producer: Producer, salt: bytes, enabled: bool) -> None:
        self.producer = producer
        self.enabled = enabled
        self._salt = hashlib.blake2b(salt, digest_size=KEY_BYTES).digest()
        self._encoding: dict[bytes, asyncio.Future] = {}  # keys being encoded now: followers wait

    def key(self, data: bytes, max_pixels: int = 0) -> bytes:
        """The content key of one image's bytes, read at `max_pixels` (0: the model's) (blake2b, 16 bytes)."""
        h = hashlib.blake2b(self._salt, digest_size=KEY_BYTES)
        if max_pixels:  # a picture read smaller is other features (and other positions)
            h.update(b"max_pixels=%d;" % max_pixels)
        h.update(data)
        return h.digest()

    def _lookup(self, key: bytes, transport: Transport) -> pb.TensorRef | None:
        t0 = time.perf_counter()
        ref = self.producer.lookup(key, transport)
        telemetry.record_span("vision.cache_lookup", t0, time.perf_counter(), {"cache.hit": ref is not None})
        return ref

    async def get(
        self,
        key: bytes | None,
        transport: Transport,
        encode: Callable[[], Awaitable[tuple[pb.TensorRef, T]]],
        on_wait: Callable[[], None] = lambda: None,
    ) -> tuple[pb.TensorRef, T | None]:
        """The features of one image: kept ones (and None), or `encode()`'s (and what it returned).

        `key` None: the cache is off for it; `encode` runs. A request for a key another
        request is encoding calls `on_wait()` and waits for that one, then looks again (if the
        features could not be kept, because every kept slot is being read, it encodes them itself).
        """
        if key is None:
            return await encode()
        ref = self._lookup(key, transport)
        if ref is None and key in self._encoding:
            on_wait()
            await asyncio.shield(self._encoding[key])  # ends with None, whether the encode worked or not
            ref = self._lookup(key, transport)
        if ref is not None:
            metrics.CACHE_LOOKUPS.labels("hit").inc()
            return ref, None
        metrics.CACHE_LOOKUPS.labels("miss").inc()
        done = self._encoding.setdefault(key, asyncio.get_running_loop().create_future())
        try:
            return await encode()
        finally:
            if self._encoding.get(key) is done:
                del self._encoding[key]
            if not done.done():
                done.set_result(None)
