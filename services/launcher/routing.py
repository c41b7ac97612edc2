"""Weighted routing between model variants: one description, rendered as a local Envoy's config
here and as Istio's VirtualService and DestinationRule in services/launcher/istio.py (deploy/).

A variant is a set of workers (vision, llm and their gateway) serving one quantization of one
checkpoint. Requests are split between variants by weight; a request that names a variant in
`x-model-variant` goes to that variant only. Every other request may fail over: each variant's
cluster lists the other variants' gateways at a lower priority, so when its own gateway fails
its health checks (or is ejected by outlier detection) the traffic goes to the rest.

Retries only when the request cannot have reached a gateway (connect failure, refused or reset
stream before any byte went up): a retry after that would run generation twice.

The weights are Envoy runtime values (`routing.variant-NAME`), so `vlmesh route` (Envoy's
`/runtime_modify`) changes them while it runs, with no restart.

With TLS (`Tls`), Envoy serves the public port with the mesh's certificate, as a gateway does,
and calls the gateways over TLS, trusting the mesh's CA and showing its certificate.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.common.config import QUANTIZATIONS, VARIANT_METADATA_KEY

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


def _address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def _endpoints(hosts: Sequence[tuple[str, int]]) -> list[dict]:
    return [{"endpoint": {"address": _address(h, p)}} for h, p in hosts]


TLS = "envoy.extensions.transport_sockets.tls.v3"


@dataclass(frozen=True)
class Tls:
    """The files of the mesh's certificate, its key and its CA (PEM), as --tls-cert, --tls-key and --tls-ca."""

    cert: str
    key: str
    ca: str

    def _context(self) -> dict:
        return {
            "tls_certificates": [{"certificate_chain": {"filename": self.cert}, "private_key": {"filename": self.key}}],
            "alpn_protocols": ["h2"],  # gRPC over TLS negotiates HTTP/2 by ALPN (its clients require it)
        }

    def downstream(self) -> dict:
        context = {"@type": f"type.googleapis.com/{TLS}.DownstreamTlsContext", "common_tls_context": self._context()}
        return {"name": "envoy.transport_sockets.tls", "typed_config": context}

    def upstream(self) -> dict:
        common = {**self._context(), "validation_context": {"trusted_ca": {"filename": self.ca}}}
        context = {"@type": f"type.googleapis.com/{TLS}.UpstreamTlsContext", "common_tls_context": common}
        return {"name": "envoy.transport_sockets.tls", "typed_config": context}


def _cluster(name: str, priorities: Sequence[Sequence[tuple[str, int]]], tls: Tls | None = None) -> dict:
    return {
        **({"transport_socket": tls.upstream()} if tls else {}),
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"priority": i, "lb_endpoints": _endpoints(hosts)} for i, hosts in enumerate(priorities)],
        },
        # The standard gRPC health service of each gateway: a dead or stalled one is out in ~2 s.
        "health_checks": [
            {
                "timeout": "1s",
                "interval": "1s",
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                "grpc_health_check": {},
            }
        ],
        "outlier_detection": {
            "consecutive_5xx": OUTLIER.consecutive_5xx,
            "consecutive_gateway_failure": OUTLIER.consecutive_gateway_errors,
            "consecutive_local_origin_failure": OUTLIER.consecutive_local_origin_failures,
            "split_external_local_origin_errors": True,
            "interval": f"{OUTLIER.interval_s}s",
            "base_ejection_time": f"{OUTLIER.base_ejection_s}s",
            "max_ejection_percent": OUTLIER.max_ejection_percent,
        },
    }


@dataclass(frozen=True)
class Outlier:
    """When a gateway is ejected from its variant's pool: Envoy's and Istio's settings alike."""

    consecutive_5xx: int = 5
    consecutive_gateway_errors: int = 3  # 502, 503, 504 and connection failures
    consecutive_local_origin_failures: int = 2  # connect errors, resets, timeouts
    interval_s: int = 1
    base_ejection_s: int = 10
    max_ejection_percent: int = 100


OUTLIER = Outlier()
# Only what cannot have reached a gateway, so generation never runs twice.
RETRY_ON = "connect-failure,refused-stream,reset-before-request"
RETRY_ATTEMPTS = 2
RETRY_POLICY = {
    "retry_on": RETRY_ON,
    "num_retries": RETRY_ATTEMPTS,
    "retry_host_predicate": [
        {
            "name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
            },
        }
    ],
    "host_selection_retry_max_attempts": 3,
}


Address = tuple[str, int]
HCM = "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
HCM_FILTER = "envoy.filters.network.http_connection_manager"


def envoy_config(
    variants: Sequence[Variant],
    gateways: Mapping[str, Address],
    listen: Address,
    admin: Address,
    tls: Tls | None = None,
) -> dict:
    """Envoy's bootstrap: a gRPC listener on `listen` routing to each variant's gateway (`gateways`
    by name), the weights in the runtime, the admin interface on `admin`; TLS on both sides with `tls`."""
    route = {"timeout": "0s", "max_stream_duration": {"grpc_timeout_header_max": "0s"}}  # the client's deadline
    routes = [
        {
            "match": {"prefix": "/", "headers": [{"name": VARIANT_METADATA_KEY, "string_match": {"exact": v.name}}]},
            "route": {**route, "cluster": f"pinned-{v.name}", "retry_policy": RETRY_POLICY},
        }
        for v in variants
    ]
    routes.append(
        {
            "match": {"prefix": "/"},
            "route": {
                **route,
                "weighted_clusters": {
                    "clusters": [{"name": v.cluster, "weight": v.weight} for v in variants],
                    "runtime_key_prefix": RUNTIME_PREFIX,
                },
                "retry_policy": RETRY_POLICY,
            },
        }
    )
    clusters = []
    for v in variants:
        others = [gateways[o.name] for o in variants if o.name != v.name]
        clusters.append(_cluster(v.cluster, [[gateways[v.name]], others], tls))  # fail over to the others
        clusters.append(_cluster(f"pinned-{v.name}", [[gateways[v.name]]], tls))  # a pin never moves
    manager = {
        "@type": f"type.googleapis.com/{HCM}",
        "stat_prefix": "vlmesh",
        "codec_type": "AUTO",
        "route_config": {"name": "variants", "virtual_hosts": [{"name": "vlmesh", "domains": ["*"], "routes": routes}]},
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
            }
        ],
    }
    return {
        "admin": {"address": _address(*admin)},
        "layered_runtime": {
            "layers": [
                {"name": "weights", "static_layer": {f"{RUNTIME_PREFIX}.{v.cluster}": v.weight for v in variants}},
                {"name": "admin", "admin_layer": {}},
            ]
        },
        "static_resources": {
            "listeners": [
                {
                    "name": "grpc",
                    "address": _address(*listen),
                    "filter_chains": [
                        {
                            "filters": [{"name": HCM_FILTER, "typed_config": manager}],
                            **({"transport_socket": tls.downstream()} if tls else {}),
                        }
                    ],
                }
            ],
            "clusters": clusters,
        },
    }


def runtime_update(weights: Mapping[str, int]) -> dict[str, str]:
    """The `/runtime_modify` query that sets new weights, by variant name."""
    return {f"{RUNTIME_PREFIX}.variant-{name}": str(w) for name, w in weights.items()}
