"""The asyncio event loop every server and the benchmark client run on.

uvloop (libuv) when it is installed, asyncio's own loop otherwise. grpc.aio runs on
either; uvloop cuts the mesh's own time outside its stages (docs/PERF.md).
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Coroutine
from typing import Any, TypeVar

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
