"""One trace per request across gateway, vision and llm, read back from a real OTLP backend.

The backend is Arize Phoenix (OTLP gRPC and HTTP in, REST out), installed by `make test`
into .venv-phoenix. Without it the test skips, unless REQUIRE_OBSERVABILITY=1 (as in CI).
What is left out of traces is checked against OpenTelemetry's own OTLP service, served here.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import threading
import time
import urllib.request
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from services.launcher import Mesh, free_port
from tests.helpers import image_bytes, mesh_options, serving
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
PHOENIX = Path(os.environ.get("PHOENIX_BIN", ROOT / ".venv-phoenix" / "bin" / "phoenix"))
STAGE_SPANS = {
    "gateway.admission",
    "gateway.vision",
    "gateway.llm",
    "vision.cache_lookup",
    "vision.preprocess",
    "vision.queue",
    "vision.encode",
    "handoff.export",
    "handoff.import",
    "llm.queue",
    "llm.prefill",
    "llm.decode",
}


def get(url: str):
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.load(resp)


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory):
    if not PHOENIX.exists():
        if os.environ.get("REQUIRE_OBSERVABILITY") == "1":
            pytest.fail(f"Phoenix is required but {PHOENIX} is missing (make test installs it)")
        pytest.skip(f"Phoenix not installed at {PHOENIX}")
    http, grpc_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    env = {
        **os.environ,
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_PORT": str(http),
        "PHOENIX_GRPC_PORT": str(grpc_port),
        "PHOENIX_WORKING_DIR": str(tmp_path_factory.mktemp("phoenix")),
    }
    log = open(tmp_path_factory.mktemp("phoenix-log") / "phoenix.log", "w")
    proc = subprocess.Popen([str(PHOENIX), "serve"], env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        try:
            get(f"http://127.0.0.1:{http}/v1/projects")
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"Phoenix did not start: {Path(log.name).read_text()[-2000:]}")
            time.sleep(0.5)
    yield {
        "rest": f"http://127.0.0.1:{http}",
        "grpc": f"http://127.0.0.1:{grpc_port}",
        "http": f"http://127.0.0.1:{http}",
    }
    proc.terminate()
    proc.wait(30)
    log.close()


def spans(rest: str) -> list[dict]:
    out, cursor = [], None
    while True:
        url = f"{rest}/v1/projects/default/spans?limit=1000" + (f"&cursor={cursor}" if cursor else "")
        page = get(url)
        out += page["data"]
        cursor = page.get("next_cursor")
        if not cursor:
            return out


def send(mesh, door: str, rid: str, level: str, data: bytes) -> None:
    """One request through the gRPC door or the OpenAI-compatible HTTP one."""
    if door == "http":
        url = "data:image/png;base64," + base64.b64encode(data).decode()
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is in the image?"}]
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4}
        headers = {"x-request-id": rid, "qos-level": level}
        r = httpx.post(f"{mesh.http_url()}/chat/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        return
    with grpc.insecure_channel(mesh.target("gateway")) as ch:
        req = gateway_pb2.GenerateRequest(
            request_id=rid,
            images=[pb.Image(data=data)],
            prompt="What is in the image?",
            sampling=pb.SamplingParams(max_tokens=4),
        )
        list(gateway_pb2_grpc.GatewayStub(ch).Generate(req, metadata=(("qos-level", level),), timeout=30))


ROOT_SPAN = {"grpc": "/vlmesh.v1.Gateway/Generate", "http": "POST /v1/chat/completions"}


@pytest.mark.parametrize(("protocol", "door"), [("grpc", "grpc"), ("http/protobuf", "grpc"), ("grpc", "http")])
def test_one_trace_per_request_across_three_services(phoenix, tiny_model, protocol, door):
    """The same trace whichever door a request came through; the door's server span is its root."""
    endpoint = phoenix["grpc"] if protocol == "grpc" else phoenix["http"]
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OMP_NUM_THREADS": "1",
    }
    ids = {f"{protocol}-{door}-req-{i}": level for i, level in enumerate(("realtime", "standard", "best-effort"))}
    with Mesh(
        mesh_options(tiny_model, warmup_requests=0, extra_env=env, http_port=0 if door == "http" else -1)
    ) as mesh:
        mesh.start(progress=lambda m: None)
        for i, (rid, level) in enumerate(ids.items()):
            send(mesh, door, rid, level, image_bytes(2 + i))  # each picture new: the vision runs every stage
        deadline = time.monotonic() + 30
        while True:  # spans are exported in batches: wait until every request's trace is complete
            everything = spans(phoenix["rest"])
            traces = {}
            for rid in ids:
                tids = {s["context"]["trace_id"] for s in everything if s["attributes"].get("request.id") == rid}
                traces[rid] = tids
            complete = all(
                len(t) == 1 and STAGE_SPANS <= {s["name"] for s in everything if s["context"]["trace_id"] in t}
                for t in traces.values()
            )
            if complete or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    for rid, level in ids.items():
        assert len(traces[rid]) == 1, f"{rid}: spans in {len(traces[rid])} traces"
        (tid,) = traces[rid]
        trace = [s for s in everything if s["context"]["trace_id"] == tid]
        names = {s["name"] for s in trace}
        assert STAGE_SPANS <= names, f"{rid}: missing {STAGE_SPANS - names}"
        assert next(s for s in trace if s["name"] == "vision.cache_lookup")["attributes"]["cache.hit"] is False
        services = {s["attributes"].get("service.name") for s in trace}
        assert {"vlmesh-gateway", "vlmesh-vision", "vlmesh-llm"} <= services
        by_id = {s["context"]["span_id"]: s for s in trace}
        roots = [s for s in trace if not s.get("parent_id")]
        assert len(roots) == 1 and roots[0]["name"] == ROOT_SPAN[door]
        assert all(s["parent_id"] in by_id for s in trace if s.get("parent_id")), "a span's parent is missing"
        assert roots[0]["attributes"]["qos.level"] == level
        # The server spans downstream carry the request's id and class too.
        for name in ("/vlmesh.v1.Vision/Encode", "/vlmesh.v1.Llm/Generate"):
            server = [s for s in trace if s["name"] == name and s["attributes"].get("service.name") != "vlmesh-gateway"]
            assert server and server[0]["attributes"]["qos.level"] == level
            assert server[0]["attributes"]["request.id"] == rid
        # Stages nest under the right services: llm stages under the llm's server span.
        llm_server = next(
            s
            for s in trace
            if s["name"] == "/vlmesh.v1.Llm/Generate" and s["attributes"].get("service.name") == "vlmesh-llm"
        )
        for name in ("llm.queue", "llm.prefill", "llm.decode", "handoff.import"):
            assert next(s for s in trace if s["name"] == name)["parent_id"] == llm_server["context"]["span_id"]


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace endpoint that keeps (service, span name, trace id, request id) of what it gets."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.arrived = threading.Condition()

    def Export(self, request, context):
        with self.arrived:
            for resource in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource.resource.attributes}
                for scope in resource.scope_spans:
                    for s in scope.spans:
                        rid = next((a.value.string_value for a in s.attributes if a.key == "request.id"), None)
                        self.spans.append(
                            {"service": attrs["service.name"], "name": s.name, "trace": s.trace_id, "rid": rid}
                        )
            self.arrived.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()


def test_health_checks_and_reflection_make_no_spans(tiny_model):
    """Envoy, the kubelet, the launcher and the gateway's readiness probe poll health: those calls (and
    reflection's) stay out of traces, while a request still gets its whole trace."""
    receiver = OtlpReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    try:
        with Mesh(mesh_options(tiny_model, warmup_requests=0, extra_env=env)) as mesh:
            mesh.start(progress=lambda m: None)
            assert serving(mesh)  # a health check of each service, as a router's
            with grpc.insecure_channel(mesh.target("gateway")) as ch:
                ask = reflection_pb2.ServerReflectionRequest(list_services="")
                (answer,) = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(iter([ask]), timeout=30)
                assert "grpc.health.v1.Health" in {s.name for s in answer.list_services_response.service}
            # Each process exports its spans in the order they end: once the request's trace is whole,
            # every span of the checks before it has come too.
            send(mesh, "grpc", "after-health-checks", "standard", image_bytes(7))

            def whole() -> bool:
                tids = {s["trace"] for s in receiver.spans if s["rid"] == "after-health-checks"}
                return STAGE_SPANS <= {s["name"] for s in receiver.spans if s["trace"] in tids}

            with receiver.arrived:
                assert receiver.arrived.wait_for(whole, timeout=120), "the request's trace did not arrive whole"
    finally:
        server.stop(None)
    services = {s["service"] for s in receiver.spans}
    assert {"vlmesh-gateway", "vlmesh-vision", "vlmesh-llm"} <= services
    untraced = [s for s in receiver.spans if s["name"].startswith(("/grpc.health.v1.", "/grpc.reflection."))]
    assert untraced == [], f"{len(untraced)} spans of health checks or reflection, e.g. {untraced[:3]}"
