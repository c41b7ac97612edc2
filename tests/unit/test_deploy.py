"""deploy/ with the real tools, offline: kustomize builds every overlay, kubernetes-validate passes
the output strictly for Kubernetes 1.32, the Istio objects validate against cloudcoil's models
with no field those models would ignore, and the weights, subsets and labels agree across the
VirtualService, the DestinationRule, the Deployments and the local Envoy's config. deploy/flagger:
each Canary's objects exist and agree, the variant split reaches only Flagger's primaries, and
promtool evaluates the analysis queries over the canary's, its primary's and the llm's series."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
import yaml

from services.launcher.envoy import envoy_config
from services.launcher.istio import VARIANT_LABEL, percents, render
from services.launcher.routing import RUNTIME_PREFIX, parse_variants
from services.launcher.variants import COST
from tests.helpers import ROOT

DEPLOY = ROOT / "deploy"
VARIANTS = parse_variants((DEPLOY / "variants.txt").read_text().strip())
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir())  # variants.txt's and any other ready one
BUILDS = ["deploy", *(f"deploy/overlays/{name}" for name in OVERLAYS), "deploy/mesh", "deploy/flagger"]


def tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(str(Path(sys.executable).parent / name))
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} is needed in CI")
        pytest.skip(f"{name} is not installed")
    return found


def kustomize(path: str) -> list[dict]:
    out = subprocess.run([tool("kubectl"), "kustomize", str(ROOT / path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def everything() -> list[dict]:
    return kustomize("deploy")


@pytest.mark.parametrize("path", BUILDS)
def test_kustomize_builds_and_kubernetes_validate_passes_strictly(path, tmp_path):
    docs = kustomize(path)
    out = tmp_path / "out.yaml"
    out.write_text(yaml.safe_dump_all(docs))
    check = subprocess.run(
        [tool("kubernetes-validate"), "--strict", "-k", "1.32.0", "--quiet", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_kubernetes_validate_catches_a_field_that_does_not_exist(tmp_path):
    """The strict check is a real one: a misspelt field in a Deployment fails it."""
    (deployment,) = [d for d in kustomize(f"deploy/overlays/{VARIANTS[0].name}") if d["kind"] == "Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    out = tmp_path / "bad.yaml"
    out.write_text(yaml.safe_dump(deployment))
    check = subprocess.run([tool("kubernetes-validate"), "--strict", "-k", "1.32.0", str(out)], capture_output=True)
    assert check.returncode != 0


def _models(annotation) -> list[type]:
    """The pydantic models an annotation allows (through Optional, list, dict, unions)."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out = []
    for arg in typing.get_args(annotation):
        out += _models(arg)
    return out


def unknown_fields(model: type, data, path: str = "") -> list[str]:
    """Keys of `data` that `model` does not define (cloudcoil's models ignore them silently)."""
    if isinstance(data, list):
        return [u for i, item in enumerate(data) for u in unknown_fields(model, item, f"{path}[{i}]")]
    if not isinstance(data, dict):
        return []
    fields = {(f.alias or name): f.annotation for name, f in model.model_fields.items()}
    if not fields:  # a free-form map
        return []
    bad = []
    for key, value in data.items():
        if key not in fields:
            bad.append(f"{path}.{key}")
            continue
        annotation = fields[key]
        origin = typing.get_origin(annotation)
        if origin in (dict, typing.Dict) or (  # noqa: UP006
            origin in (typing.Union, types.UnionType)
            and any(typing.get_origin(a) is dict for a in typing.get_args(annotation))
        ):
            values = value.values() if isinstance(value, dict) else []
            candidates = _models(annotation)
            for v in values:
                if candidates:
                    bad += min((unknown_fields(c, v, f"{path}.{key}") for c in candidates), key=len)
            continue
        candidates = _models(annotation)
        if candidates:
            bad += min((unknown_fields(c, value, f"{path}.{key}") for c in candidates), key=len)
    return bad


def test_the_istio_objects_validate_against_cloudcoils_models_with_no_unknown_field(everything):
    from cloudcoil.models.istio.networking import v1

    istio = [d for d in everything if d["apiVersion"].startswith("networking.istio.io/")]
    assert sorted(d["kind"] for d in istio) == ["DestinationRule", "VirtualService"]
    for doc in istio:
        model = getattr(v1, doc["kind"])
        model.model_validate(doc)
        assert unknown_fields(model, doc) == [], doc["kind"]
    # The unknown-field check is a real one.
    bad = {**istio[0], "spec": {**istio[0]["spec"], "trafficPolicyy": {}}}
    assert unknown_fields(getattr(v1, bad["kind"]), bad) == [".spec.trafficPolicyy"]
    (vs,) = [d for d in istio if d["kind"] == "VirtualService"]
    deep = yaml.safe_load(yaml.safe_dump(vs))
    deep["spec"]["http"][-1]["route"][0]["destination"]["subsett"] = "x"
    last = len(deep["spec"]["http"]) - 1
    assert unknown_fields(v1.VirtualService, deep) == [f".spec.http[{last}].route[0].destination.subsett"]


def test_the_committed_istio_yaml_is_what_variants_txt_renders():
    text = (DEPLOY / "variants.txt").read_text()
    assert (DEPLOY / "mesh" / "istio.yaml").read_text() == render(text), (
        "deploy/mesh/istio.yaml is stale: "
        "python -m services.launcher.istio deploy/variants.txt > deploy/mesh/istio.yaml"
    )


def test_weights_subsets_and_labels_agree_everywhere(everything):
    names = [v.name for v in VARIANTS]
    cheapest = min(VARIANTS, key=lambda v: COST[v.quantize])
    by_kind: dict[str, list[dict]] = {}
    for doc in everything:
        by_kind.setdefault(doc["kind"], []).append(doc)
    # The top kustomization deploys every variant of variants.txt, and only those.
    top = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert sorted(r for r in top["resources"] if r.startswith("overlays/")) == sorted(f"overlays/{n}" for n in names)
    # Deployments: one per variant, its pods labelled for the subset, its llm quantized for it.
    deployments = {d["metadata"]["name"]: d for d in by_kind["Deployment"]}
    assert sorted(deployments) == sorted(f"vlmesh-worker-{n}" for n in names)
    for v in VARIANTS:
        pod = deployments[f"vlmesh-worker-{v.name}"]["spec"]["template"]
        assert pod["metadata"]["labels"][VARIANT_LABEL] == v.name
        llm = next(c for c in pod["spec"]["containers"] if c["name"] == "llm")
        args = llm["args"]
        assert args[args.index("--quantize") + 1] == v.quantize and args[args.index("--variant") + 1] == v.name
        # The costlier variants' gateways degrade to the cheapest, through the Service and its pin.
        gateway = next(c for c in pod["spec"]["containers"] if c["name"] == "gateway")["args"]
        if v is cheapest:
            assert "--degrade-target" not in gateway
        else:
            degrade = gateway[gateway.index("--degrade-target") + 1], gateway[gateway.index("--degrade-variant") + 1]
            assert degrade == ("vlmesh:50051", cheapest.name)
    # DestinationRule: a subset per variant, selecting exactly those pods.
    (rule,) = by_kind["DestinationRule"]
    assert {s["name"]: s["labels"] for s in rule["spec"]["subsets"]} == {n: {VARIANT_LABEL: n} for n in names}
    # VirtualService: a pin per variant, then the weights.
    (service,) = by_kind["VirtualService"]
    routes = service["spec"]["http"]
    pins = {
        r["match"][0]["headers"]["x-model-variant"]["exact"]: r["route"][0]["destination"]["subset"]
        for r in routes
        if r["name"].startswith("pinned-")
    }
    assert pins == {n: n for n in names}
    # A pin to a variant not served is answered 404 by the proxy, before the weights.
    (unknown,) = [r for r in routes if "directResponse" in r]
    assert unknown["directResponse"]["status"] == 404 and routes.index(unknown) == len(routes) - 2
    weights = {d["destination"]["subset"]: d["weight"] for d in routes[-1]["route"]}
    assert weights == percents(VARIANTS) and sum(weights.values()) == 100
    # The local Envoy, from the same description: the same split, the same pins.
    gateways = {n: [("127.0.0.1", 50000 + i)] for i, n in enumerate(names)}
    envoy = envoy_config(VARIANTS, gateways, ("127.0.0.1", 1), ("127.0.0.1", 2))
    layer = envoy["layered_runtime"]["layers"][0]["static_layer"]
    total = sum(v.weight for v in VARIANTS)
    for v in VARIANTS:
        assert (
            layer[f"{RUNTIME_PREFIX}.variant-{v.name}"] == layer[f"{RUNTIME_PREFIX}.http-variant-{v.name}"] == v.weight
        )
        assert abs(100 * v.weight / total - weights[v.name]) < 1
    # The Service reaches every variant's pods (the subsets choose among them).
    (svc,) = by_kind["Service"]
    for d in deployments.values():
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert all(labels.get(k) == val for k, val in svc["spec"]["selector"].items())


def kubernetes_pod_targets(deployment: dict, namespace: str, pod: str) -> list[dict]:
    """What Prometheus's Kubernetes discovery (role: pod) finds for one pod of `deployment`: a target per
    declared container port, with its __meta_kubernetes_* labels (those the scrape job reads)."""
    template = deployment["spec"]["template"]
    labels = {
        "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", k): v
        for k, v in template["metadata"]["labels"].items()
    }
    labels |= {"__meta_kubernetes_namespace": namespace, "__meta_kubernetes_pod_name": pod}
    return [
        {
            "targets": [f"10.0.0.1:{port['containerPort']}"],
            "labels": {
                **labels,
                "__meta_kubernetes_pod_container_name": c["name"],
                "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
            },
        }
        for c in template["spec"]["containers"]
        for port in c.get("ports", [])
    ]


def test_prometheus_scrapes_each_process_once(everything, tmp_path):
    """Prometheus relabels what it would discover of the worker pods with the scrape job: one target per
    process, its --metrics-port, labelled with its service, namespace and pod; none on gRPC or the HTTP
    door. No prometheus.io annotation invites a generic job to scrape every port. (Debian's promtool is
    built without Kubernetes discovery: a file lists the targets it would find.)"""
    (config,) = [d for d in everything if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-scrape")]
    (job,) = yaml.safe_load(config["data"]["scrape-config.yaml"])["scrape_configs"]
    assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
    assert f'up{{job="{job["job_name"]}"}}' in (ROOT / "observability" / "alerts.yml").read_text()
    discovered, want = [], []
    for deployment in (d for d in everything if d["kind"] == "Deployment"):
        template = deployment["spec"]["template"]
        assert not [a for a in template["metadata"].get("annotations", {}) if a.startswith("prometheus.io/")]
        pod = deployment["metadata"]["name"] + "-5d8f7c9b6-x7k2p"
        discovered += kubernetes_pod_targets(deployment, "vlmesh", pod)
        containers = template["spec"]["containers"]
        assert sorted(c["name"] for c in containers) == ["gateway", "llm", "vision"]  # observability/'s services
        for c in containers:
            want.append((c["name"], f"10.0.0.1:{c['args'][c['args'].index('--metrics-port') + 1]}", "vlmesh", pod))
    (tmp_path / "targets.json").write_text(json.dumps(discovered))
    job["file_sd_configs"] = [{"files": [str(tmp_path / "targets.json")]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({"scrape_configs": [job]}))
    check = [tool("promtool"), "check", "service-discovery", "--timeout=5s", str(tmp_path / "prometheus.yml")]
    out = subprocess.run([*check, job["job_name"]], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    kept = [t["labels"] for t in json.loads(out.stdout) if t["labels"]]  # a dropped target has no labels
    scraped = [(t["service"], t["__address__"], t["namespace"], t["pod"]) for t in kept]
    assert sorted(scraped) == sorted(want)


def test_percents_add_up_to_100():
    assert percents(parse_variants("full=70,int8=30")) == {"full": 70, "int8": 30}
    assert percents(parse_variants("full=1,int8=1,int4=1")) == {"full": 34, "int8": 33, "int4": 33}
    assert sum(percents(parse_variants("full=2,int8=7")).values()) == 100


# ---- deploy/flagger: a Blue/Green Canary per variant (services/launcher/flagger.py) ----


def test_the_committed_flagger_files_are_what_variants_txt_renders():
    from services.launcher.flagger import render as render_flagger

    for name, text in render_flagger((DEPLOY / "variants.txt").read_text()).items():
        assert (DEPLOY / "flagger" / name).read_text() == text, (
            f"deploy/flagger/{name} is stale: python -m services.launcher.flagger deploy/variants.txt deploy/flagger"
        )


def flagger_primary_labels(template_labels: dict) -> dict:
    """The labels of the pods Flagger makes for a Deployment's primary: its selector label gets `-primary`."""
    from services.launcher.flagger import SELECTOR_LABEL

    return {**template_labels, SELECTOR_LABEL: template_labels[SELECTOR_LABEL] + "-primary"}


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_each_canary_rolls_out_its_variant_and_the_split_reaches_only_primaries():
    import shlex

    from google.protobuf import json_format
    from PIL import Image

    from services.launcher.flagger import GATEWAY_PORT, NAMESPACE, SELECTOR_LABEL, worker
    from vlmesh.v1 import gateway_pb2

    docs = kustomize("deploy/flagger")
    by_kind: dict[str, dict[str, dict]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], {})[doc["metadata"]["name"]] = doc
    top = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["resources"]
    ours = yaml.safe_load((DEPLOY / "flagger" / "kustomization.yaml").read_text())["resources"]
    assert ours == [f"../{r}" for r in top] + ["canaries.yaml"], "deploy/flagger deploys what deploy/ does"
    assert sorted(by_kind["Canary"]) == sorted(worker(v.name) for v in VARIANTS)
    (rule,) = by_kind["DestinationRule"].values()
    subsets = {s["name"]: s["labels"] for s in rule["spec"]["subsets"]}
    (service,) = by_kind["Service"].values()
    for v in VARIANTS:
        name = worker(v.name)
        spec = by_kind["Canary"][name]["spec"]
        assert spec["provider"] == "kubernetes" and "stepWeight" not in spec["analysis"]  # Blue/Green, no VS
        deployment = by_kind["Deployment"][spec["targetRef"]["name"]]
        assert deployment["metadata"]["name"] == name
        assert deployment["spec"]["selector"]["matchLabels"][SELECTOR_LABEL] == name
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert labels[SELECTOR_LABEL] == name
        hpa = by_kind["HorizontalPodAutoscaler"][spec["autoscalerRef"]["name"]]
        assert hpa["spec"]["scaleTargetRef"]["name"] == name
        gateway = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "gateway")
        port = next(p for p in gateway["ports"] if p["name"] == spec["service"]["targetPort"])
        assert port["containerPort"] == spec["service"]["port"] == GATEWAY_PORT
        # The variant's subset takes its primary's pods and not the canary's, nor another variant's.
        primary = flagger_primary_labels(labels)
        assert [s for s, sel in subsets.items() if selects(sel, primary)] == [v.name]
        assert not any(selects(sel, labels) for sel in subsets.values())
        assert selects(service["spec"]["selector"], primary)
        # The disruption budget and the network policy cover the primary's pods too.
        assert selects(by_kind["PodDisruptionBudget"][name]["spec"]["selector"]["matchLabels"], primary)
        assert selects(by_kind["NetworkPolicy"][name]["spec"]["podSelector"]["matchLabels"], primary)
        for metric in spec["analysis"]["metrics"]:
            assert metric["templateRef"]["name"] in by_kind["MetricTemplate"]
        # The load test calls the canary's Service with a request the gateway's proto accepts.
        (hook,) = spec["analysis"]["webhooks"]
        argv = shlex.split(hook["metadata"]["cmd"])
        assert argv[0] == "ghz" and argv[-1] == f"{name}-canary.{NAMESPACE}:{GATEWAY_PORT}"
        assert argv[argv.index("--call") + 1] == "vlmesh.v1.Gateway/GenerateUnary"
        request = json_format.Parse(argv[argv.index("-d") + 1], gateway_pb2.GenerateRequest())
        assert request.sampling.max_tokens == 16 and request.prompt
        Image.open(io.BytesIO(request.images[0].data)).verify()


def test_the_canary_queries_select_the_canarys_pods_and_compute_what_they_say(tmp_path):
    """promtool evaluates the MetricTemplates' PromQL (Flagger's variables filled in) over series of the
    canary's pods, its primary's and another service's: only the canary's gateway counts."""
    from services.launcher.flagger import ERROR_RATIO_QUERY, P99_QUERY

    def query(template: str) -> str:
        values = {"namespace": "vlmesh", "target": "vlmesh-worker-int8", "interval": "1m"}
        for key, value in values.items():
            template = template.replace("{{ %s }}" % key, value)  # noqa: UP031 (Flagger's placeholders)
        assert "{{" not in template
        return template

    canary, primary = "vlmesh-worker-int8-5d8f7c9b6-x7k2p", "vlmesh-worker-int8-primary-7c9d8f6b5-q4m8z"

    def requests(pod: str, code: str, per_15s: float, service: str = "gateway") -> dict:
        labels = f'namespace="vlmesh",pod="{pod}",service="{service}",method="GenerateUnary",code="{code}"'
        return {"series": f"vlmesh_requests_total{{{labels}}}", "values": f"0+{per_15s}x40"}

    def buckets(pod: str, per_15s: dict[str, float]) -> list[dict]:
        return [
            {"series": f'vlmesh_request_duration_seconds_bucket{{namespace="vlmesh",pod="{pod}",le="{le}"}}',
             "values": f"0+{n}x40"}
            for le, n in per_15s.items()
        ]  # fmt: skip

    fast = {"0.1": 0, "0.25": 150, "+Inf": 150}  # every canary request in (0.1, 0.25] s
    slow = {"0.1": 0, "0.25": 0, "+Inf": 150}  # the primary's: slower than any bound
    tests = [
        {
            "interval": "15s",
            "input_series": [
                requests(canary, "OK", 150),  # 10/s
                requests(canary, "INTERNAL", 1.5),  # 0.1/s: 0.99% of the 10.1/s answered
                requests(canary, "CANCELLED", 15),  # the load test's own cancels: not answered
                requests(canary, "INTERNAL", 150, service="llm"),  # the llm's own calls: not the gateway's
                requests(primary, "INTERNAL", 150),  # the primary's errors: not the canary's
                *buckets(canary, fast),
                *buckets(primary, slow),
            ],
            "promql_expr_test": [
                {"expr": query(ERROR_RATIO_QUERY), "eval_time": "5m", "exp_samples": [{"value": 100 * 0.1 / 10.1}]},
                {"expr": query(P99_QUERY), "eval_time": "5m", "exp_samples": [{"value": 1000 * (0.1 + 0.15 * 0.99)}]},
            ],
        },
        {  # no error series at all is a ratio of 0, not no value
            "interval": "15s",
            "input_series": [requests(canary, "OK", 150)],
            "promql_expr_test": [{"expr": query(ERROR_RATIO_QUERY), "eval_time": "5m", "exp_samples": [{"value": 0}]}],
        },
    ]
    (tmp_path / "rules.yaml").write_text("groups: []\n")
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "tests": tests}))
    promtool = [tool("promtool"), "test", "rules", str(tmp_path / "test.yaml")]
    out = subprocess.run(promtool, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_split_component_gives_each_worker_two_gpus_vision_on_the_first_llm_on_the_second(tmp_path):
    """deploy/components/split over the whole mesh: every worker claims the GPU pair, its vision and
    llm both list the claim (so the llm can open the vision's GPU memory), on cuda:0 and cuda:1; the
    output passes the strict check. Without the component the workers keep one GPU."""
    root = tmp_path / "split"
    root.mkdir()
    rel = lambda p: os.path.relpath(DEPLOY / p, root)  # noqa: E731
    (root / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {rel('.')}\ncomponents:\n  - {rel('components/split')}\n"
    )
    out = subprocess.run([tool("kubectl"), "kustomize", str(root)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    (pair,) = [d for d in docs if d["kind"] == "ResourceClaimTemplate" and d["metadata"]["name"] == "vlmesh-gpu-pair"]
    assert pair["spec"]["spec"]["devices"]["requests"][0]["count"] == 2
    workers = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].startswith("vlmesh-worker")]
    assert {w["metadata"]["name"] for w in workers} == {f"vlmesh-worker-{v.name}" for v in VARIANTS}
    for worker in workers:
        pod = worker["spec"]["template"]["spec"]
        assert [c["resourceClaimTemplateName"] for c in pod["resourceClaims"]] == ["vlmesh-gpu-pair"]
        containers = {c["name"]: c for c in pod["containers"]}
        for name, device in (("vision", "cuda:0"), ("llm", "cuda:1")):
            args = containers[name]["args"]
            assert args[args.index("--device") + 1] == device, (worker["metadata"]["name"], name, args)
            assert containers[name]["resources"]["claims"] == [{"name": pod["resourceClaims"][0]["name"]}]
        assert "--device" not in containers["gateway"]["args"]
    (plain,) = [d for d in kustomize(f"deploy/overlays/{VARIANTS[0].name}") if d["kind"] == "Deployment"]
    assert plain["spec"]["template"]["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] == "vlmesh-gpu"
    (tmp_path / "out.yaml").write_text(out.stdout)
    check = subprocess.run(
        [tool("kubernetes-validate"), "--strict", "-k", "1.32.0", "--quiet", str(tmp_path / "out.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stdout + check.stderr
