"""Metrics and the observability/ files, checked with the real Prometheus tools.

`make test` installs Prometheus (Debian package `prometheus`, which brings promtool). Without
it these tests skip, unless REQUIRE_OBSERVABILITY=1 (as in CI).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from services.launcher import free_port
from tests.helpers import image_bytes, scrape
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
OBS = ROOT / "observability"


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("REQUIRE_OBSERVABILITY") == "1":
            pytest.fail(f"{name} is required (make test installs the Debian package prometheus)")
        pytest.skip(f"{name} is not installed")
    return path


def run(*cmd, stdin: str | None = None, cwd: Path = OBS) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, cwd=cwd, timeout=60)


def test_prometheus_config_and_alert_rules():
    promtool = tool("promtool")
    for cmd in (
        ("check", "config", "prometheus.yml"),
        ("check", "rules", "alerts.yml"),
        ("test", "rules", "alerts_test.yml"),
    ):
        result = run(promtool, *cmd)
        assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in run(promtool, "test", "rules", "alerts_test.yml").stdout


def dashboard_exprs() -> list[str]:
    dash = json.loads((OBS / "grafana-dashboard.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def test_every_dashboard_expression_parses(tmp_path):
    promtool = tool("promtool")
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [{"record": f"dashboard:expr_{i}", "expr": e} for i, e in enumerate(dashboard_exprs())],
            }
        ]
    }
    (tmp_path / "dash.yml").write_text(yaml.safe_dump(rules))
    result = run(promtool, "check", "rules", str(tmp_path / "dash.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    broken = {"groups": [{"name": "x", "rules": [{"record": "x:y", "expr": "sum(rate(vlmesh_requests_total[5m]"}]}]}
    (tmp_path / "broken.yml").write_text(yaml.safe_dump(broken))
    assert run(promtool, "check", "rules", str(tmp_path / "broken.yml")).returncode != 0  # the check has teeth


def test_the_error_and_cache_panels_read_zero_on_a_healthy_mesh(tmp_path):
    """No error series exists while nothing fails, and no hit series before a first hit: the error,
    error-budget and cache panels still read 0 (not "No data"), as promtool evaluates them."""
    promtool = tool("promtool")
    dash = json.loads((OBS / "grafana-dashboard.json").read_text())
    titles = ("Errors by service", "Error budget burn", "Cache hit ratios")
    exprs = [t["expr"] for p in dash["panels"] if p["title"].startswith(titles) for t in p["targets"]]
    assert len(exprs) == 7, "the panels this test reads have changed"

    def counter(name: str, labels: str) -> dict:
        return {"series": f"{name}{{{labels}}}", "values": "0+600x20"}

    healthy = [
        counter("vlmesh_requests_total", 'service="gateway",method="Generate",code="OK"'),
        counter("vlmesh_requests_total", 'service="llm",method="Generate",code="OK"'),
        counter("vlmesh_feature_cache_lookups_total", 'service="vision",result="miss"'),
        counter("vlmesh_prefix_cache_tokens_total", 'service="llm",result="miss"'),
    ]

    def zeros(expr: str) -> list[dict]:
        if expr.startswith("vlmesh:"):  # a recorded series keeps its rule's name
            return [{"labels": expr, "value": 0}]
        if "by (service" in expr:
            return [{"labels": f'{{service="{s}"}}', "value": 0} for s in ("gateway", "llm")]
        return [{"value": 0}]

    tests = [
        {
            "interval": "1m",
            "input_series": healthy,
            "promql_expr_test": [{"expr": e, "eval_time": "15m", "exp_samples": zeros(e)} for e in exprs],
        }
    ]
    (tmp_path / "test.yml").write_text(
        yaml.safe_dump({"rule_files": [str(OBS / "alerts.yml")], "evaluation_interval": "1m", "tests": tests})
    )
    result = run(promtool, "test", "rules", str(tmp_path / "test.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_availability_alerts_watch_the_job_prometheus_scrapes():
    """`up` of the job the alerts name, one target per process, each labelled with its service."""
    watched = set(re.findall(r'up\{job="([^"]+)"', (OBS / "alerts.yml").read_text()))
    assert watched == {"vlmesh"}
    (job,) = [
        j for j in yaml.safe_load((OBS / "prometheus.yml").read_text())["scrape_configs"] if j["job_name"] in watched
    ]
    services = [group["labels"]["service"] for group in job["static_configs"] for _ in group["targets"]]
    assert sorted(services) == ["gateway", "llm", "vision"]


def exported_names() -> set[str]:
    """Every sample name the services can export, from the one place metrics are defined."""
    from prometheus_client import REGISTRY

    import services.common.metrics  # noqa: F401 - registers the metrics

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {f.name + s for f in REGISTRY.collect() if f.name.startswith("vlmesh_") for s in suffixes.get(f.type, ("",))}


def test_dashboard_and_alerts_use_only_exported_metrics():
    used = set()
    for text in [*dashboard_exprs(), (OBS / "alerts.yml").read_text()]:
        used |= set(re.findall(r"\bvlmesh_[a-z0-9_]+", text))
    assert used, "no metric found in the dashboard"
    missing = used - exported_names()
    assert not missing, f"the dashboard or alerts use metrics nobody exports: {sorted(missing)}"


def send_requests(mesh, n: int) -> None:
    with grpc.insecure_channel(mesh.target("gateway")) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        for i in range(n):
            req = gateway_pb2.GenerateRequest(
                images=[pb.Image(data=image_bytes(i))],
                prompt="What is in the image?",
                sampling=pb.SamplingParams(max_tokens=3),
            )
            list(stub.Generate(req, metadata=(("qos-level", ("realtime", "best-effort")[i % 2]),), timeout=30))
        with pytest.raises(grpc.RpcError):
            stub.GenerateUnary(gateway_pb2.GenerateRequest(images=[pb.Image(data=b"nope")], prompt="x"), timeout=30)


def test_metrics_endpoints_pass_promtool(mesh):
    promtool = tool("promtool")
    send_requests(mesh, 2)
    for name, port in mesh.metrics_ports.items():
        text = scrape(port)
        result = run(promtool, "check", "metrics", stdin=text)
        assert result.returncode == 0, f"{name}: {result.stdout}{result.stderr}"
        assert "vlmesh_requests_total" in text
    gateway = scrape(mesh.metrics_ports["gateway"])
    assert 'vlmesh_requests_total{code="INVALID_ARGUMENT",method="GenerateUnary",service="gateway"}' in gateway
    assert 'vlmesh_request_duration_seconds_bucket{le="0.8",qos_level="realtime"}' in gateway
    assert 'vlmesh_kv_slots{state="free"}' in scrape(mesh.metrics_ports["llm"])
    assert 'vlmesh_arena_pages{arena="shm",state="leased"}' in scrape(mesh.metrics_ports["vision"])


def query(base: str, expr: str) -> float:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as resp:
        result = json.load(resp)["data"]["result"]
    return float(result[0]["value"][1]) if result else 0.0


def test_prometheus_scrapes_the_mesh(mesh, tmp_path):
    prometheus = tool("prometheus")
    port = free_port("127.0.0.1")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "vlmesh",
                "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in mesh.metrics_ports.values()]}],
            }
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen(
        [
            prometheus,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while query_ok(base, "up") < 3:  # all three targets scraped
            assert time.monotonic() < deadline, "Prometheus did not scrape the three services"
            time.sleep(0.5)
        requests = 'sum(vlmesh_requests_total{service="gateway",method="Generate",code="OK"})'
        latency = "sum(vlmesh_request_duration_seconds_count)"
        before = query(base, requests), query(base, latency)
        send_requests(mesh, 4)
        deadline = time.monotonic() + 30
        while (query(base, requests), query(base, latency)) < (before[0] + 4, before[1] + 4):
            assert time.monotonic() < deadline, f"counters did not move: {before} -> {query(base, requests)}"
            time.sleep(0.5)
        assert query(base, "sum(vlmesh_time_to_first_token_seconds_count)") >= 4
        assert query(base, 'sum(vlmesh_requests_total{service="llm",code="OK"})') >= 4
    finally:
        proc.terminate()
        proc.wait(30)


def query_ok(base: str, expr: str) -> int:
    try:
        url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": f"sum({expr})"})
        with urllib.request.urlopen(url, timeout=5) as resp:
            result = json.load(resp)["data"]["result"]
        return int(float(result[0]["value"][1])) if result else 0
    except OSError:
        return 0
