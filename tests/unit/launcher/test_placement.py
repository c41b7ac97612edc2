"""`--placement` and `--gpus`: what each placement makes of the options, the errors before anything
starts, and Envoy's config for replicas of one variant (checked by Envoy itself)."""

from __future__ import annotations

import json
import subprocess

import pytest

from services.launcher import placement
from services.launcher.envoy import envoy_config
from services.launcher.routing import Variant
from services.launcher.variants import envoy_binary
from tests.helpers import mesh_options


@pytest.mark.parametrize(
    "how, gpus, device, variants, message",
    [
        ("single", "0,1", "cuda", None, "--gpus: name a --placement"),
        ("split", "0", "cuda", None, r"split takes two GPUs, the vision's and the llm's \(--gpus 0,1\), not \[0\]"),
        ("split", "0,1,2", "cuda", None, "split takes two GPUs"),
        ("split", "0,1", "cpu", None, "not with --device cpu"),
        ("replicate", "3", "cuda", None, r"replicate takes two GPUs or more \(--gpus 0,1\), not \[3\]"),
        ("replicate", "0,1", "cuda", "full=70,int8=30", "not with --variants yet"),
        ("replicate", "0,x", "cuda", None, "expected GPU indices"),
        ("replicate", "1,1", "cuda", None, "each GPU once"),
        ("spread", "0,1", "cuda", None, "use one of single, split, replicate"),
    ],
)
def test_placements_that_cannot_work_are_refused_naming_the_flag(how, gpus, device, variants, message):
    with pytest.raises(ValueError, match=message):
        placement.check_placement(how, gpus, device, variants)


def test_split_puts_the_vision_on_the_first_gpu_and_the_llm_on_the_second():
    opts = placement.split(mesh_options("models/demo", device="cuda", placement="split", gpus="1,0"))
    assert (opts.vision.model.device, opts.llm.model.device) == ("cuda:1", "cuda:0")


def test_replicate_makes_a_device_per_gpu_and_cpu_workers_on_the_cpu():
    on_gpus = mesh_options("models/demo", device="cuda", placement="replicate", gpus="0,1,3")
    assert placement.replica_devices(on_gpus) == ["cuda:0", "cuda:1", "cuda:3"]
    on_cpu = mesh_options("models/demo", placement="replicate", gpus="0,1")
    assert placement.replica_devices(on_cpu) == ["cpu", "cpu"]


def test_the_options_check_refuses_a_bad_placement_before_any_child():
    with pytest.raises(ValueError, match="--placement split puts vision and llm on two GPUs"):
        mesh_options("models/demo", placement="split", gpus="0,1")


def test_envoy_balances_replicas_by_least_request_and_accepts_one_variant(tmp_path):
    gateways = {"full": [("127.0.0.1", 11), ("127.0.0.1", 12)]}
    config = envoy_config([Variant("full", 100)], gateways, ("127.0.0.1", 3), ("127.0.0.1", 4))
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    assert set(clusters) == {"variant-full", "pinned-full"}
    for cluster in clusters.values():
        assert cluster["lb_policy"] == "LEAST_REQUEST"
        (only,) = cluster["load_assignment"]["endpoints"]  # one variant: no failover priority
        ports = [e["endpoint"]["address"]["socket_address"]["port_value"] for e in only["lb_endpoints"]]
        assert ports == [11, 12]
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(config))
    run = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
