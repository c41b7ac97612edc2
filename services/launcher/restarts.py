"""Keep a mesh's processes running: restart a child that dies or stalls, with backoff and a limit.

`Watch.poll` is what `vlmesh up` does while it serves (`Mesh.wait`), every TICK_S: for each child,

- one that has exited is started again, on the ports it had, after a backoff (0.5 s, doubling
  up to 8 s);
- one whose health check has failed `STALL_CHECKS` times in a row is stalled (stopped or hung:
  its port takes connections and nothing answers). It is killed (SIGKILL) and started again;
  the message says how long it went unanswered, from its first failed check to the kill.

More than `restarts` restarts of the mesh within `window_s` stop it (MeshError naming the
child): a crash loop would go on forever. While a vision or llm is away the gateway keeps
serving; what it cannot route ends with UNAVAILABLE, and the internal channels' keepalive
(services/common/server.py) ends calls on a stalled peer within about 2 s.
"""

from __future__ import annotations

import logging
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.tls import sync_channel
from services.launcher.ports import MeshError

if TYPE_CHECKING:
    from services.launcher.supervisor import Child, Mesh

log = logging.getLogger(__name__)

TICK_S = 0.5
# Failed health checks in a row, TICK_S apart (each waits HEALTH_TIMEOUT_S): a stalled child.
# Lenient on purpose: a child busy on a 2-core host may answer late, and killing it would be
# worse than waiting. Calls in flight on a stalled peer end sooner, through keepalive.
STALL_CHECKS = 6
HEALTH_TIMEOUT_S = 1.0
BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)


@dataclass
class Watch:
    """One mesh's children, watched and restarted under a limit."""

    mesh: Mesh
    restarts: int  # allowed within window_s; 0: the first death stops the mesh
    window_s: float
    say: Callable[[str], None] = print
    clock: Callable[[], float] = time.monotonic
    _times: deque = field(default_factory=deque)  # when restarts happened
    _misses: dict = field(default_factory=dict)  # child name -> health checks failed in a row
    _silent_since: dict = field(default_factory=dict)  # child name -> when its first failed check was sent
    _streak: dict = field(default_factory=dict)  # child name -> restarts in a row (the backoff)

    def poll(self) -> None:
        """Look at each child once, restarting the ones in trouble; MeshError when a child is in
        trouble with no restart left."""
        for child in list(self.mesh.children):
            why = self._trouble(child)
            if why is not None:
                self._restart(child, why)

    def _trouble(self, child: Child) -> str | None:
        """Why `child` must be restarted, or None while it is well."""
        code = child.proc.poll()
        if code is not None:
            return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        asked = self.clock()
        status = health_status(self.mesh.target(child.name), HEALTH_TIMEOUT_S, self.mesh.credentials())
        if status == health_pb2.HealthCheckResponse.SERVING:
            self._misses[child.name] = 0
            self._streak[child.name] = 0
            self._silent_since.pop(child.name, None)
            return None
        since = self._silent_since.setdefault(child.name, asked)
        misses = self._misses[child.name] = self._misses.get(child.name, 0) + 1
        if misses < STALL_CHECKS:
            return None
        child.proc.kill()
        child.proc.wait()
        # The time it really went unanswered: each check waits up to HEALTH_TIMEOUT_S, and the
        # other children's checks come between, so the count of checks alone understates it.
        return f"stalled (no health answer for {self.clock() - since:.1f} s, {misses} checks in a row), killed"

    def _restart(self, child: Child, why: str) -> None:
        now = self.clock()
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) >= self.restarts:
            limit = f"{self.restarts} restarts within {self.window_s:.0f} s" if self.restarts else "--restarts 0"
            raise MeshError(f"the {child.name} process {why} (its log is above); not restarted: {limit}")
        self._times.append(now)
        streak = self._streak.get(child.name, 0)
        delay = BACKOFF_S[min(streak, len(BACKOFF_S) - 1)]
        self._streak[child.name] = streak + 1
        self._misses[child.name] = 0
        self._silent_since.pop(child.name, None)
        self.say(
            f"the {child.name} process {why}; restarting it in {delay:g} s ({len(self._times)} of {self.restarts})"
        )
        time.sleep(delay)
        started = time.monotonic()
        self.mesh.respawn(child)
        self.say(
            f"{child.name} is serving again on {self.mesh.target(child.name)} ({time.monotonic() - started:.1f} s)"
        )
        log.info("restarted %s", child.name)


def health_status(target: str, timeout: float = 1.0, creds: grpc.ChannelCredentials | None = None) -> int:
    """A server's overall status on the standard health service (UNKNOWN when it does not answer);
    `creds`: the mesh's mTLS (services/common/tls.py)."""
    try:
        with sync_channel(target, creds) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            return resp.status
    except grpc.RpcError:
        return health_pb2.HealthCheckResponse.UNKNOWN
