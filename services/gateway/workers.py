"""The gateway's workers (a vision and the llm beside it), each behind a circuit breaker.

`--vision-target V1,V2 --llm-target L1,L2` give worker i the i-th of each: a request's vision
and llm calls both go to one worker, since its features are handed over inside that worker
(CUDA IPC, shared memory). `vlmesh up` runs one worker per gateway.

A request goes to the worker with the fewest requests in flight among those whose breaker lets
it, ties taken in turn. A breaker opens after `failures` calls in a row failed for the
worker's sake (UNAVAILABLE: down or stalled; INTERNAL, UNKNOWN: broken), not for the caller's
(invalid input, overload, the caller's own deadline or cancel). Open, it takes no request for
its cool-down (`cooldown_s`, doubled after each failed probe, up to 4 times it); then it is
half-open and takes one request as the probe: an answer closes it (the worker is back), a
failure opens it again. With every breaker open the request is refused UNAVAILABLE, with the
time until the next probe. A gateway of one worker has nowhere else to send requests: its
breaker never opens (a restarting worker answers as soon as it is back). Each change is logged
and is `vlmesh_worker_circuit{worker}` (0 closed, 1 half-open, 2 open).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import grpc

from services.common import metrics
from services.common.errors import Unavailable
from services.common.tls import aio_channel
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import llm_pb2_grpc, vision_pb2_grpc

log = logging.getLogger(__name__)

CLOSED, HALF_OPEN, OPEN = 0, 1, 2
STATE_NAMES = {CLOSED: "closed", HALF_OPEN: "half-open", OPEN: "open"}
# Failures for the worker's sake; the rest (bad input, overload, the caller's deadline) are the caller's.
WORKER_FAULTS = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
MAX_BACKOFF = 4


class Breaker:
    """Closed -> open after `failures` in a row -> half-open after the cool-down -> one probe."""

    def __init__(self, name: str, failures: int, cooldown_s: float, clock=time.monotonic) -> None:
        self.name, self.failures, self.cooldown_s, self._clock = name, failures, cooldown_s, clock
        self.state, self.in_a_row, self.opened_at, self.backoff = CLOSED, 0, 0.0, 1
        self.probing = False
        metrics.WORKER_CIRCUIT.labels(name).set(CLOSED)

    def wait_s(self) -> float:
        """Seconds until an open breaker's next probe (0 when it takes requests now)."""
        if self.state != OPEN:
            return 0.0
        return max(0.0, self.opened_at + self.cooldown_s * self.backoff - self._clock())

    def allows(self) -> bool:
        """Whether a request may go to the worker now (half-open: one probe at a time)."""
        if self.state == OPEN and self.wait_s() == 0:
            self._set(HALF_OPEN, "cool-down over: the next request probes it")
        if self.state == HALF_OPEN:
            return not self.probing
        return self.state == CLOSED

    def started(self) -> None:
        """A request was sent (a half-open breaker's one probe)."""
        if self.state == HALF_OPEN:
            self.probing = True

    def record(self, ok: bool) -> None:
        if ok:
            self.in_a_row, self.backoff = 0, 1
            if self.state != CLOSED:
                self._set(CLOSED, "the probe was answered: readmitted")
        else:
            self.in_a_row += 1
            if self.state == HALF_OPEN:
                self.backoff = min(MAX_BACKOFF, self.backoff * 2)
                self._open("the probe failed")
            elif self.state == CLOSED and self.in_a_row >= self.failures:
                self._open(f"{self.in_a_row} calls in a row failed")
        self.probing = False

    def _open(self, why: str) -> None:
        self.opened_at = self._clock()
        self._set(OPEN, f"{why}; no requests for {self.cooldown_s * self.backoff:g} s")

    def _set(self, state: int, why: str) -> None:
        self.state = state
        metrics.WORKER_CIRCUIT.labels(self.name).set(state)
        log.warning("worker %s: circuit %s (%s)", self.name, STATE_NAMES[state], why)


@dataclass
class Worker:
    name: str  # its llm's address
    vision_channel: grpc.aio.Channel
    llm_channel: grpc.aio.Channel
    breaker: Breaker
    in_flight: int = 0
    info: pb.ServiceInfo | None = field(default=None)
    vision: vision_pb2_grpc.VisionStub = field(init=False)
    llm: llm_pb2_grpc.LlmStub = field(init=False)

    def __post_init__(self) -> None:
        self.vision = vision_pb2_grpc.VisionStub(self.vision_channel)
        self.llm = llm_pb2_grpc.LlmStub(self.llm_channel)

    async def llm_info(self) -> pb.ServiceInfo:
        """Its llm's model and limits, fetched once (they cannot change while it runs)."""
        if self.info is None:
            try:
                self.info = await self.llm.Info(pb.InfoRequest(), timeout=5)
            except grpc.RpcError as err:
                self.failed(err)
                raise Unavailable(f"llm service is not reachable: {err.code().name}") from err
            metrics.MODEL_INFO.labels("gateway", self.info.model_id, self.info.variant).set(1)
        return self.info

    def failed(self, err: grpc.RpcError) -> None:
        """A call to this worker ended with `err`: counted against it when it was the worker's fault."""
        if err.code() in WORKER_FAULTS:
            self.breaker.record(False)


class Workers:
    def __init__(
        self,
        vision_targets: str,
        llm_targets: str,
        creds: grpc.ChannelCredentials | None,
        interceptors: list,
        options,
        failures: int = 5,
        cooldown_s: float = 5.0,
    ) -> None:
        """`vision_targets`, `llm_targets`: comma lists of HOST:PORT, worker i the i-th of each."""
        visions, llms = vision_targets.split(","), llm_targets.split(",")
        if len(visions) != len(llms):
            raise ValueError(
                f"{len(visions)} --vision-target addresses and {len(llms)} --llm-target: one of each per worker"
            )

        def channel(target: str):
            return aio_channel(target.strip(), creds, options=options, interceptors=interceptors)

        if len(llms) == 1:
            failures = 2**62  # one worker: nowhere to route around it
        self.all = [
            Worker(llm.strip(), channel(v), channel(llm), Breaker(llm.strip(), failures, cooldown_s))
            for v, llm in zip(visions, llms, strict=True)
        ]
        self._turn = itertools.count()

    def pick(self) -> Worker:
        """The worker for the next request (counted in flight until `done`), or UNAVAILABLE."""
        allowed = [w for w in self.all if w.breaker.allows()]
        if not allowed:
            wait = min(w.breaker.wait_s() for w in self.all)
            raise Unavailable(f"every worker is cut off after repeated failures; the next is probed in {wait:.1f} s")
        start = next(self._turn)
        order = allowed[start % len(allowed) :] + allowed[: start % len(allowed)]
        worker = min(order, key=lambda w: w.in_flight)
        worker.breaker.started()
        worker.in_flight += 1
        return worker

    @staticmethod
    def done(worker: Worker) -> None:
        """A request picked for `worker` has ended, however: a probe that ended neither answered
        nor failed for the worker's sake (a cancel, bad input) leaves the next request to probe."""
        worker.in_flight -= 1
        worker.breaker.probing = False

    async def llm_info(self) -> pb.ServiceInfo:
        """The model and limits (every worker of a gateway serves the same): the first one's that answers."""
        error: Unavailable | None = None
        for worker in self.all:
            try:
                return await worker.llm_info()
            except Unavailable as err:
                error = err
        raise error or Unavailable("no workers")
