"""The variants' routing (services/launcher/routing.py) as a local Envoy's bootstrap: what
`vlmesh up --variants` runs in front of the workers, as services/launcher/istio.py renders the
same description for Istio.

A gRPC listener and, for the OpenAI door, an HTTP one; per variant a cluster of its own gateways
(priority 0: one per worker, more with `--placement replicate`) with the other variants' behind
it (priority 1), and a pinned cluster of its gateways alone; routes for the pins, Envoy's own
NOT_FOUND for a pin to a variant not served, then the weights from Envoy's runtime. Within a
priority Envoy sends each request to the gateway with fewer requests in flight (LEAST_REQUEST:
the better of two picked at random), so a worker slowed by long prompts gets less. Realtime
requests (`qos-level: realtime`) take each route at Envoy's HIGH routing priority: a connection
pool and circuit-breaker limits of their own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.common.config import MODEL_VARIANT_SEPARATOR, VARIANT_METADATA_KEY
from services.common.qos import QOS_METADATA_KEY, QosLevel
from services.launcher.routing import (
    BUFFER_BYTES,
    GATEWAY_SERVICE,
    HEALTH,
    KINDS,
    MAX_RETRIES_IN_FLIGHT,
    NOT_SENT,
    OUTLIER,
    RETRIABLE_STATUS,
    RETRY_ATTEMPTS,
    RETRY_ON,
    RUNTIME_PREFIX,
    Tls,
    Variant,
    not_served,
    runtime_update,
)


def _address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def _endpoints(hosts: Sequence[tuple[str, int]]) -> list[dict]:
    return [{"endpoint": {"address": _address(h, p)}} for h, p in hosts]


def _health_check(http: bool) -> dict:
    check = (
        {"http_health_check": {"path": "/health"}} if http else {"grpc_health_check": {"service_name": GATEWAY_SERVICE}}
    )
    return {
        "timeout": f"{HEALTH.timeout_s}s",
        "interval": f"{HEALTH.interval_s}s",
        "no_traffic_interval": f"{HEALTH.interval_s}s",  # Envoy's default (60 s) would leave a quiet pool stale
        "unhealthy_threshold": HEALTH.unhealthy_threshold,
        "healthy_threshold": HEALTH.healthy_threshold,
        **check,
    }


def _cluster(name: str, priorities: Sequence[Sequence[tuple[str, int]]], tls: Tls | None, http: bool) -> dict:
    """A pool of gateways by priority (0 first; the next when those are unhealthy or ejected):
    their gRPC ports over HTTP/2, or with `http` their OpenAI doors over HTTP/1.1."""
    alpn = ("http/1.1",) if http else ("h2",)
    protocol = {"http_protocol_options": {}} if http else {"http2_protocol_options": {}}
    return {
        **({"transport_socket": tls.upstream(alpn)} if tls else {}),
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "LEAST_REQUEST",
        "per_connection_buffer_limit_bytes": BUFFER_BYTES,
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": protocol,
            }
        },
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {"priority": i, "lb_endpoints": _endpoints(hosts)}
                for i, hosts in enumerate(p for p in priorities if p)  # one variant: no failover priority
            ],
        },
        # Envoy allows 3 retries in flight per pool by default: a worker that dies under load fails
        # more requests than that at once, and each must be retried on another variant.
        "circuit_breakers": {
            "thresholds": [{"priority": p, "max_retries": MAX_RETRIES_IN_FLIGHT} for p in ("DEFAULT", "HIGH")]
        },
        "health_checks": [_health_check(http)],
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


_PREVIOUS_HOSTS = {
    "name": "envoy.retry_host_predicates.previous_hosts",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
    },
}
# A retry skips the priority it tried: from a variant's own gateway to the other variants'.
_PREVIOUS_PRIORITIES = {
    "name": "envoy.retry_priorities.previous_priorities",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.retry.priority.previous_priorities.v3.PreviousPrioritiesConfig",
        "update_frequency": 1,
    },
}


def _retry_policy(http: bool, pinned: bool) -> dict:
    """Weighted: fail over to another variant. Pinned: only what never reached the gateway, on it again."""
    if pinned:
        return {"retry_on": NOT_SENT, "num_retries": RETRY_ATTEMPTS}
    policy = {
        "retry_on": "connect-failure,refused-stream,reset,retriable-status-codes" if http else RETRY_ON,
        "num_retries": RETRY_ATTEMPTS,
        "retry_host_predicate": [_PREVIOUS_HOSTS],
        "host_selection_retry_max_attempts": 3,
        "retry_priority": _PREVIOUS_PRIORITIES,
    }
    if http:
        policy["retriable_status_codes"] = [RETRIABLE_STATUS]
    return policy


Address = tuple[str, int]
HCM = "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
HCM_FILTER = "envoy.filters.network.http_connection_manager"
ROUTER = {
    "name": "envoy.filters.http.router",
    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
}
# The HTTP body's `model`, as dynamic metadata vlmesh.model for the routes to match.
MODEL_METADATA = {"filter": "vlmesh", "path": [{"key": "model"}]}
READ_MODEL = {
    "name": "envoy.filters.http.json_to_metadata",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.json_to_metadata.v3.JsonToMetadata",
        "request_rules": {
            "rules": [
                {
                    "selectors": [{"key": "model"}],
                    "on_present": {"metadata_namespace": "vlmesh", "key": "model", "type": "STRING"},
                }
            ]
        },
    },
}


def _refusal(variants: Sequence[Variant], http: bool, pin: str) -> dict:
    """NOT_FOUND from Envoy itself: gRPC status 5, or OpenAI's 404 model_not_found."""
    message = f"{pin} {not_served(variants)}"
    if http:
        error = {"message": message, "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
        body, headers = json.dumps({"error": error}), {"content-type": "application/json"}
    else:
        body, headers = message, {"grpc-status": "5"}  # sent as a trailers-only NOT_FOUND, the body as its message
    return {
        "direct_response": {"status": 404, "body": {"inline_string": body}},
        "response_headers_to_add": [
            {"header": {"key": k, "value": v}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
            for k, v in headers.items()
        ],
    }


def _routes(variants: Sequence[Variant], http: bool) -> list[dict]:
    """Pins by header (and over HTTP by `model`), refusals of unserved pins, then the weights."""
    prefix = "http-" if http else ""
    # No timeout of the mesh's own: the client's deadline (gRPC's grpc-timeout) holds.
    limits = {"timeout": "0s"} if http else {"timeout": "0s", "max_stream_duration": {"grpc_timeout_header_max": "0s"}}
    pinned = {**limits, "retry_policy": _retry_policy(http, pinned=True)}

    def header(value: dict) -> dict:
        return {"prefix": "/", "headers": [{"name": VARIANT_METADATA_KEY, **value}]}

    def model_ends(name: str) -> dict:
        suffix = {"string_match": {"suffix": f"{MODEL_VARIANT_SEPARATOR}{name}"}}
        return {"prefix": "/", "dynamic_metadata": [{**MODEL_METADATA, "value": suffix}]}

    routes = [
        {
            "match": header({"string_match": {"exact": v.name}}),
            "route": {**pinned, "cluster": f"{prefix}pinned-{v.name}"},
        }
        for v in variants
    ]
    routes.append({"match": header({"present_match": True}), **_refusal(variants, http, VARIANT_METADATA_KEY)})
    if http:
        routes += [
            {"match": model_ends(v.name), "route": {**pinned, "cluster": f"http-pinned-{v.name}"}} for v in variants
        ]
        served = {v.name for v in variants}
        routes += [{"match": model_ends(k), **_refusal(variants, http, "model")} for k in KINDS if k not in served]
    weighted = {
        "clusters": [{"name": f"{prefix}{v.cluster}", "weight": v.weight} for v in variants],
        "runtime_key_prefix": RUNTIME_PREFIX,
    }
    routes.append(
        {
            "match": {"prefix": "/"},
            "route": {**limits, "weighted_clusters": weighted, "retry_policy": _retry_policy(http, pinned=False)},
        }
    )
    return [twin for r in routes for twin in ((_realtime(r), r) if "route" in r else (r,))]


# The qos-level header (gRPC metadata, or the HTTP door's header) of realtime work.
REALTIME = {"name": QOS_METADATA_KEY, "string_match": {"exact": QosLevel.REALTIME.wire}}


def _realtime(route: dict) -> dict:
    """The same route for realtime work at Envoy's HIGH routing priority: its own connection pool to
    each gateway and its own circuit-breaker limits, so a backlog of standard and best-effort streams
    cannot hold it at the door (the gateways order the queues). Placed just before its twin, so
    refusals of unserved pins still come first."""
    match = {**route["match"], "headers": [*route["match"].get("headers", []), REALTIME]}
    return {**route, "match": match, "route": {**route["route"], "priority": "HIGH"}}


def _clusters(
    variants: Sequence[Variant], gateways: Mapping[str, Sequence[Address]], tls: Tls | None, http: bool
) -> list[dict]:
    prefix = "http-" if http else ""
    clusters = []
    for v in variants:
        own = list(gateways[v.name])
        others = [g for o in variants if o.name != v.name for g in gateways[o.name]]
        clusters.append(_cluster(f"{prefix}{v.cluster}", [own, others], tls, http))  # fail over
        clusters.append(_cluster(f"{prefix}pinned-{v.name}", [own], tls, http))  # a pin never moves
    return clusters


def _listener(name: str, listen: Address, routes: list[dict], filters: list[dict], tls: Tls | None, http: bool) -> dict:
    manager = {
        "@type": f"type.googleapis.com/{HCM}",
        "stat_prefix": f"vlmesh_{name}",
        "codec_type": "AUTO",
        "route_config": {"name": name, "virtual_hosts": [{"name": "vlmesh", "domains": ["*"], "routes": routes}]},
        "http_filters": [*filters, ROUTER],
    }
    chain: dict = {"filters": [{"name": HCM_FILTER, "typed_config": manager}]}
    if tls:
        chain["transport_socket"] = tls.downstream(("h2", "http/1.1") if http else ("h2",))
    return {
        "name": name,
        "address": _address(*listen),
        "per_connection_buffer_limit_bytes": BUFFER_BYTES,
        "filter_chains": [chain],
    }


@dataclass(frozen=True)
class HttpDoor:
    """The OpenAI door behind the split: Envoy's HTTP listener, and each variant's gateways' HTTP ports."""

    listen: Address
    gateways: Mapping[str, Sequence[Address]]


def envoy_config(
    variants: Sequence[Variant],
    gateways: Mapping[str, Sequence[Address]],
    listen: Address,
    admin: Address,
    tls: Tls | None = None,
    http: HttpDoor | None = None,
) -> dict:
    """Envoy's bootstrap: a gRPC listener on `listen` routing to each variant's gateways (`gateways`
    by name, one per worker), with `http` an HTTP listener routing to their OpenAI doors alike, the weights in the
    runtime, the admin interface on `admin`; TLS on both sides with `tls`."""
    listeners = [_listener("grpc", listen, _routes(variants, http=False), [], tls, http=False)]
    clusters = _clusters(variants, gateways, tls, http=False)
    if http is not None:
        listeners.append(_listener("http", http.listen, _routes(variants, http=True), [READ_MODEL], tls, http=True))
        clusters += _clusters(variants, http.gateways, tls, http=True)
    return {
        "admin": {"address": _address(*admin)},
        "layered_runtime": {
            "layers": [
                {
                    "name": "weights",
                    "static_layer": runtime_update({v.name: v.weight for v in variants}, as_text=False),
                },
                {"name": "admin", "admin_layer": {}},
            ]
        },
        "static_resources": {"listeners": listeners, "clusters": clusters},
    }
