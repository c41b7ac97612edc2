"""The gateway's image-key memo: per worker, bounded by --image-key-cache, least recently used out."""

from __future__ import annotations

import asyncio

from services.gateway.image_keys import ImageKeys, _digest
from vlmesh.v1 import common_pb2 as pb


def learned(keys: ImageKeys, worker: str, name: bytes) -> bytes:
    digest = _digest(name)
    keys.learn(worker, [digest], [pb.TensorRef(content_key=b"key-" + name)])
    return digest


def test_the_memo_keeps_at_most_its_capacity_and_drops_the_least_recently_used():
    keys = ImageKeys(capacity=2)
    a, b = learned(keys, "w", b"a"), learned(keys, "w", b"b")
    assert keys.get("w", [a]) == [b"key-a"]  # a is now the most recently used
    c = learned(keys, "w", b"c")
    assert keys.get("w", [b]) is None  # b went, not a
    assert keys.get("w", [a, c]) == [b"key-a", b"key-c"]
    assert keys.get("other worker", [a]) is None  # a key is its worker's vision's


def test_off_it_digests_nothing_and_finds_nothing():
    keys = ImageKeys(enabled=False)
    assert asyncio.run(keys.digests([pb.Image(data=b"x")])) is None
    assert keys.get("w", None) is None
