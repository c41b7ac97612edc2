"""Degradation before refusal: best-effort work that admission would refuse for overload.

The write-ups shed load by serving less before they refuse. Two ways here, in this order:

1. **To a cheaper variant.** With `--degrade-target HOST:PORT` (the gateway of a cheaper variant
   of the same checkpoint; `vlmesh up --variants` gives it to every variant's gateway but the
   cheapest's), the request is relayed there whole: its metadata (API key, qos-level, trace
   context), its deadline. That gateway answers as itself, with its own admission (a refusal
   there comes back as it is; if it cannot be reached, this gateway's refusal does) and its
   own `x-model-variant`. A request pinned to a variant (`x-model-variant`) is not relayed.
   With `--degrade-variant NAME` the relay pins NAME, so a router in front of several variants
   (Istio's VirtualService in deploy/, the local Envoy) takes it to that variant's workers.
2. **A smaller max_tokens.** A tenant whose entry has `degrade_max_tokens` N accepts answers cut
   to N tokens under overload: the request is admitted again as if it had asked for N, and
   served with that cap if the estimate then fits its class's budget.

Only a refusal for the queue (`queue_full`, `budget`) degrades; a tenant's own limits and a
client's deadline do not, and neither does realtime or standard work. A degraded answer says
so in its initial metadata, `x-vlmesh-degraded: variant=NAME` or `max_tokens=N`, and counts in
vlmesh_degradations_total{qos,kind}. A relayed request carries the same key, so the cheaper
gateway refuses it rather than relay it on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence

import grpc

from services.common import metrics
from services.common.config import DEGRADED_METADATA_KEY, VARIANT_METADATA_KEY
from services.common.errors import ResourceExhausted, from_rpc_error
from services.common.qos import QOS_METADATA_KEY, QosLevel, metadata_value
from services.common.sampling import Sampling
from services.common.server import INTERNAL_OPTIONS
from services.gateway.admission import Admission, Ticket
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc

QUEUE_REASONS = ("queue_full", "budget")
OURS = (DEGRADED_METADATA_KEY, VARIANT_METADATA_KEY)  # set by the relay itself


def relayed(key: str) -> bool:
    """Whether a relay copies this request metadata: the API key, the class and custom x- keys;
    not transport headers (gRPC's, or HTTP's from the HTTP door) nor the trace context, which
    the relay's own client interceptor writes for its span."""
    return key in ("authorization", QOS_METADATA_KEY) or (key.startswith("x-") and key not in OURS)


def degradable(qos: QosLevel, refusal: ResourceExhausted, metadata: Sequence | None) -> bool:
    """Whether a refusal at admission may degrade instead: best-effort, refused for the queue, not relayed already."""
    return (
        qos is QosLevel.BEST_EFFORT
        and refusal.reason in QUEUE_REASONS
        and metadata_value(metadata, DEGRADED_METADATA_KEY) is None
    )


def capped(sampling: Sampling, cap: int, default_max_tokens: int) -> Sampling:
    """The sampling with max_tokens at most `cap` (and min_tokens no more than that)."""
    most = min(sampling.max_tokens or default_max_tokens, cap)
    return dataclasses.replace(sampling, max_tokens=most, min_tokens=min(sampling.min_tokens, most))


def count(qos: QosLevel, kind: str) -> None:
    metrics.DEGRADATIONS.labels(qos.wire, kind).inc()


class CheaperVariant:
    """The relay to --degrade-target's gateway (one channel, opened on first use)."""

    def __init__(
        self, target: str, variant: str | None, credentials: grpc.ChannelCredentials | None, interceptors
    ) -> None:
        self.target, self.variant, self._credentials, self._interceptors = target, variant, credentials, interceptors
        self._stub: gateway_pb2_grpc.GatewayStub | None = None

    def _gateway(self) -> gateway_pb2_grpc.GatewayStub:
        if self._stub is None:
            opts = {"options": INTERNAL_OPTIONS, "interceptors": self._interceptors}
            channel = (
                grpc.aio.secure_channel(self.target, self._credentials, **opts)
                if self._credentials is not None
                else grpc.aio.insecure_channel(self.target, **opts)
            )
            self._stub = gateway_pb2_grpc.GatewayStub(channel)
        return self._stub

    async def relay(
        self,
        request: gateway_pb2.GenerateRequest,
        metadata: Sequence | None,
        context,
        qos: QosLevel,
        refusal: ResourceExhausted,
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """Stream the cheaper variant's answer, its initial metadata first (plus the degradation's).

        Its refusal comes back as it is; if it cannot be reached, this gateway's own `refusal`.
        """
        headers = [(k, v) for k, v in metadata or () if relayed(k)]
        headers.append((DEGRADED_METADATA_KEY, "relayed"))
        if self.variant:  # for a router in front of the variants: pinned there
            headers.append((VARIANT_METADATA_KEY, self.variant))
        call = self._gateway().Generate(request, metadata=headers, timeout=context.time_remaining())
        started = False
        try:
            async for msg in call:
                if not started:  # answered there, not refused: say who serves it, and how
                    started = True
                    variant = metadata_value(await call.initial_metadata(), VARIANT_METADATA_KEY) or "unknown"
                    await context.send_initial_metadata(
                        ((VARIANT_METADATA_KEY, variant), (DEGRADED_METADATA_KEY, f"variant={variant}"))
                    )
                    count(qos, "variant")
                yield msg
        except grpc.RpcError as err:
            if not started and err.code() == grpc.StatusCode.UNAVAILABLE:
                raise refusal from err
            raise from_rpc_error(err, f"the cheaper variant's gateway ({self.target})") from err
        finally:
            call.cancel()  # a no-op once it ended; else the client went away


@dataclasses.dataclass(frozen=True)
class Admitted:
    """What admission decided: serve here (`ticket`, with `sampling`, perhaps capped), or relay."""

    ticket: Ticket | None  # None: relay to the cheaper variant
    sampling: Sampling
    refusal: ResourceExhausted | None = None  # the refusal a relay stands in for
    headers: tuple[tuple[str, str], ...] = ()  # initial metadata the degradation adds


class Degrader:
    """Admission, then degradation in the module's order, then the refusal."""

    def __init__(self, admission: Admission, cheaper: CheaperVariant | None) -> None:
        self.admission, self.cheaper = admission, cheaper

    def admit(
        self,
        qos: QosLevel,
        remaining_s: float | None,
        min_output_tokens: int,  # output tokens the request will generate at least
        metadata: Sequence | None,
        cap: int | None,  # the tenant's degrade_max_tokens
        sampling: Sampling,
        default_max_tokens: int,
    ) -> Admitted:
        try:
            return Admitted(self.admission.admit(qos, remaining_s, min_output_tokens), sampling)
        except ResourceExhausted as refusal:
            if not degradable(qos, refusal, metadata):
                raise
            if self.cheaper is not None and metadata_value(metadata, VARIANT_METADATA_KEY) is None:
                return Admitted(None, sampling, refusal)  # (a request pinned to a variant stays on it)
            if cap is None or min_output_tokens <= cap:  # a cap that changes nothing admits nothing more
                raise
            smaller = capped(sampling, cap, default_max_tokens)
            ticket = self.admission.admit(qos, remaining_s, min(min_output_tokens, cap))  # or its own refusal
            count(qos, "max_tokens")
            return Admitted(ticket, smaller, headers=((DEGRADED_METADATA_KEY, f"max_tokens={smaller.max_tokens}"),))
