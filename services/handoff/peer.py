"""A stand-in producer process for tests and benchmarks: it owns a CUDA (and host) arena and serves writes.

Used by the GPU tests (tests/gpu/test_cuda_ipc.py) and bench/handoff.py to put producer and
consumer in two real processes, without a vision model. Protocol over
multiprocessing.connection (one thread per consumer):
    ("write", seed, shape, dtype_name, transport) -> (TensorRef bytes, sha256 hex, producer seconds)
    ("release", lease_id)                         -> bool
    ("stats",)                                    -> {"leased": n}
    ("reap",)                                     -> slots reclaimed
    ("stop",)
The tensor for a seed is torch.randn on the producer's GPU, so consumers can ask for the
checksum computed here and compare bit for bit.

    python -m services.handoff.peer ADDRESS_FILE [--slots N] [--ttl S] [--ready sync|event] [--slot-mib M]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

import torch

from services.handoff.producer import Producer
from vlmesh.v1 import common_pb2 as pb

AUTHKEY = b"vlmesh-arena-peer"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def sha256(t: torch.Tensor) -> str:
    """The tensor's bytes' checksum: equal on both ends exactly when nothing changed on the way."""
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def serve(address_file: Path, slots: int, ttl: float, ready: str, slot_mib: float) -> None:
    """Own a Producer on the GPU and answer consumers (one thread each) until told to stop."""
    device = torch.device("cuda")
    producer = Producer(int(slot_mib * 2**20), slots, ttl, device, ready)
    listener = Listener(("127.0.0.1", 0), authkey=AUTHKEY)

    def reply(conn: Connection, msg: tuple) -> None:
        if msg[0] == "write":
            _, seed, shape, dtype, transport = msg
            gen = torch.Generator(device=device).manual_seed(seed)
            t = torch.randn(shape, generator=gen, device=device).to(DTYPES[dtype])
            torch.cuda.synchronize()
            start = time.perf_counter()
            ref = producer.export([t], producer.transport(transport))[0]
            elapsed = time.perf_counter() - start
            conn.send((ref.SerializeToString(), sha256(t), elapsed))
        elif msg[0] == "release":
            conn.send(producer.release([msg[1]]) == 1)
        elif msg[0] == "stats":
            conn.send({"leased": producer.leased, "gpu_uuid": producer.gpu_uuid, "host": producer.host})
        elif msg[0] == "reap":
            conn.send(producer.reap())
        elif msg[0] == "stop":
            # accept() in the main thread cannot be interrupted portably: leave hard,
            # after unlinking the arena's segment.
            producer.close()
            conn.send(True)
            os._exit(0)

    def handle(conn: Connection) -> None:
        with conn:
            while True:
                try:
                    msg = conn.recv()
                except EOFError:
                    return
                try:
                    reply(conn, msg)
                except Exception as err:  # the consumer sees the error instead of a dropped line
                    conn.send(err)

    host, port = listener.address
    address_file.write_text(f"{host}:{port}")
    try:
        while True:
            threading.Thread(target=handle, args=(listener.accept(),), daemon=True).start()
    finally:
        producer.close()


def connect(address_file: Path, timeout: float = 60.0) -> Connection:
    """Connect to the peer that writes its address to `address_file` (waits for it to start)."""
    deadline = time.monotonic() + timeout
    while not address_file.exists() or not address_file.read_text():
        if time.monotonic() > deadline:
            raise TimeoutError("arena peer did not start")
        time.sleep(0.05)
    host, port = address_file.read_text().split(":")
    return Client((host, int(port)), authkey=AUTHKEY)


def call(conn: Connection, *msg: object) -> Any:
    """Send one request, return its answer; an error raised in the peer is raised here."""
    conn.send(msg)
    out = conn.recv()
    if isinstance(out, Exception):
        raise out
    return out


def write(
    conn: Connection, seed: int, shape: tuple[int, ...], dtype: str, transport: int
) -> tuple[pb.TensorRef, str, float]:
    """Have the peer export torch.randn(shape) for `seed`: (its reference, its sha256, producer seconds)."""
    raw, digest, seconds = call(conn, "write", seed, tuple(shape), dtype, transport)
    return pb.TensorRef.FromString(raw), digest, seconds


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="a stand-in feature producer for tests and benchmarks")
    p.add_argument("address_file", type=Path)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--ttl", type=float, default=30.0)
    p.add_argument("--ready", default="sync")
    p.add_argument("--slot-mib", type=float, default=4.5)
    a = p.parse_args()
    serve(a.address_file, a.slots, a.ttl, a.ready, a.slot_mib)
