"""Weighted routing between model variants: one description and its settings, rendered as a local
Envoy's config in services/launcher/envoy.py and as Istio's VirtualService and DestinationRule in
services/launcher/istio.py (deploy/).

A variant is a set of workers (vision, llm and their gateway) serving one quantization of one
checkpoint. Requests are split between variants by weight; a request that pins a variant goes to
that variant only: by the header `x-model-variant: NAME`, or over HTTP by the body's `model` as
MODEL:NAME (OpenAI clients set no headers; Envoy's json_to_metadata filter reads it). A pin to a
variant the mesh does not serve is answered NOT_FOUND (404) by Envoy itself, naming those it does.

Every other request may fail over: each variant's cluster lists the other variants' gateways at a
lower priority, so when its own gateway is not ready (its gRPC health for `vlmesh.v1.Gateway`, or
the HTTP door's /health: NOT_SERVING while its llm or vision is unreachable,
services/gateway/readiness.py) or is ejected by outlier detection, the traffic goes to the rest.
A request that failed before its answer started (the gateway died, or refused with gRPC
UNAVAILABLE as a trailers-only response, HTTP 503; it sends no headers before the first token)
is retried on another priority, that is another variant; one that has streamed tokens is never
retried (Envoy cannot once the response has started).

The weights are Envoy runtime values (`routing.variant-NAME`, and `routing.http-variant-NAME`
for the HTTP door), so `vlmesh route` (Envoy's `/runtime_modify`) changes them while it runs,
with no restart.

With TLS (`Tls`), Envoy serves the public ports with the mesh's certificate, as a gateway does,
and calls the gateways over TLS, trusting the mesh's CA and showing its certificate.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.common.config import QUANTIZATIONS, VARIANT_METADATA_KEY
from vlmesh.v1 import gateway_pb2

# A variant's name says its weights: full precision, or one of the --quantize kinds.
KINDS = {"full": "none", **{q: q for q in QUANTIZATIONS if q != "none"}}
RUNTIME_PREFIX = "routing"
_SPEC = re.compile(r"([a-z0-9]+)=(\d+)")


@dataclass(frozen=True)
class Variant:
    name: str  # full, int8, int4
    weight: int  # share of the unpinned requests, out of the weights' sum

    @property
    def quantize(self) -> str:
        return KINDS[self.name]

    @property
    def cluster(self) -> str:
        return f"variant-{self.name}"


def parse_variants(text: str) -> list[Variant]:
    """`full=70,int8=30` -> variants; ValueError saying what is wrong."""
    variants = []
    for part in text.split(","):
        m = _SPEC.fullmatch(part.strip())
        if not m:
            raise ValueError(f"{text!r}: expected NAME=WEIGHT,..., e.g. full=70,int8=30")
        name, weight = m.group(1), int(m.group(2))
        if name not in KINDS:
            raise ValueError(f"unknown variant {name!r}; use {', '.join(KINDS)}")
        variants.append(Variant(name, weight))
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"{text!r}: a variant is named twice")
    if len(variants) < 2:
        raise ValueError(f"{text!r}: weighted routing needs two variants or more")
    if sum(v.weight for v in variants) == 0:
        raise ValueError(f"{text!r}: the weights add up to 0")
    return variants


TLS = "envoy.extensions.transport_sockets.tls.v3"


@dataclass(frozen=True)
class Tls:
    """The files of the mesh's certificate, its key and its CA (PEM), as --tls-cert, --tls-key and --tls-ca."""

    cert: str
    key: str
    ca: str

    def _context(self, alpn: Sequence[str]) -> dict:
        return {
            "tls_certificates": [{"certificate_chain": {"filename": self.cert}, "private_key": {"filename": self.key}}],
            "alpn_protocols": list(alpn),  # gRPC over TLS negotiates HTTP/2 by ALPN (its clients require it)
        }

    def downstream(self, alpn: Sequence[str] = ("h2",)) -> dict:
        context = {
            "@type": f"type.googleapis.com/{TLS}.DownstreamTlsContext",
            "common_tls_context": self._context(alpn),
        }
        return {"name": "envoy.transport_sockets.tls", "typed_config": context}

    def upstream(self, alpn: Sequence[str] = ("h2",)) -> dict:
        common = {**self._context(alpn), "validation_context": {"trusted_ca": {"filename": self.ca}}}
        context = {"@type": f"type.googleapis.com/{TLS}.UpstreamTlsContext", "common_tls_context": common}
        return {"name": "envoy.transport_sockets.tls", "typed_config": context}


# The gateway's readiness: NOT_SERVING while no worker of it can serve (services/gateway/readiness.py).
GATEWAY_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
# What Envoy may hold of a request body, to retry it and to read an HTTP request's `model`: the
# largest request a gateway takes (services/common/server.py's message limit; pictures inline).
BUFFER_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Health:
    """Envoy's active health checks of the gateways: a gateway not ready is out within about a second."""

    interval_s: float = 0.5
    timeout_s: float = 2.0  # a busy host answers late; a dead gateway refuses at once, a not-ready one says so
    unhealthy_threshold: int = 2
    healthy_threshold: int = 1


HEALTH = Health()


@dataclass(frozen=True)
class Outlier:
    """When a gateway is ejected from its variant's pool: Envoy's and Istio's settings alike."""

    consecutive_5xx: int = 5
    consecutive_gateway_errors: int = 3  # 502, 503 (gRPC UNAVAILABLE), 504 and connection failures
    consecutive_local_origin_failures: int = 2  # connect errors, resets, timeouts
    interval_s: int = 1
    base_ejection_s: int = 10
    max_ejection_percent: int = 100


OUTLIER = Outlier()
# Retried: what cannot have reached a gateway; a gateway that died (reset) or refused because
# its worker is down (gRPC UNAVAILABLE, trailers-only; HTTP 503) before its answer started. The
# gateway sends its headers with the first token, and Envoy never retries once headers went
# downstream: an answer the client has begun to read is never run again.
NOT_SENT = "connect-failure,refused-stream,reset-before-request"
RETRY_ON = "connect-failure,refused-stream,reset,unavailable"
RETRIABLE_STATUS = 503
RETRY_ATTEMPTS = 2
MAX_RETRIES_IN_FLIGHT = 1024  # Envoy's default limit of connections and requests per pool alike


def not_served(variants: Sequence[Variant]) -> str:
    """What Envoy answers a pin to a variant the mesh does not serve."""
    served = ", ".join(v.name for v in variants)
    return f"this mesh serves no such variant: it serves {served} (pin one with {VARIANT_METADATA_KEY}: NAME)"


def runtime_keys(name: str) -> tuple[str, str]:
    """The runtime keys of variant `name`'s weight: its gRPC cluster's and its HTTP cluster's."""
    return f"{RUNTIME_PREFIX}.variant-{name}", f"{RUNTIME_PREFIX}.http-variant-{name}"


def runtime_update(weights: Mapping[str, int], as_text: bool = True) -> dict:
    """The runtime values that set these weights, by variant name (text: the `/runtime_modify` query)."""
    return {key: str(w) if as_text else w for name, w in weights.items() for key in runtime_keys(name)}


def served_variants(runtime: Mapping[str, object]) -> dict[str, int]:
    """The variants a running Envoy routes to, with their weights, from its `/runtime` entries."""
    out = {}
    for key, entry in runtime.items():
        m = re.fullmatch(rf"{RUNTIME_PREFIX}\.variant-([a-z0-9]+)", key)
        if m:
            value = entry.get("final_value") if isinstance(entry, Mapping) else entry
            out[m.group(1)] = int(str(value))
    order = list(KINDS)
    return dict(sorted(out.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))
