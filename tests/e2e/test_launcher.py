"""`vlmesh up`, `vlmesh generate` and `vlmesh demo` as a user runs them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services.launcher import Mesh, free_port, health_status, reserve_port
from tests.helpers import image_bytes, mesh_options, scrape
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc

VLMESH = [sys.executable, "-m", "services.cli"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def start_up(model, *extra) -> tuple[subprocess.Popen, str]:
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
        env=ENV,
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
    kids = children(proc.pid)
    assert len(kids) == 3
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


def test_launcher_names_the_child_that_died(tiny_model):
    proc, _ = start_up(tiny_model)
    llm = [pid for pid in children(proc.pid) if "services.llm" in Path(f"/proc/{pid}/cmdline").read_text()]
    assert len(llm) == 1
    os.kill(llm[0], signal.SIGKILL)
    assert proc.wait(timeout=60) != 0
    assert "the llm process killed by SIGKILL" in proc.stderr.read()


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


def test_a_bad_service_flag_fails_before_any_child_starts(tmp_path):
    result = subprocess.run(
        [*VLMESH, "up", "--model", str(tmp_path), "--max-llm-batch", "0", "--vllm-kv-cache-gib", "-1"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--max-llm-batch 0 must be >= 1; --vllm-kv-cache-gib -1.0 must be >= 0" in result.stderr
    assert "starting vision" not in result.stderr


def test_child_start_failure_is_reported(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    proc = subprocess.run(
        [*VLMESH, "up", "--model", str(tmp_path), "--gateway-port", "0", "--vision-port", "0", "--llm-port", "0"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "process exited with code 2" in proc.stderr
    assert "expected 'llava'" in proc.stderr


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


def test_a_port_in_use_fails_with_a_clear_message():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = serve_gateway("--port", str(port), "--metrics-port", "-1")
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert f"cannot bind 127.0.0.1:{port}" in err


def test_a_reserved_port_is_taken_by_no_one_but_a_grpc_server():
    with reserve_port("127.0.0.1") as held:
        port = held.getsockname()[1]
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))  # what a connection's source port or another server would do
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
        try:
            assert server.add_insecure_port(f"127.0.0.1:{port}") == port  # gRPC binds with SO_REUSEPORT
        finally:
            server.stop(None)
    assert free_port("127.0.0.1") > 0


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
