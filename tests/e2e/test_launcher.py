"""`vlmesh up`, `vlmesh generate` and `vlmesh demo` as a user runs them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services.launcher import Mesh, health_status
from tests.helpers import image_bytes, mesh_options, scrape
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc

VLMESH = [sys.executable, "-m", "services.cli"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def start_up(model, *extra, env=ENV) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [
            *VLMESH,
            "up",
            "--model",
            str(model),
            "--gateway-port",
            "0",
            "--vision-port",
            "0",
            "--llm-port",
            "0",
            "--metrics-ports",
            "0,0,0",
            "--warmup-requests",
            "2",
            "--log-level",
            "warning",
            "--threads",
            "1",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("gateway ready on "):
            return proc, line.split()[-1]
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"no ready line; stderr:\n{proc.stderr.read()}")


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_up_generate_and_ctrl_c(tiny_model, tmp_path):
    warm = tmp_path / "warm"
    warm.mkdir()
    (warm / "a.png").write_bytes(image_bytes(8))
    (warm / "b.webp").write_bytes(image_bytes(9, fmt="WEBP"))
    (warm / "notes.txt").write_text("not an image, skipped")
    proc, target = start_up(tiny_model, "--warmup-images", str(warm))
    try:
        check_ctrl_c_mesh(proc, target, tmp_path)
    finally:
        proc.kill()  # its children die with it


def check_ctrl_c_mesh(proc: subprocess.Popen, target: str, tmp_path: Path) -> None:
    kids = children(proc.pid)
    assert len(kids) == 3
    # The warm-up key reaches the gateway through its environment only: not on any command line.
    environ = {pid: dict(kv.split("=", 1) for kv in environ_of(pid)) for pid in kids}
    gateway = next(pid for pid in kids if "services.gateway" in Path(f"/proc/{pid}/cmdline").read_text())
    key = environ[gateway]["VLMESH_WARMUP_KEY"]
    assert len(key) >= 32
    assert all("VLMESH_WARMUP_KEY" not in environ[pid] for pid in kids if pid != gateway)
    assert all(key not in Path(f"/proc/{pid}/cmdline").read_text() for pid in [proc.pid, *kids])
    image = tmp_path / "pic.jpg"
    image.write_bytes(image_bytes(5, fmt="JPEG"))
    result = subprocess.run(
        [
            *VLMESH,
            "generate",
            "--image",
            str(image),
            "--prompt",
            "What is in the image?",
            "--target",
            target,
            "--max-tokens",
            "5",
            "--qos-level",
            "realtime",
            "--timings",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "5 tokens" in result.stderr and "prefill" in result.stderr
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    for pid in kids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def environ_of(pid: int) -> list[str]:
    return [kv for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv]


def test_warm_up_passes_tenant_auth_and_leaves_no_files(tiny_model, tmp_path):
    tenants = tmp_path / "tenants.json"
    tenants.write_text(
        json.dumps(
            {
                "tenants": [
                    {"id": "acme", "api_keys": ["sk-acme"], "max_qos": "standard", "requests_per_second": 1, "burst": 1}
                ]
            }
        )
    )
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc, _ = start_up(tiny_model, "--tenants", str(tenants), env={**ENV, "TMPDIR": str(scratch)})
    try:
        run_dirs = [p for p in scratch.iterdir() if p.name.startswith("vlmesh-")]
        assert len(run_dirs) == 1 and (run_dirs[0] / "warmup.png").is_file()  # the synthetic picture, in its dir
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()  # its children die with it
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("vlmesh")]


def test_launcher_names_the_child_that_died(tiny_model):
    proc, _ = start_up(tiny_model, "--restarts", "0")
    llm = [pid for pid in children(proc.pid) if "services.llm" in Path(f"/proc/{pid}/cmdline").read_text()]
    assert len(llm) == 1
    os.kill(llm[0], signal.SIGKILL)
    assert proc.wait(timeout=60) != 0
    assert "the llm process killed by SIGKILL (its log is above); not restarted: --restarts 0" in proc.stderr.read()


def test_empty_warmup_directory_is_an_error(tiny_model, tmp_path):
    result = subprocess.run(
        [
            *VLMESH,
            "up",
            "--model",
            str(tiny_model),
            "--gateway-port",
            "0",
            "--vision-port",
            "0",
            "--llm-port",
            "0",
            "--metrics-ports",
            "-1,-1,-1",
            "--warmup-images",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert result.returncode == 2
    assert "no image files there" in result.stderr


def test_bad_model_directory_fails_fast(tmp_path):
    result = subprocess.run(
        [*VLMESH, "up", "--model", str(tmp_path)], capture_output=True, text=True, env=ENV, timeout=60
    )
    assert result.returncode == 2
    assert "no config.json" in result.stderr


def test_a_bad_service_flag_fails_before_any_child_starts(tiny_model):
    result = subprocess.run(
        [*VLMESH, "up", "--model", str(tiny_model), "--max-llm-batch", "0", "--vllm-kv-cache-gib", "-1"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--max-llm-batch 0 must be >= 1; --vllm-kv-cache-gib -1.0 must be >= 0" in result.stderr
    assert "admission" not in result.stderr  # the flag the user typed, not the gateway's that follows it
    assert "starting vision" not in result.stderr


@pytest.mark.parametrize("value", ["1,2", "abc", "1,2,70000"])
def test_a_bad_metrics_ports_value_is_named(tiny_model, value):
    result = subprocess.run(
        [*VLMESH, "up", "--model", str(tiny_model), "--metrics-ports", value],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
    )
    assert result.returncode == 2
    want = f"vlmesh up: error: argument --metrics-ports: '{value}': expected three ports, gateway,vision,llm"
    assert result.stderr.splitlines()[-1].startswith(want)


def test_child_start_failure_is_reported(tiny_model, tmp_path):
    """A fault only a child finds (the launcher's checks of files, config and weights pass): the llm
    cannot build prompts without a chat template."""
    model = tmp_path / "no-template"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    ports = ["--gateway-port", "0", "--vision-port", "0", "--llm-port", "0", "--metrics-ports", "-1,-1,-1"]
    proc = subprocess.run(
        [*VLMESH, "up", "--model", str(model), *ports],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "process exited with code 2" in proc.stderr
    assert "the checkpoint has no chat template" in proc.stderr


def serve_gateway(*flags: str) -> subprocess.Popen:
    """A lone gateway (its peers need not exist: channels connect lazily)."""
    cmd = [sys.executable, "-m", "services.gateway", "--vision-target", "127.0.0.1:1", "--llm-target", "127.0.0.1:1"]
    return subprocess.Popen([*cmd, *flags], stderr=subprocess.PIPE, text=True, env=ENV)


def test_port_zero_reports_the_bound_ports_in_the_port_file(tmp_path):
    port_file = tmp_path / "ports.json"
    proc = serve_gateway("--port", "0", "--metrics-port", "0", "--port-file", str(port_file))
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.1)
        bound = json.loads(port_file.read_text())
        assert 0 < bound["port"] != bound["metrics_port"] > 0
        assert health_status(f"127.0.0.1:{bound['port']}") == health_pb2.HealthCheckResponse.SERVING
        assert "vlmesh_in_flight" in scrape(bound["metrics_port"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_sigterm_drains_in_flight_streams(tiny_model):
    with Mesh(mesh_options(tiny_model, warmup_requests=0, log_level="warning")) as mesh:
        mesh.start(progress=lambda m: None)
        gateway = next(c for c in mesh.children if c.name == "gateway")
        got: dict = {}
        first = threading.Event()

        def long_stream():
            with grpc.insecure_channel(mesh.target("gateway")) as ch:
                req = gateway_pb2.GenerateRequest(
                    images=[pb.Image(data=image_bytes(1))],
                    prompt="Describe the picture in detail.",
                    sampling=pb.SamplingParams(max_tokens=400, min_tokens=400),
                )
                for msg in gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=120):
                    first.set()
                    got["final"] = msg
                got["ended"] = time.monotonic()

        t = threading.Thread(target=long_stream)
        t.start()
        assert first.wait(60)
        gateway.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        t.join(120)
        assert got["ended"] > signalled, "the stream must still have been running at SIGTERM"
        assert got["final"].finish_reason == pb.FINISH_REASON_LENGTH
        assert got["final"].usage.output_tokens == 400
        assert gateway.proc.wait(timeout=30) == 0


@pytest.mark.timeout(300)
def test_demo_command_answers_the_picture():
    result = subprocess.run([*VLMESH, "demo"], capture_output=True, text=True, env=ENV, timeout=280)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    answer = next(line for line in lines if line.startswith("answer: ")).removeprefix("answer: ")
    truth = next(line for line in lines if "the picture shows" in line).split("'")[1]
    assert answer == truth
    assert "decode" in result.stdout and "stopping the mesh" in result.stdout
