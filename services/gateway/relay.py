"""The end of a relayed llm stream: the final answer's usage and timings, and the request's metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common import metrics, telemetry
from services.common.qos import QosLevel
from services.common.timings import Timings
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, llm_pb2

if TYPE_CHECKING:
    from services.gateway.admission import Ticket
    from services.gateway.tenants import Tenant


@dataclass(frozen=True)
class Ledger:
    """What the relay's last message settles for a request: its class, its clocks (perf_counter
    seconds), its admission ticket and the tenant it is charged to."""

    qos: QosLevel
    received: float
    admitted: float
    ticket: Ticket
    tenant: Tenant | None


class NotCached(Exception):
    """The llm, sent content keys alone, no longer holds those images' KV: encode them and send again."""


def finish_response(
    out: gateway_pb2.GenerateResponse,
    msg: llm_pb2.LlmGenerateResponse,
    vision_timings: pb.StageTimings,
    qos: QosLevel,
    received: float,
    admitted: float,
    first_token_at: float | None,
) -> Timings:
    """Fill the final message (usage, merged stage timings), record the request's metrics, return its timings."""
    done = time.perf_counter()
    t = (
        Timings.from_pb(vision_timings)
        .merge(Timings.from_pb(msg.timings))
        .replace(admission=admitted - received, ttft=(first_token_at or done) - received, total=done - received)
    )
    out.timings.CopyFrom(t.to_pb())
    out.finish_reason = msg.finish_reason
    out.usage.CopyFrom(msg.usage)
    n = msg.usage.output_tokens
    level = qos.wire
    metrics.REQUEST_DURATION.labels(level).observe(done - received)
    metrics.TTFT.labels(level).observe(t.ttft)
    if n > 1 and first_token_at is not None:
        metrics.TPOT.labels(level).observe((done - first_token_at) / (n - 1))
    metrics.OUTPUT_TOKENS.labels(level).inc(n)
    telemetry.annotate(
        {
            "gen_ai.usage.input_tokens": msg.usage.prompt_tokens + msg.usage.image_tokens,
            "gen_ai.usage.output_tokens": n,
            "gen_ai.response.finish_reasons": [pb.FinishReason.Name(msg.finish_reason)],
        }
    )
    return t
