"""The gateway's readiness (services/gateway/readiness.py): down at once when a peer refuses, not
when it is merely slow, and after SLOW_S of silence; up again at the first answer."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services.gateway import readiness
from services.gateway.readiness import Readiness


class Failed(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=code.name)


class Peer:
    """A channel whose Health/Check answers as `self.answer` says: 'ok', 'refused' or 'slow'."""

    def __init__(self) -> None:
        self.answer = "ok"

    def unary_stream(self, *args, **kw):  # Health/Watch: not used
        return None

    def unary_unary(self, *args, **kw):
        async def check(request, **call):
            if self.answer == "refused":
                raise Failed(grpc.StatusCode.UNAVAILABLE)
            if self.answer == "slow":
                raise Failed(grpc.StatusCode.DEADLINE_EXCEEDED)
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

        return check


@pytest.fixture
def clock(monkeypatch):
    """The event loop's clock, moved by hand."""
    now = {"t": 1000.0}
    monkeypatch.setattr(asyncio.BaseEventLoop, "time", lambda self: now["t"])
    return now


def probes(vision: Peer, llm: Peer, clock: dict, steps: list[tuple[str, str, float]]) -> list[bool]:
    """Readiness after each (vision's answer, llm's answer, seconds since the last probe)."""

    async def main() -> list[bool]:
        changes: list[bool] = []

        async def changed(ready: bool) -> None:
            changes.append(ready)

        r = Readiness([SimpleNamespace(name="w", vision_channel=vision, llm_channel=llm)], changed)
        out = []
        for by_vision, by_llm, dt in steps:
            vision.answer, llm.answer = by_vision, by_llm
            clock["t"] += dt
            out.append(await r.probe_once())
        assert changes == [b for i, b in enumerate(out) if b != ([True, *out][i])]  # told of each change
        return out

    return asyncio.run(main())


def test_a_refusing_peer_takes_the_gateway_out_at_the_second_probe_and_an_answer_brings_it_back(clock):
    steps = [("ok", "ok", 0.5), ("ok", "refused", 0.5), ("ok", "refused", 0.5), ("ok", "ok", 0.5)]
    assert probes(Peer(), Peer(), clock, steps) == [True, True, False, True]


def test_a_slow_peer_stays_in_until_it_has_been_silent_for_slow_s(clock):
    silent = [("slow", "ok", 0.5)] * int(readiness.SLOW_S / 0.5 + 1)
    out = probes(Peer(), Peer(), clock, [*silent, ("ok", "ok", 0.5)])
    first_down = out.index(False)
    assert all(out[:first_down]) and first_down * 0.5 >= readiness.SLOW_S - 0.5
    assert out[-1] is True
