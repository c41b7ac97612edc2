"""Whether this gateway can serve: its readiness, probed from its workers' health.

A gateway whose llm or vision is gone still answers its own health checks, so a router in front
(Envoy, Istio, a Kubernetes readiness probe) would keep sending it requests that can only fail.
The gateway therefore asks each worker's vision and llm for their health every `INTERVAL_S`, on
the channels its calls use, and is ready while at least one worker answers SERVING on both. It
reports that as the status of its own service name (`vlmesh.v1.Gateway`) on the standard health
service, and on the HTTP door's /health. The overall status (service "") stays SERVING while the
process serves: that is liveness, which the launcher watches; readiness is what routers read.

A worker is down after `MISSES` refused probes in a row (a dead peer refuses at once, and so, once
the channel's keepalive gives up on it within about 2 s, does a stalled one), or after `SLOW_S` of
probes that all timed out (a peer whose process runs but does not answer): a peer that is merely
slow on a busy host is not taken out. It is up again at its first answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import metrics
from services.gateway.workers import Worker

log = logging.getLogger(__name__)

INTERVAL_S = 0.5
TIMEOUT_S = 1.0
MISSES = 2
SLOW_S = 5.0
SERVING = health_pb2.HealthCheckResponse.SERVING
OK, TIMED_OUT, REFUSED = 0, 1, 2


async def _answer(stub: health_pb2_grpc.HealthStub) -> int:
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT_S)
    except grpc.RpcError as err:
        return TIMED_OUT if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED else REFUSED
    return OK if reply.status == SERVING else REFUSED


class Readiness:
    """Probes the workers and reports, through `on_change(ready)`, whether one of them can serve."""

    def __init__(self, workers: Sequence[Worker], on_change: Callable[[bool], Awaitable[None]] | None = None) -> None:
        self._probes = [
            (w.name, health_pb2_grpc.HealthStub(w.vision_channel), health_pb2_grpc.HealthStub(w.llm_channel))
            for w in workers
        ]
        self._misses = {w.name: 0 for w in workers}  # refused probes in a row
        self._silent_since: dict[str, float] = {}  # since when every probe of the worker timed out
        self._down_logged: dict[str, bool] = {}
        self.on_change = on_change  # e.g. the gRPC server's readiness (set once it has started)
        self.ready = True  # until a probe says otherwise: `vlmesh up` starts the gateway after its peers
        self._task: asyncio.Task | None = None
        metrics.GATEWAY_READY.set(1)

    async def probe_once(self) -> bool:
        """Ask every worker once; update and return readiness."""
        results = await asyncio.gather(*(self._probe(name, vision, llm) for name, vision, llm in self._probes))
        ready = any(results)
        if ready != self.ready:
            self.ready = ready
            metrics.GATEWAY_READY.set(int(ready))
            if ready:
                log.warning("ready again: a worker's vision and llm answer their health checks")
            else:
                log.warning("not ready: no worker has both its vision and its llm answering (routers stop sending)")
            if self.on_change is not None:
                await self.on_change(ready)
        return ready

    async def _probe(self, name: str, vision: health_pb2_grpc.HealthStub, llm: health_pb2_grpc.HealthStub) -> bool:
        answers = dict(zip(("vision", "llm"), await asyncio.gather(_answer(vision), _answer(llm)), strict=True))
        if all(a == OK for a in answers.values()):
            self._misses[name] = 0
            self._silent_since.pop(name, None)
            self._down_logged[name] = False
            return True
        now = asyncio.get_running_loop().time()
        if REFUSED in answers.values():
            self._misses[name] += 1
            self._silent_since.pop(name, None)
        else:
            self._silent_since.setdefault(name, now)
        silent = now - self._silent_since.get(name, now)
        down = self._misses[name] >= MISSES or silent >= SLOW_S
        if down and not self._down_logged.get(name):
            peers = " and ".join(peer for peer, a in answers.items() if a != OK)
            log.warning("worker %s: its %s does not answer its health checks", name, peers)
        self._down_logged[name] = down
        return not down

    def start(self) -> None:
        """Probe every INTERVAL_S until `stop`."""
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            started = asyncio.get_running_loop().time()
            await self.probe_once()
            await asyncio.sleep(max(0.0, INTERVAL_S - (asyncio.get_running_loop().time() - started)))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
