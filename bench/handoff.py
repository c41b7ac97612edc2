"""Benchmark one feature hand-off between two processes: CUDA IPC, shared memory, inline bytes.

The tensor is one LLaVA-7B image's features: [576, 4096] bf16 (4.7 MB), made on the
producer's GPU, wanted on the consumer's GPU. Two figures per transport:
- host path: `Producer.export` in the producer (copy into a leased slot and signal
  readiness; for inline, the D2H copy and bytes) plus `Consumer.open` in the
  consumer (for host transports also the copy to the GPU, synchronised; for inline also
  protobuf serialisation and parsing of the reference). For CUDA IPC, open returns the
  producer's memory in place, ordered on the consumer's stream: nothing waits on the GPU.
- until read: host path, then the consumer copies the features into its own buffer (as
  the llm's prefill does into the prompt embeddings) and synchronises. This is when the
  data has really crossed, context switches between the two processes included.
The gRPC call that carries the reference is not included (it is the same for every
transport, except that inline also pushes the 4.7 MB through it).

With `--peer-gpu N` (a host with two GPUs) the producer stays on GPU 0 and the consumer of the
peer form of CUDA IPC and of shared memory moves to GPU N, so that one run compares the
cross-device hand-off with shared memory and with CUDA IPC on one GPU; every case checks the
features arrived bit-exact.

    python -m bench.handoff [--iters 300] [--peer-gpu 1] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from services.handoff.consumer import Consumer
from services.handoff.peer import call, connect, sha256, write
from vlmesh.v1 import common_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
SHAPE = (576, 4096)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def run_case(transport: int, ready: str, iters: int, warmup: int, device: torch.device) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        address = Path(tmp) / "peer.addr"
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.handoff.peer",
                str(address),
                "--ready",
                ready,
                "--slots",
                "8",
                "--slot-mib",
                "4.5",
            ],
            cwd=ROOT,
        )
        try:
            conn = connect(address)
            importer = Consumer(device)
            landing = torch.empty(SHAPE, dtype=torch.bfloat16, device=device)
            producer, consumer, read, first = [], [], [], None
            for i in range(warmup + iters):
                ref, digest, produced = write(conn, i, SHAPE, "bfloat16", transport)
                torch.cuda.synchronize(device)
                start = time.perf_counter()
                if transport == pb.TRANSPORT_INLINE:
                    ref = pb.TensorRef.FromString(ref.SerializeToString())
                opened = importer.open([ref])
                out = opened.tensors.pop()
                if out.device != device:
                    out = out.to(device)
                    torch.cuda.synchronize(device)
                took = time.perf_counter() - start
                landing.copy_(out)
                torch.cuda.synchronize(device)
                landed = time.perf_counter() - start
                if i == 0 and sha256(landing) != digest:
                    raise AssertionError(f"{pb.Transport.Name(transport)}: the features changed on the way")
                if ref.lease.id:
                    opened.verify()
                    call(conn, "release", ref.lease.id)
                # Nothing of one hand-off outlives its iteration: a copy is freed once it has landed
                # (4.7 MB buffers kept one iteration longer cost page faults in the next one).
                del opened
                if i == 0:
                    first = landed
                if i >= warmup:
                    producer.append(produced * 1e6)
                    consumer.append(took * 1e6)
                    read.append((produced + landed) * 1e6)
            conn.send(("stop",))
        finally:
            proc.wait(30)
    total = [p + c for p, c in zip(producer, consumer, strict=True)]
    return {
        "read_us_p50": statistics.median(read),
        "read_us_p99": pct(read, 0.99),
        "transport": pb.Transport.Name(transport).removeprefix("TRANSPORT_"),
        "ready": ready,
        "consumer_device": str(device),
        "producer_us_p50": statistics.median(producer),
        "producer_us_p99": pct(producer, 0.99),
        "consumer_us_p50": statistics.median(consumer),
        "consumer_us_p99": pct(consumer, 0.99),
        "total_us_p50": statistics.median(total),
        "total_us_p99": pct(total, 0.99),
        "first_import_ms": first * 1e3,
        "iters": iters,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--label", default="", help="a note for the table, e.g. 'MPS on'")
    p.add_argument(
        "--peer-gpu",
        type=int,
        default=None,
        help="also hand off to this GPU from GPU 0: the peer form of CUDA IPC, and shared memory, there",
    )
    args = p.parse_args()
    here = torch.device("cuda", 0)
    other = torch.device("cuda", args.peer_gpu) if args.peer_gpu is not None else None
    if other is not None and not 0 < other.index < torch.cuda.device_count():
        p.error(f"--peer-gpu {args.peer_gpu}: this host has {torch.cuda.device_count()} GPUs (the producer is on 0)")
    cases = [
        (pb.TRANSPORT_CUDA_IPC, "sync", here),
        (pb.TRANSPORT_CUDA_IPC, "event", here),
        (pb.TRANSPORT_SHM, "sync", here),
        (pb.TRANSPORT_INLINE, "sync", here),
    ]
    if other is not None:
        cases[3:3] = [
            (pb.TRANSPORT_CUDA_IPC_PEER, "sync", other),
            (pb.TRANSPORT_CUDA_IPC_PEER, "event", other),
            (pb.TRANSPORT_SHM, "sync", other),
        ]
    rows = []
    for transport, ready, device in cases:
        print(f"running {pb.Transport.Name(transport)} ready={ready} on {device} ...", file=sys.stderr, flush=True)
        rows.append(run_case(transport, ready, args.iters, args.warmup, device))
    env = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "shape": SHAPE,
        "dtype": "bfloat16",
        "label": args.label,
    }
    if args.out:
        args.out.write_text(json.dumps({"env": env, "results": rows}, indent=2))
    print(
        f"hand-off of one [576, 4096] bf16 tensor (4.7 MB), {env['gpu']}, {args.iters} iterations, "
        f"microseconds p50 / p99 {args.label}"
    )
    print(
        f"{'transport':<15}{'ready':<7}{'to':<8}{'producer':>19}{'consumer':>19}{'host path':>19}{'until read':>19}"
        f"{'first':>12}"
    )
    for r in rows:
        print(
            f"{r['transport']:<15}{r['ready']:<7}{r['consumer_device']:<8}"
            + "".join(
                f"{r[f'{k}_us_p50']:>10.1f} /{r[f'{k}_us_p99']:>7.1f}"
                for k in ("producer", "consumer", "total", "read")
            )
            + f"{r['first_import_ms']:>9.2f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
