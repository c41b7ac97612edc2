"""The servers' event loop choice."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from services.common import eventloop


async def loop_class() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_asyncio_is_asyncio():
    assert eventloop.resolve("asyncio") == "asyncio"
    assert eventloop.run(loop_class(), "asyncio").startswith("asyncio")


@pytest.mark.skipif(importlib.util.find_spec("uvloop") is None, reason="uvloop not installed")
def test_auto_takes_uvloop_when_installed():
    assert eventloop.resolve("auto") == "uvloop"
    assert eventloop.run(loop_class(), "auto").startswith("uvloop")


def test_unknown_loop_is_refused():
    with pytest.raises(ValueError, match="--event-loop 'trio'"):
        eventloop.resolve("trio")
