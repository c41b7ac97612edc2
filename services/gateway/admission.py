"""Admission at the gateway: per-class in-flight limits and budget- and deadline-aware shedding.

Every admitted request counts as in flight until it is answered, whatever the outcome.

- **Queue limits.** A class is admitted only while the mesh's total in flight is below that
  class's limit (defaults: 3, 6 and 8 times the llm's batch for best-effort, standard and
  realtime: 24, 48 and 64 with the default batch of 8). As load rises,
  best-effort is refused first, then standard; realtime keeps headroom above both, and
  inside the mesh it jumps every queue and may preempt best-effort decodes.
- **Budgets.** A class's latency budget is the sum of the write-ups' per-stage budgets
  (preprocess 120 ms, vision 300 ms, prefill 180 ms, decode 200 ms for their 16 output
  tokens), each times the class's scale (defaults: realtime 5, standard 10, best-effort 40:
  4 s, 8 s and 32 s). The gateway keeps a moving average of each stage's time from the
  timings of answered requests (decode per output token), and estimates a new request as
  preprocess + vision + prefill + decode per token x the tokens it will generate at least
  (max_tokens with ignore_eos, else min_tokens; at least 1), times the batches of
  work ahead of it (requests of its class or higher, `parallelism` at a time: lower classes
  do not delay it, since it overtakes them in every queue). A request that would wait behind
  at least one batch of such work, and whose estimate then exceeds its class's budget, would
  miss the budget because of the queue: it is told so at once instead of after the wait. A
  request with no batch ahead of it is never refused for the budget: an idle mesh serves it,
  however slow its stages are. Against a client's remaining deadline the whole estimate
  counts, queue or not: a request that cannot finish before its deadline is refused at once.

Every refusal is RESOURCE_EXHAUSTED with google.rpc RetryInfo (when the work ahead should
have drained), counted by class and reason. The config, its defaults and its flags:
AdmissionConfig in services/gateway/config.py.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from services.common import metrics
from services.common.errors import ResourceExhausted
from services.common.qos import QosLevel
from services.common.timings import Timings
from services.gateway.config import STAGES, AdmissionConfig

EWMA_WEIGHT = 0.1  # of each new sample: about the last 10-20 answered requests
MIN_RETRY_S = 0.1


@dataclass
class Ticket:
    qos: QosLevel
    done: bool = False


class Admission:
    """Thread-safe counters and averages; `admit` decides, `finish` ends a ticket."""

    def __init__(self, cfg: AdmissionConfig) -> None:
        self.cfg = cfg
        self.in_flight = {q: 0 for q in QosLevel}
        # Moving averages in seconds; decode per output token. None until a request was answered.
        self.stage_s: dict[str, float | None] = {s: None for s in STAGES}
        self._lock = threading.Lock()
        for q in QosLevel:
            metrics.IN_FLIGHT.labels(q.wire).set_function(lambda q=q: self.in_flight[q])

    def estimate_s(self, qos: QosLevel, output_tokens: int) -> tuple[float, float]:
        """(estimated latency of a new request of this class, seconds until the work ahead drains)."""
        avg = {k: v or 0.0 for k, v in self.stage_s.items()}
        service = avg["preprocess"] + avg["vision"] + avg["prefill"] + avg["decode"] * output_tokens
        ahead = sum(n for q, n in self.in_flight.items() if q <= qos)
        waves = ahead // self.cfg.parallelism
        return service * (1 + waves), service * waves

    def admit(self, qos: QosLevel, deadline_s: float | None, output_tokens: int) -> Ticket:
        """Count the request in, or raise ResourceExhausted with when to retry."""
        with self._lock:
            total = sum(self.in_flight.values())
            estimate, drain = self.estimate_s(qos, output_tokens)
            retry = max(MIN_RETRY_S, drain)
            if total >= self.cfg.max_in_flight[qos]:
                self._refuse(
                    qos,
                    "queue_full",
                    f"the mesh is full for {qos.wire} requests ({total} in flight, limit "
                    f"{self.cfg.max_in_flight[qos]})",
                    retry,
                )
            budget = self.cfg.budget_s(qos)
            if drain > 0 and estimate > budget:  # only queueing makes a request miss its budget
                self._refuse(
                    qos,
                    "budget",
                    f"estimated {estimate * 1000:.0f} ms, over the {qos.wire} budget of {budget * 1000:.0f} ms",
                    retry,
                )
            if deadline_s is not None and estimate > deadline_s:
                self._refuse(
                    qos,
                    "deadline",
                    f"estimated {estimate * 1000:.0f} ms, longer than the {deadline_s * 1000:.0f} ms left "
                    "before the deadline",
                    retry,
                )
            self.in_flight[qos] += 1
        metrics.ADMISSIONS.labels(qos.wire).inc()
        return Ticket(qos)

    @staticmethod
    def _refuse(qos: QosLevel, reason: str, message: str, retry_s: float) -> None:
        err = ResourceExhausted(message, retry_after_s=retry_s)
        err.reason = reason  # the gateway counts refusals by class and reason
        raise err

    def finish(self, ticket: Ticket, timings: Timings | None = None, output_tokens: int = 0) -> None:
        """End a ticket (once); an answered request's stage times update the averages."""
        with self._lock:
            if ticket.done:
                return
            ticket.done = True
            self.in_flight[ticket.qos] -= 1
            if timings is None:
                return
            for stage in STAGES:
                seconds = getattr(timings, stage)
                if stage == "decode":
                    if output_tokens < 2:
                        continue
                    seconds /= output_tokens - 1  # the first token comes from the prefill
                old = self.stage_s[stage]
                self.stage_s[stage] = seconds if old is None else old + EWMA_WEIGHT * (seconds - old)
