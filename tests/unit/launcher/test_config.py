"""Typed configs as the one source of flags: config -> argv -> config, what `vlmesh up` passes on,
and each default declared once."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from services.common import lifeline
from services.common.config import LLM_MAX_BATCH, MESH_METRICS_PORTS, MESH_PORTS, ModelConfig, ServerConfig
from services.common.flags import flag_defaults, flag_specs, to_argv
from services.common.memory import Watermarks
from services.common.qos import QosLevel
from services.gateway import config as gateway_config
from services.gateway.config import AdmissionConfig, GatewayConfig, HttpConfig
from services.launcher import MeshOptions, cli, supervisor
from services.launcher.routing import parse_variants
from services.launcher.variants import variant_options
from services.llm import config as llm_config
from services.llm.config import LlmConfig
from services.vision import config as vision_config
from services.vision.config import VisionConfig

MODULES = {"gateway": gateway_config, "vision": vision_config, "llm": llm_config}
TENANTS = Path(tempfile.mkdtemp()) / "tenants.json"
TENANTS.write_text('{"tenants": [{"id": "a", "api_keys": ["k"]}]}')
PEM = TENANTS.parent / "pem"  # --tls-* check that their files hold PEM; these are not real keys
for name in ("cert", "key", "ca"):
    (PEM / name).parent.mkdir(exist_ok=True)
    (PEM / name).write_text(f"-----BEGIN {name.upper()}-----\n")
MODEL = ModelConfig(
    path="/models/x", device="cpu", dtype="float32", threads=3, memory_watermarks=Watermarks(0.5, 0.8, 0.99)
)


def custom_server(port: int) -> ServerConfig:
    return ServerConfig(
        host="0.0.0.0",
        port=port,
        log_level="debug",
        log_format="text",
        metrics_port=-1,
        grace_s=2.5,
        switch_interval_ms=0.25,
        gc_freeze=False,
        malloc_arenas=1,
        malloc_hold_mib=16,
        event_loop="asyncio",
        port_file="/tmp/ports.json",
        profile_host="/tmp/server.pstat",
        tls_cert=str(PEM / "cert"),
        tls_key=str(PEM / "key"),
        tls_ca=str(PEM / "ca"),
    )


CUSTOM = {
    "gateway": GatewayConfig(
        server=custom_server(1234),
        vision_target="10.0.0.2:7",
        llm_target="unix:/tmp/llm.sock",
        max_images=3,
        tenants=str(TENANTS),
        access_log=False,
        skip_cached_encode=False,
        image_key_cache=16,
        breaker_failures=2,
        breaker_cooldown_s=0.25,
        degrade_target="10.0.0.3:8",
        degrade_variant="int4",
        admission=AdmissionConfig(
            parallelism=3,
            max_in_flight={QosLevel.BEST_EFFORT: 5},
            stage_budgets_ms={"preprocess": 1.5, "vision": 0.1, "prefill": 7.0, "decode": 1e-3},
            class_scale={QosLevel.REALTIME: 2.0, QosLevel.STANDARD: 3.0, QosLevel.BEST_EFFORT: 1 / 3},
        ),
        http=HttpConfig(port=8080, image_urls=True, image_url_max_mib=2.5, image_url_timeout_s=0.5),
    ),
    "vision": VisionConfig(
        server=custom_server(0),
        model=MODEL,
        max_batch=7,
        graphs=False,
        gpu_resize=False,
        arena_slots=9,
        feature_cache_mib=7.5,
        lease_ttl_s=0.5,
        preprocess_workers=5,
        ready_signal="event",
    ),
    "llm": LlmConfig(
        server=custom_server(1),
        model=MODEL,
        max_batch=16,
        default_max_tokens=17,
        vision_target="127.0.0.1:9",
        vision_port_file="/tmp/vision.ports.json",
        vllm_kv_cache_gib=2.5,
        variant_name="int8-canary",
        native=llm_config.NativeEngineConfig(
            max_prefill_tokens=512,
            kv_page_size=32,
            kv_cache_gib=1.5,
            gpu_memory_utilization=0.5,
            enforce_eager=True,
            quantize="int8",
            prefill="packed",
            prefix_cache=False,
            skinny_gemv=False,
            step_trace="/tmp/steps.jsonl",
        ),
    ),
}


def reparse(name: str, argv: list[str]):
    return MODULES[name].parse(argv)


def pairs(argv: list[str]) -> dict[str, str]:
    """flag -> value; a boolean flag (--name / --no-name) -> itself, under --name."""
    out, i = {}, 0
    while i < len(argv):
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[argv[i]], i = argv[i + 1], i + 2
        else:
            out[argv[i].replace("--no-", "--", 1)], i = argv[i], i + 1
    return out


@pytest.mark.parametrize("name", MODULES)
def test_config_argv_round_trip(name):
    cfg = CUSTOM[name]
    cfg.check()
    assert reparse(name, to_argv(cfg)) == cfg
    default = reparse(name, [] if name == "gateway" else ["--model", "/models/default"])
    assert reparse(name, to_argv(default)) == default
    # CUSTOM sets every flag, each (but the one-choice engines) away from its default: the round
    # trip covers them all.
    got, base = pairs(to_argv(cfg)), pairs(to_argv(default))
    assert set(got) == {spec.name for spec in flag_specs(type(cfg)).values()}
    assert [k for k in got if got[k] == base.get(k)] in ([], ["--vision-engine"], ["--llm-engine"])


def test_admission_limits_scale_with_the_batch_and_round_trip():
    adm = CUSTOM["gateway"].admission
    assert adm.max_in_flight == {QosLevel.REALTIME: 24, QosLevel.STANDARD: 18, QosLevel.BEST_EFFORT: 5}
    assert AdmissionConfig().max_in_flight == {QosLevel.REALTIME: 64, QosLevel.STANDARD: 48, QosLevel.BEST_EFFORT: 24}


def test_checks_keep_their_messages():
    with pytest.raises(ValueError, match=r"--vllm-kv-cache-gib -1.0 must be >= 0"):
        llm_config.parse(["--model", "m", "--vllm-kv-cache-gib", "-1"])
    with pytest.raises(ValueError, match=r"--threads -1 must be >= 0"):
        vision_config.parse(["--model", "m", "--threads", "-1"])
    with pytest.raises(ValueError, match=r"--max-in-flight 'urgent=3'"):
        gateway_config.parse(["--max-in-flight", "urgent=3"])
    with pytest.raises(ValueError, match=r"--start-timeout-s 0.0 must be > 0"):
        MeshOptions.from_flags(["--start-timeout-s", "0"], model="models/demo")
    # The server flags every service shares (ServerConfig.check), each refused at start-up.
    for argv, message in (
        (["--metrics-port", "-2"], r"--metrics-port -2: a TCP port"),
        (["--grace-s", "-1"], r"--grace-s -1.0 must be >= 0"),
        (["--malloc-arenas", "-1"], r"--malloc-arenas -1 must be >= 0"),
        (["--malloc-hold-mib", "2048"], r"--malloc-hold-mib 2048 must be in \[0, 2048\)"),
        (["--switch-interval-ms", "0"], r"--switch-interval-ms 0.0 must be in \(0, 100\]"),
    ):
        for parse in (vision_config.parse, llm_config.parse):
            with pytest.raises(ValueError, match=message):
                parse(["--model", "m", *argv])
        with pytest.raises(ValueError, match=message):
            gateway_config.parse(argv)
    with pytest.raises(ValueError, match=r"--image-key-cache 0 must be >= 1"):
        gateway_config.parse(["--image-key-cache", "0"])


def test_up_parser_exposes_every_flag_it_passes_on():
    up = {a.dest: a for a in cli.build_parser()._actions}
    for name, dests in cli.PASSED_ON.items():
        service = flag_specs(cli.CONFIGS[name])
        for dest in dests:
            assert dest in up and dest in service, (name, dest)
            assert up[dest].option_strings[0] == service[dest].name  # a bool also has its --no- form
    assert "vllm_kv_cache_gib" in cli.PASSED_ON["llm"] and "access_log" in cli.PASSED_ON["gateway"]


def test_up_passes_its_flags_to_each_child():
    argv = ["--model", "/m", "--host", "0.0.0.0", "--log-level", "debug", "--event-loop", "asyncio"]
    argv += ["--device", "cpu", "--dtype", "float32", "--threads", "2", "--max-vision-batch", "3"]
    argv += ["--ready-signal", "event", "--llm-engine", "native", "--max-llm-batch", "5"]
    argv += ["--vllm-kv-cache-gib", "1.5", "--tenants", str(TENANTS), "--max-in-flight", "best-effort=4"]
    argv += ["--vision-port", "0", "--metrics-ports", "1,-1,0", "--step-trace", "/tmp/steps.jsonl"]
    opts = cli.options_from_args(cli.build_parser().parse_args(argv))
    for name, cfg in opts.configs().items():
        assert cfg.server.host == "0.0.0.0" and cfg.server.log_level == "debug"
        assert cfg.server.event_loop == "asyncio"
        assert reparse(name, to_argv(cfg)) == cfg  # what the child parses is what the launcher meant
    assert (opts.vision.server.port, opts.llm.server.port) == (0, llm_config.DEFAULT_PORT)
    assert [c.server.metrics_port for c in opts.configs().values()] == [1, -1, 0]
    assert opts.vision.model == opts.llm.model == ModelConfig(path="/m", device="cpu", dtype="float32", threads=2)
    assert (opts.vision.max_batch, opts.vision.ready_signal) == (3, "event")
    assert (opts.llm.max_batch, opts.llm.vllm_kv_cache_gib) == (5, 1.5)
    assert opts.llm.native.step_trace == "/tmp/steps.jsonl"  # what vlmesh bench --mesh-flags can ask for
    assert supervisor.profile_path(opts, "llm") is None
    profiled = cli.options_from_args(cli.build_parser().parse_args([*argv, "--profile-host", "/tmp/prof"]))
    assert supervisor.profile_path(profiled, "vision") == "/tmp/prof/vision.pstat"
    # Behind Envoy each worker's llm traces to a file of its own, and each server profiles to its own.
    full, int8 = parse_variants("full=70,int8=30")
    assert variant_options(opts, full).llm.native.step_trace == "/tmp/steps.jsonl.full"
    assert variant_options(opts, int8, "cuda:1").llm.native.step_trace == "/tmp/steps.jsonl.int8.cuda1"
    assert supervisor.profile_path(variant_options(profiled, int8), "gateway") == "/tmp/prof/int8/gateway.pstat"
    replica = variant_options(profiled, full, "cuda:1")  # a replica of the same variant: its own directory
    assert supervisor.profile_path(replica, "llm") == "/tmp/prof/full.cuda1/llm.pstat"
    assert opts.gateway.tenants == str(TENANTS)
    assert opts.gateway.admission.parallelism == 5  # the llm's batch
    assert opts.gateway.admission.max_in_flight == {
        QosLevel.REALTIME: 40,
        QosLevel.STANDARD: 30,
        QosLevel.BEST_EFFORT: 4,
    }


def test_up_rejects_a_bad_service_value_with_the_services_message():
    with pytest.raises(ValueError, match="--max-llm-batch 0 must be >= 1"):
        MeshOptions.from_flags(model="/m", max_llm_batch=0)
    with pytest.raises(ValueError, match="--arena-slots 3 must be >= --max-vision-batch 4"):
        MeshOptions.from_flags(model="/m", arena_slots=3)  # a flag up now passes on, checked as the vision does
    with pytest.raises(TypeError, match="port_file"):
        MeshOptions.from_flags(model="/m", port_file="x")  # the launcher's to set, never a user's


def test_each_default_is_declared_once():
    up = vars(cli.build_parser().parse_args(["--model", "m"]))
    for name, dests in cli.PASSED_ON.items():
        defaults, specs = flag_defaults(cli.CONFIGS[name]), flag_specs(cli.CONFIGS[name])
        for dest in dests:
            if dest == "model":
                continue
            parse = specs[dest].parse  # a structured flag: argparse holds its text
            want = defaults[dest]
            assert (parse(up[dest]) if parse else up[dest]) == want or dest == "max_in_flight"  # scales with the batch
    opts = cli.options_from_args(up)
    assert opts.llm.max_batch == llm_config.DEFAULT_MAX_BATCH == LLM_MAX_BATCH == AdmissionConfig().parallelism
    assert opts.gateway.admission == GatewayConfig().admission
    assert opts.vision.max_batch == vision_config.DEFAULT_MAX_BATCH
    for name, module in MODULES.items():
        assert up[f"{name}_port"] == module.DEFAULT_PORT == MESH_PORTS[name]
        assert opts.configs()[name].server.port == module.DEFAULT_PORT
        assert opts.configs()[name].server.metrics_port == module.DEFAULT_METRICS_PORT == MESH_METRICS_PORTS[name]
    gateway = GatewayConfig()
    assert gateway.vision_target.endswith(f":{vision_config.DEFAULT_PORT}")
    assert gateway.llm_target.endswith(f":{llm_config.DEFAULT_PORT}")
    assert gateway_config.DEFAULT_TARGET.endswith(f":{gateway_config.DEFAULT_PORT}")


def test_children_are_started_with_their_configs_argv(monkeypatch):
    spawned = {}

    class FakeProc:
        pid = 0  # no process: no shared memory of its own to remove at stop

        def __init__(self, cmd, env, start_new_session):  # no preexec_fn: lifeline.py says why
            assert start_new_session  # own session
            # Through the lifeline, which ties the child to this launcher, then execs it.
            assert cmd[:4] == [sys.executable, "-I", lifeline.__file__, str(os.getpid())]
            spawned[cmd[6].removeprefix("services.")] = cmd[7:]

        def poll(self):
            return 0

    monkeypatch.setattr(supervisor.subprocess, "Popen", FakeProc)
    opts = MeshOptions.from_flags(model="/m", gateway_port=0, vision_port=0, llm_port=0, max_llm_batch=3)
    mesh = supervisor.Mesh(opts)
    try:
        mesh._spawn("vision", opts.vision)
        mesh._spawn("llm", mesh._llm_config())
    finally:
        mesh.stop()
    llm, vision = llm_config.parse(spawned["llm"]), vision_config.parse(spawned["vision"])
    # Port 0 goes to each child as 0: it binds a free port itself and reports it in its port file.
    assert llm.server.port == vision.server.port == 0 and llm.server.port_file != vision.server.port_file
    # The llm learns the vision's port from the vision's port file, its host from --vision-target.
    assert (llm.vision_target, llm.vision_port_file) == ("127.0.0.1", vision.server.port_file)
    assert llm.max_batch == 3
    assert dataclasses.replace(llm, server=opts.llm.server, vision_target=None, vision_port_file=None) == opts.llm
    assert dataclasses.replace(vision, server=opts.vision.server) == opts.vision


def test_the_launcher_imports_no_servicer_engine_or_torch():
    code = (
        "import sys, services.launcher; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('services.model', 'services.handoff')) "
        "or m.endswith(('.servicer', '.engine', '.admission', '.server')) and m != 'services.common.server']; "
        "print(bad); sys.exit(bool(bad))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "flags",
    [
        ["--device", "cpu", "--quantize", "fp8"],
        ["--device", "cpu", "--variants", "full=30,fp8=70"],
        pytest.param(
            ["--quantize", "fp8"],  # --device auto: the CPU on this host
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="auto picks the GPU on this host"),
        ),
    ],
)
def test_up_refuses_fp8_on_the_cpu_before_any_child_starts(flags, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli._checked_options(["--model", "models/demo", *flags])
    assert exit_.value.code == 2
    assert "fp8 needs a CUDA GPU of compute capability 8.9+" in capsys.readouterr().err


def test_up_refuses_a_variant_that_would_round_fp8_codes_twice(tmp_path, capsys):
    """--variants names int8 beside full on a checkpoint stored in fp8: refused before any child starts."""
    from services.model.stored_fp8 import store_fp8
    from services.model.tiny import build_tiny_llava

    model = build_tiny_llava(tmp_path / "fp8", seed=0)
    store_fp8(model)
    with pytest.raises(SystemExit) as exit_:
        cli._checked_options(["--model", str(model), "--device", "cpu", "--variants", "full=70,int8=30"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"--model: {model}: its decoder is stored in fp8 (compressed-tensors); --quantize int8 would round" in err
