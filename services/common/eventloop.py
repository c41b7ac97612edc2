"""The asyncio event loop every server and the benchmark client run on.

uvloop (libuv) when it is installed, asyncio's own loop otherwise. grpc.aio runs on
either. On the 2-core CPU host uvloop cut a bare grpc.aio chain of the mesh's shape
(client -> gateway -> vision unary, then a relayed 16-message llm stream) from 6.4-7.4
to 5.3-6.0 ms p50, and the mesh's own time outside its stages by about 0.4 ms
(docs/PERF.md).
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

EVENT_LOOPS = ("auto", "uvloop", "asyncio")
T = TypeVar("T")


def resolve(kind: str) -> str:
    """The loop `kind` means on this host; ValueError for uvloop asked for but missing."""
    if kind not in EVENT_LOOPS:
        raise ValueError(f"--event-loop {kind!r}: use one of {', '.join(EVENT_LOOPS)}")
    has_uvloop = importlib.util.find_spec("uvloop") is not None
    if kind == "uvloop" and not has_uvloop:
        raise ValueError("--event-loop uvloop: uvloop is not installed (pip install uvloop)")
    if kind == "auto":
        return "uvloop" if has_uvloop else "asyncio"
    return kind


def run(main: Coroutine[Any, Any, T], kind: str = "auto") -> T:
    """asyncio.run on the chosen loop."""
    if resolve(kind) == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
