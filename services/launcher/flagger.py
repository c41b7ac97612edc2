"""Flagger's side of deploy/ (deploy/flagger/): a Blue/Green Canary per variant, analysed on Prometheus.

    python -m services.launcher.flagger deploy/variants.txt deploy/flagger

writes `canaries.yaml` (the two MetricTemplates and a Canary per variant) and `subsets.yaml` (the
DestinationRule's subsets, patched to select each variant's primary pods).

Why Blue/Green on Kubernetes Services (`provider: kubernetes`) and not Flagger's Istio traffic
shifting: with Istio, Flagger owns the VirtualService of the host it rolls out, and here that
VirtualService holds the variant split (deploy/mesh/istio.yaml), which Istio can neither share
nor chain (deploy/README.md). With the kubernetes provider Flagger owns no VirtualService. For
the Deployment `vlmesh-worker-NAME` it makes `vlmesh-worker-NAME-primary` (the same pod template,
its `app` label renamed to `...-primary`) and a `...-canary` Service. Each analysis step runs a
load test against the canary Service and checks the canary pods' error ratio and P99. It
promotes after `ITERATIONS` good steps, and rolls back (canary scaled to zero, primary untouched)
after `THRESHOLD` bad ones. The variant split keeps routing to the primaries: the patched subsets
add `app: vlmesh-worker-NAME-primary` to the variant label, so the canary's pods (in the same
`vlmesh` Service) get only the load test's requests.
"""

from __future__ import annotations

import base64
import json
import struct
import sys
import zlib
from collections.abc import Sequence
from pathlib import Path

from services.common.qos import QOS_METADATA_KEY
from services.launcher.istio import SERVICE, VARIANT_LABEL
from services.launcher.routing import Variant, parse_variants

API = "flagger.app/v1beta1"
SELECTOR_LABEL = "app"  # the first of Flagger's default selector labels: the one it renames for the primary
PROMETHEUS = "http://prometheus.istio-system:9090"
NAMESPACE = "vlmesh"  # where deploy/ is applied (kubectl apply -k ... -n vlmesh)
LOADTESTER = f"http://flagger-loadtester.{NAMESPACE}/"  # Flagger's load tester (it ships ghz), installed with Flagger
GATEWAY_PORT = 50051
# The load test starts with the analysis (Flagger runs the rollout webhooks, then the checks, each
# interval), so the first check may find no data, which counts as failed: 3 allow for it.
INTERVAL, ITERATIONS, THRESHOLD = "1m", 10, 3
ERROR_RATIO_MAX_PERCENT = 1.0
P99_MAX_MS = 387.0  # the latency bound the W1 capacity figures use (docs/PERF.md)
LOAD_RPS = 4

# The canary's pods and not the primary's (`NAME-primary-HASH-ID` does not match): Flagger's own matcher.
_PODS = 'namespace="{{ namespace }}", pod=~"{{ target }}-[0-9a-zA-Z]+(-[0-9a-zA-Z]+)"'
_ANSWERED = f'vlmesh_requests_total{{{_PODS}, service="gateway", code!="CANCELLED"}}'
_FAILED = f'vlmesh_requests_total{{{_PODS}, service="gateway", code!~"OK|CANCELLED"}}'
# Percent of the gateway's answered calls that ended in an error status. A client's cancel (the
# load test ends in-flight calls) is neither. No error series at all is 0; no answered call at all
# is no value, which Flagger counts as a failed check.
ERROR_RATIO_QUERY = (
    f"100 * (sum(rate({_FAILED}[{{{{ interval }}}}])) or on() vector(0)) / sum(rate({_ANSWERED}[{{{{ interval }}}}]))"
)
P99_QUERY = (
    "1000 * histogram_quantile(0.99, sum(rate("
    f"vlmesh_request_duration_seconds_bucket{{{_PODS}}}[{{{{ interval }}}}])) by (le))"
)
# Each MetricTemplate: its query and the largest value a check accepts.
TEMPLATES = {
    "vlmesh-error-ratio": (ERROR_RATIO_QUERY, ERROR_RATIO_MAX_PERCENT),
    "vlmesh-latency-p99": (P99_QUERY, P99_MAX_MS),
}


def worker(variant: str) -> str:
    return f"vlmesh-worker-{variant}"


def probe_png(size: int = 32) -> bytes:
    """A mid-grey square PNG, made byte for byte here (so the committed file renders the same anywhere)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + b"\x80" * (3 * size) for _ in range(size))  # filter byte 0, then RGB
    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b"")


def load_request() -> dict:
    """The load test's GenerateRequest, as proto JSON (ghz builds the message by server reflection)."""
    image = base64.b64encode(probe_png()).decode()
    return {"prompt": "What shape is in the picture?", "images": [{"data": image}], "sampling": {"maxTokens": 16}}


def load_command(variant: str) -> str:
    """ghz against the canary Service for one analysis interval, at a rate far below a worker's capacity."""
    body = json.dumps(load_request(), separators=(",", ":"))
    metadata = json.dumps({QOS_METADATA_KEY: "standard"}, separators=(",", ":"))
    return (
        f"ghz --insecure --call vlmesh.v1.Gateway/GenerateUnary --rps {LOAD_RPS} -z {INTERVAL} "
        f"--metadata '{metadata}' -d '{body}' {worker(variant)}-canary.{NAMESPACE}:{GATEWAY_PORT}"
    )


def metric_templates() -> list[dict]:
    return [
        {
            "apiVersion": API,
            "kind": "MetricTemplate",
            "metadata": {"name": name},
            "spec": {"provider": {"type": "prometheus", "address": PROMETHEUS}, "query": query},
        }
        for name, (query, _) in TEMPLATES.items()
    ]


def canary(variant: Variant) -> dict:
    name = worker(variant.name)
    return {
        "apiVersion": API,
        "kind": "Canary",
        "metadata": {"name": name},
        "spec": {
            "provider": "kubernetes",
            "targetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "autoscalerRef": {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "name": name},
            # A new worker loads its weights and compiles and captures its graphs before it is ready.
            "progressDeadlineSeconds": 1800,
            "service": {"port": GATEWAY_PORT, "targetPort": "grpc", "portName": "grpc", "appProtocol": "grpc"},
            "analysis": {
                "interval": INTERVAL,
                "iterations": ITERATIONS,  # iterations and no stepWeight: Blue/Green
                "threshold": THRESHOLD,
                "metrics": [
                    {"name": t, "templateRef": {"name": t}, "thresholdRange": {"max": limit}, "interval": INTERVAL}
                    for t, (_, limit) in TEMPLATES.items()
                ],
                "webhooks": [
                    {
                        "name": "load",
                        "type": "rollout",
                        "url": LOADTESTER,
                        "timeout": "15s",
                        "metadata": {"type": "cmd", "cmd": load_command(variant.name)},
                    }
                ],
            },
        },
    }


def primary_subsets(variants: Sequence[Variant]) -> dict:
    """A patch of the DestinationRule: each variant's subset selects its primary's pods only."""
    subsets = [
        {"name": v.name, "labels": {VARIANT_LABEL: v.name, SELECTOR_LABEL: f"{worker(v.name)}-primary"}}
        for v in variants
    ]
    return {
        "apiVersion": "networking.istio.io/v1",
        "kind": "DestinationRule",
        "metadata": {"name": SERVICE},
        "spec": {"subsets": subsets},
    }


HEAD = (
    "# Generated by `python -m services.launcher.flagger deploy/variants.txt deploy/flagger`: edit\n"
    "# deploy/variants.txt, not this file (a test checks that they agree).\n"
)


def render(variants_text: str) -> dict[str, str]:
    """deploy/flagger's generated files for `full=70,int8=30`-style text: {file name: text}."""
    import yaml

    variants = parse_variants(variants_text.strip())
    canaries = [*metric_templates(), *(canary(v) for v in variants)]
    return {
        "canaries.yaml": HEAD + yaml.safe_dump_all(canaries, sort_keys=False, width=10_000),
        "subsets.yaml": HEAD + yaml.safe_dump(primary_subsets(variants), sort_keys=False),
    }


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m services.launcher.flagger VARIANTS_FILE OUT_DIR")
    files = render(Path(sys.argv[1]).read_text())
    for file_name, text in files.items():
        (Path(sys.argv[2]) / file_name).write_text(text)
    print(f"wrote {', '.join(files)} in {sys.argv[2]}")
