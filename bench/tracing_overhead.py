"""Tracing's cost in the mesh: CPU time per request and sequential latency, tracing off vs on.

Latency under open-loop load is too noisy on a small shared machine to resolve a few percent,
so this measures what tracing adds directly: the CPU seconds the three servers spend per
request (from /proc, user + system) and the median latency of requests sent one at a time.
Tracing "on" exports every span to `bench/otlp_sink.py` (started here), which drops them, so
no trace backend's ingestion is charged to the mesh.

    python -m bench.tracing_overhead --model models/demo --requests 150 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

from services.launcher import Mesh, MeshOptions, free_port
from services.model.shapes import encode, render
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def run(model: str, n: int, env: dict[str, str]) -> tuple[float, float]:
    """Return (median latency ms, server CPU ms per request) for n sequential requests."""
    import numpy as np

    opts = MeshOptions.from_flags(
        model=model,
        gateway_port=0,
        vision_port=0,
        llm_port=0,
        metrics_ports=(-1, -1, -1),
        device="cpu",
        warmup_requests=5,
        log_level="warning",
        extra_env=env,
    )
    images = [encode(render(np.random.default_rng([5, i])).image.resize((224, 224)), "JPEG", 90) for i in range(n)]
    with Mesh(opts) as mesh:
        mesh.start(progress=lambda m: None)
        pids = [c.proc.pid for c in mesh.children]
        with grpc.insecure_channel(mesh.target("gateway")) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            before = sum(cpu_seconds(p) for p in pids)
            latencies = []
            for data in images:
                req = gateway_pb2.GenerateRequest(
                    images=[pb.Image(data=data)],
                    prompt="What is in the image?",
                    sampling=pb.SamplingParams(max_tokens=16, min_tokens=16, ignore_eos=True),
                )
                start = time.perf_counter()
                stub.GenerateUnary(req, timeout=60)
                latencies.append((time.perf_counter() - start) * 1000)
            time.sleep(1.0)  # let the batch span processors export what they hold
            cpu = sum(cpu_seconds(p) for p in pids) - before
    return statistics.median(latencies), cpu / n * 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/demo")
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    port = free_port("127.0.0.1")
    sink = subprocess.Popen(
        [sys.executable, "-m", "bench.otlp_sink", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    on = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}
    rows = []
    try:
        for i in range(args.repeats):
            for mode, env in (("off", {"OTEL_TRACES_EXPORTER": "none"}), ("on", on)):
                lat, cpu = run(args.model, args.requests, env)
                rows.append((mode, i, lat, cpu))
                print(
                    f"  {mode} #{i + 1}: median latency {lat:.1f} ms, server CPU {cpu:.2f} ms/request",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        sink.terminate()
    off = [r for r in rows if r[0] == "off"]
    on_ = [r for r in rows if r[0] == "on"]
    med = statistics.median
    lat_off, lat_on = med(r[2] for r in off), med(r[2] for r in on_)
    cpu_off, cpu_on = med(r[3] for r in off), med(r[3] for r in on_)
    print(f"{'tracing':<8}{'median latency (ms)':>22}{'server CPU per request (ms)':>30}")
    print(f"{'off':<8}{lat_off:>22.1f}{cpu_off:>30.2f}")
    print(f"{'on':<8}{lat_on:>22.1f}{cpu_on:>30.2f}")
    print(
        f"change: latency {100 * (lat_on / lat_off - 1):+.1f}%, server CPU {100 * (cpu_on / cpu_off - 1):+.1f}% "
        f"(medians of {args.repeats} interleaved runs of {args.requests} sequential requests)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
