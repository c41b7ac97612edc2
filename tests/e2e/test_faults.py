"""A service killed (SIGKILL) or stalled (SIGSTOP) under 16 streams: every stream ends with a
status soon after, `vlmesh up` restarts the service, the mesh answers again with the same gateway
address, and nothing of the mesh's is left in /dev/shm."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from tests.helpers import image_bytes
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc

VLMESH = [sys.executable, "-m", "services.cli"]
STREAMS = 16
# The internal channels' keepalive (1 s pings, 1 s to answer) ends calls on a stalled peer in
# about 2 s (the streams print when they ended). The bound is what a 2-core host running another
# test suite beside this one can keep; a stream left hanging would run into the 60 s join.
ENDS_WITHIN_S = 10.0
# A client of the public port cannot rely on the mesh for a stalled gateway: it pings as well.
CLIENT_OPTIONS = (
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 1000),
    ("grpc.http2.ping_timeout_ms", 1000),
)


def shm_of(pids: set[int]) -> set[str]:
    """The shared-memory segments these processes made (named vlmesh-PID-*: services/common/segments.py);
    another test run's beside this one are not counted."""
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return {n for n in names if n.startswith("vlmesh-") and int(n.split("-")[1]) in pids}


class Up:
    """`vlmesh up` on free ports; its stderr (the children's logs too) in a file."""

    def __init__(self, model: Path, tmp: Path) -> None:
        self.log = tmp / "up.log"
        cmd = [*VLMESH, "up", "--model", str(model), "--gateway-port", "0", "--vision-port", "0", "--llm-port", "0"]
        cmd += ["--metrics-ports", "-1,-1,-1", "--warmup-requests", "1", "--log-level", "warning", "--threads", "1"]
        cmd += ["--http-port", "0"]
        # Room in the latency budgets for 16 streams of 400 tokens on a busy host: admission would
        # refuse some at once, and this test is about the fault, not admission.
        cmd += ["--class-budget-scale", "realtime=100,standard=100,best-effort=400"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log.open("w"), text=True, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("gateway ready on "):
                self.target = line.split()[3].rstrip(";")
                self.http = line.split()[-1].removesuffix("/v1")
                return
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
        raise AssertionError("vlmesh up did not become ready")

    def pid(self, service: str) -> int:
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True, text=True).stdout
        pids = [int(p) for p in out.split() if f"services.{service}" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(pids) == 1, pids
        return pids[0]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        finally:
            self.proc.kill()


def request(max_tokens: int, image: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        images=[pb.Image(data=image_bytes(image))],
        prompt="Describe the picture in detail.",
        sampling=pb.SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens),
    )


def stream(target: str, i: int, started: threading.Barrier, out: dict) -> None:
    with grpc.insecure_channel(target, options=CLIENT_OPTIONS) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(request(400, 30 + i), timeout=120)
        try:
            try:
                next(call)
            except grpc.RpcError as err:  # before the fault: say so, not as a barrier that timed out
                out[i] = (f"before the fault: {err.code().name}: {err.details()}", time.monotonic())
                started.abort()
                return
            started.wait(timeout=60)
            for _ in call:
                pass
            out[i] = ("OK", time.monotonic())
        except grpc.RpcError as err:
            out[i] = (err.code().name, time.monotonic())
        except threading.BrokenBarrierError:
            out[i] = ("NEVER_STARTED", time.monotonic())


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
@pytest.mark.parametrize("service", ["llm", "vision", "gateway"])
def test_a_fault_ends_every_stream_and_the_mesh_heals(tiny_model, tmp_path, service, sig):
    up = Up(tiny_model, tmp_path)
    pids = {up.pid(name) for name in ("gateway", "vision", "llm")}
    try:
        started, out = threading.Barrier(STREAMS + 1), {}
        threads = [threading.Thread(target=stream, args=(up.target, i, started, out)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        try:
            started.wait(timeout=60)  # every stream has its first token: all 16 are decoding
        except threading.BrokenBarrierError:
            pytest.fail(f"not every stream started: {out}")
        victim = up.pid(service)
        os.kill(victim, sig)
        fault = time.monotonic()
        for t in threads:
            t.join(timeout=60)
        assert len(out) == STREAMS, out
        late = {
            i: (code, round(at - fault, 2))
            for i, (code, at) in out.items()
            if code != "OK" and at - fault > ENDS_WITHIN_S
        }
        assert not late, f"streams that ended later than {ENDS_WITHIN_S} s after the fault: {late}"
        print(
            {code: sum(1 for c, _ in out.values() if c == code) for code, _ in out.values()},
            "last end",
            round(max(at for _, at in out.values()) - fault, 2),
            "s after the fault",
        )
        # Restarted (a stalled one killed first), and the same gateway address answers again.
        deadline = time.monotonic() + 90
        while True:
            try:
                with grpc.insecure_channel(up.target) as channel:
                    answer = gateway_pb2_grpc.GatewayStub(channel).GenerateUnary(request(4, 99), timeout=10)
                    assert answer.usage.output_tokens == 4
                    break
            except grpc.RpcError:
                assert time.monotonic() < deadline, up.log.read_text()[-3000:]
                time.sleep(0.5)
        healed = time.monotonic() - fault
        assert up.pid(service) != victim
        pids |= {up.pid(service)}
        # The same HTTP port too, ready again once the gateway's next probes see its peers (0.5 s apart).
        deadline = time.monotonic() + 30
        while (health := httpx.get(f"{up.http}/health", timeout=5).json()) != {"status": "ok"}:
            assert time.monotonic() < deadline, health
            time.sleep(0.2)
        # The launcher says so once its own health check sees the new process serve, which can be
        # a moment after this client's first answer.
        said = f"{service} is serving again"
        deadline = time.monotonic() + 10
        while said not in (log := up.log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert f"the {service} process" in log and said in log, log[-3000:]
        print(f"{service} {sig.name}: answering again {healed:.1f} s after the fault")
    finally:
        up.stop()
    # The launcher unlinks what a killed (or stalled, then killed) process could not, as it sees it dead.
    assert shm_of(pids) == set(), "shared-memory segments left behind"
