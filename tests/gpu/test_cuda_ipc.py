"""CUDA IPC hand-off between two real processes on the GPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from services.common.errors import FailedPrecondition, Unavailable
from services.handoff.consumer import Consumer
from services.handoff.peer import call, connect, sha256, write
from services.launcher import Mesh
from tests.helpers import demo_answers, mesh_options, settle
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc, llm_pb2, llm_pb2_grpc, vision_pb2, vision_pb2_grpc

pytestmark = pytest.mark.gpu
CUDA, SHM, PEER = pb.TRANSPORT_CUDA_IPC, pb.TRANSPORT_SHM, pb.TRANSPORT_CUDA_IPC_PEER
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}


def start_peer(tmp_path, *args) -> tuple[subprocess.Popen, Path]:
    address = tmp_path / f"peer-{time.monotonic_ns()}.addr"
    proc = subprocess.Popen([sys.executable, "-m", "services.handoff.peer", str(address), *args], env=ENV, cwd=ROOT)
    return proc, address


@pytest.fixture
def peer(tmp_path, request):
    proc, address = start_peer(tmp_path, *getattr(request, "param", ()))
    conn = connect(address)
    yield proc, conn
    try:
        conn.send(("stop",))
        proc.wait(30)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait(30)


# 9 MiB slots: one [576, 4096] fp32 tensor is 9 MiB.
@pytest.mark.parametrize(
    "peer", [("--ready", "sync", "--slot-mib", "9"), ("--ready", "event", "--slot-mib", "9")], indirect=True
)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("transport", [CUDA, SHM])
def test_bit_exact(peer, dtype, transport):
    _, conn = peer
    consumer = Consumer(torch.device("cuda"))
    for seed in range(5):
        ref, digest, _ = write(conn, seed, (576, 4096), dtype, transport)
        assert ref.transport == transport
        out = consumer.open([ref]).tensors[0]
        assert out.device.type == ("cuda" if transport == CUDA else "cpu")
        assert sha256(out) == digest, "features changed on the way"
        assert call(conn, "release", ref.lease.id)
        with pytest.raises(FailedPrecondition, match="stale"):
            consumer.open([ref])
    assert call(conn, "stats")["leased"] == 0


two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs of one host"
)


@two_gpus
@pytest.mark.parametrize(
    "peer", [("--ready", "sync", "--slot-mib", "9"), ("--ready", "event", "--slot-mib", "9")], indirect=True
)
def test_another_gpu_reads_the_arena_over_the_peer_link_bit_exact(peer):
    """The producer on GPU 0, the consumer on GPU 1: negotiation picks the peer form, the copy
    lands on GPU 1 unchanged, and a released reference is refused as on one GPU."""
    _, conn = peer
    consumer = Consumer(torch.device("cuda:1"))
    stats = call(conn, "stats")
    if stats["gpu_uuid"] not in consumer.peer_gpu_uuids:
        pytest.skip("GPU 1 has no peer access to GPU 0")
    info = pb.ConsumerInfo(
        host_id=consumer.host, gpu_uuid=consumer.gpu_uuid, accept=consumer.transports,
        peer_gpu_uuids=consumer.peer_gpu_uuids,
    )  # fmt: skip
    from services.handoff.wire import choose_transport

    assert choose_transport(stats["host"], stats["gpu_uuid"], (CUDA, PEER, SHM), info) == PEER
    for seed in range(5):
        ref, digest, _ = write(conn, seed, (576, 4096), "bfloat16", PEER)
        opened = consumer.open([ref])
        out = opened.tensors[0]
        assert ref.transport == PEER and out.device == torch.device("cuda:1")
        torch.cuda.synchronize(1)
        opened.verify()  # the lease held while the copy ran
        assert sha256(out) == digest, "features changed on the way"
        assert call(conn, "release", ref.lease.id)
        with pytest.raises(FailedPrecondition, match="stale"):
            consumer.open([ref])
    assert call(conn, "stats")["leased"] == 0


CONSUMER = """
import sys, torch
from services.handoff.peer import call, connect, sha256, write
from services.handoff.consumer import Consumer
from vlmesh.v1 import common_pb2 as pb
from pathlib import Path
conn = connect(Path(sys.argv[1]))
consumer = Consumer(torch.device("cuda"))
worker, n = int(sys.argv[2]), int(sys.argv[3])
for i in range(n):
    ref, digest, _ = write(conn, worker * 100000 + i, (576, 1024), "bfloat16", pb.TRANSPORT_CUDA_IPC)
    assert sha256(consumer.open([ref]).tensors[0]) == digest, f"corrupted at {i}"
    assert call(conn, "release", ref.lease.id)
print("ok", n)
"""


def test_1000_handoffs_8_concurrent_consumers(tmp_path):
    proc, address = start_peer(tmp_path, "--slots", "8", "--slot-mib", "1.2")
    try:
        consumers = [
            subprocess.Popen(
                [sys.executable, "-c", CONSUMER, str(address), str(w), "125"],
                env=ENV,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for w in range(8)
        ]
        for c in consumers:
            out, err = c.communicate(timeout=300)
            assert c.returncode == 0 and out.strip() == "ok 125", err[-2000:]
        conn = connect(address)
        assert call(conn, "stats")["leased"] == 0, "a slot leaked"
        conn.send(("stop",))
    finally:
        proc.wait(30)


KILLED_CONSUMER = """
import sys, time, torch
from services.handoff.peer import connect, write
from services.handoff.consumer import Consumer
from vlmesh.v1 import common_pb2 as pb
from pathlib import Path
conn = connect(Path(sys.argv[1]))
consumer = Consumer(torch.device("cuda"))
for i in range(4):
    consumer.open([write(conn, i, (576, 1024), "bfloat16", pb.TRANSPORT_CUDA_IPC)[0]])  # never released
print("holding", flush=True)
time.sleep(600)
"""


def test_leases_come_back_after_the_consumer_is_killed(tmp_path):
    proc, address = start_peer(tmp_path, "--slots", "4", "--slot-mib", "1.2", "--ttl", "2")
    try:
        victim = subprocess.Popen(
            [sys.executable, "-c", KILLED_CONSUMER, str(address)], env=ENV, cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        assert victim.stdout.readline().strip() == "holding"
        conn = connect(address)
        assert call(conn, "stats")["leased"] == 4
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        time.sleep(2.5)
        call(conn, "reap")
        assert call(conn, "stats")["leased"] == 0
        ref, digest, _ = write(conn, 9, (576, 1024), "bfloat16", CUDA)  # the arena serves again
        assert sha256(Consumer(torch.device("cuda")).open([ref]).tensors[0]) == digest
        conn.send(("stop",))
    finally:
        proc.wait(30)


def test_dead_producer_gives_unavailable(tmp_path):
    proc, address = start_peer(tmp_path, "--slots", "2", "--slot-mib", "1.2")
    conn = connect(address)
    consumer = Consumer(torch.device("cuda"))
    ref, digest, _ = write(conn, 1, (576, 1024), "bfloat16", CUDA)
    assert sha256(consumer.open([ref]).tensors[0]) == digest  # opened and cached
    ref2, _, _ = write(conn, 2, (576, 1024), "bfloat16", CUDA)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    time.sleep(3.5)  # past the heartbeat's staleness bound
    with pytest.raises(Unavailable, match="stopped"):
        consumer.open([ref2])


def test_mesh_on_gpu_uses_cuda_ipc_and_answers_like_the_cpu(tmp_path):
    """The demo model through the GPU mesh (CUDA IPC hand-off) gives the CPU engine's answers."""

    demo = ROOT / "models" / "demo"
    pics, jobs, expected = demo_answers(31337, 24)
    assert sum(e == p.answer(j[1]) for e, p, j in zip(expected, pics, jobs, strict=True)) >= 22
    opts = mesh_options(demo, device="cuda", dtype="float32", threads=0, extra_env={"NVIDIA_TF32_OVERRIDE": "0"})
    with Mesh(opts) as mesh:
        mesh.start(progress=lambda m: None)
        with grpc.insecure_channel(mesh.target("llm")) as lch, grpc.insecure_channel(mesh.target("vision")) as vch:
            info = llm_pb2_grpc.LlmStub(lch).Info(pb.InfoRequest(), timeout=10)
            assert info.transports[0] == CUDA and info.gpu_uuid
            consumer = pb.ConsumerInfo(host_id=info.host_id, gpu_uuid=info.gpu_uuid, accept=info.transports)
            enc = vision_pb2_grpc.VisionStub(vch).Encode(
                vision_pb2.EncodeRequest(images=[pb.Image(data=jobs[0][0])], consumer=consumer), timeout=30
            )
            assert enc.features[0].transport == CUDA
            reply = list(
                llm_pb2_grpc.LlmStub(lch).Generate(
                    llm_pb2.LlmGenerateRequest(
                        prompt="What is in the image?",
                        image_features=enc.features,
                        sampling=pb.SamplingParams(max_tokens=4),
                    ),
                    timeout=30,
                )
            )
            assert "".join(m.text for m in reply) == pics[0].answer("What is in the image?")
        with grpc.insecure_channel(mesh.target("gateway")) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            # All three classes: best-effort requests keep a copy of their in-place features (they
            # may be preempted after the lease is gone), the others read the slot only.
            levels = ("realtime", "standard", "best-effort")
            got = [
                stub.GenerateUnary(
                    gateway_pb2.GenerateRequest(
                        images=[pb.Image(data=d)], prompt=p, sampling=pb.SamplingParams(max_tokens=8)
                    ),
                    metadata=[("qos-level", levels[i % 3])],
                    timeout=60,
                ).text
                for i, (d, p) in enumerate(jobs)
            ]
        # The llm releases each lease after its prefill has read the slot in place: none is left.
        series = 'vlmesh_arena_pages{arena="cuda",state="leased"}'
        assert settle(mesh.metrics_ports["vision"], series, 0.0) == 0.0
    assert got == expected
