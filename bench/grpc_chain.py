"""The floor under the mesh's plumbing: a bare grpc.aio chain of the mesh's shape.

A client calls a gateway, which awaits a unary call to a "vision" server (20 kB in,
300 B out), then relays a 16-message stream from an "llm" server; the servers do no
work. Three processes plus this client, as in the mesh. Each variant runs in fresh
processes:
- loop: asyncio's own event loop or uvloop;
- hops: one call per hop (as the mesh), or persistent streams between the gateway and
  its peers (one message each way per request, no call set-up; the client's own call
  is still one per request);
- transport: TCP loopback or Unix domain sockets between the gateway and its peers.

    python -m bench.grpc_chain [--iters 400] [--out chain.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

from services.common import eventloop
from services.launcher import free_port


def _same(b: bytes) -> bytes:
    return b


def _handlers(methods: dict) -> list:
    return [grpc.method_handlers_generic_handler("chain", methods)]


def _rpc(kind: str, fn):
    factory = {
        "unary": grpc.unary_unary_rpc_method_handler,
        "stream": grpc.unary_stream_rpc_method_handler,
        "bidi": grpc.stream_stream_rpc_method_handler,
    }[kind]
    return factory(fn, request_deserializer=_same, response_serializer=_same)


async def _serve(methods: dict, address: str) -> None:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(_handlers(methods))
    server.add_insecure_port(address)
    await server.start()
    await server.wait_for_termination()


def vision(address: str, loop: str) -> None:
    async def encode(request, context):
        return b"r" * 300

    async def encode_stream(requests, context):
        async for _ in requests:
            yield b"r" * 300

    eventloop.run(_serve({"Encode": _rpc("unary", encode), "EncodeS": _rpc("bidi", encode_stream)}, address), loop)


def llm(address: str, loop: str) -> None:
    async def generate(request, context):
        for _ in range(16):
            yield b"t" * 40

    async def generate_stream(requests, context):
        async for _ in requests:
            for _ in range(16):
                yield b"t" * 40

    methods = {"Generate": _rpc("stream", generate), "GenerateS": _rpc("bidi", generate_stream)}
    eventloop.run(_serve(methods, address), loop)


def gateway(address: str, vision_at: str, llm_at: str, loop: str, persistent: bool) -> None:
    async def main() -> None:
        vch, lch = grpc.aio.insecure_channel(vision_at), grpc.aio.insecure_channel(llm_at)
        encode = vch.unary_unary("/chain/Encode", request_serializer=_same, response_deserializer=_same)
        generate = lch.unary_stream("/chain/Generate", request_serializer=_same, response_deserializer=_same)
        streams: list = []

        async def relay(request, context):
            if persistent:
                # One request in flight at a time (the client below is sequential), so no ids are needed.
                if not streams:
                    for channel, method in ((vch, "/chain/EncodeS"), (lch, "/chain/GenerateS")):
                        rpc = channel.stream_stream(method, request_serializer=_same, response_deserializer=_same)
                        streams.append(rpc(wait_for_ready=True))
                enc_s, gen_s = streams
                await enc_s.write(request)
                ref = await enc_s.read()
                await gen_s.write(ref)
                for _ in range(16):
                    yield await gen_s.read()
                return
            ref = await encode(request)
            async for msg in generate(ref):
                yield msg

        await _serve({"Generate": _rpc("stream", relay)}, address)

    eventloop.run(main(), loop)


async def _client(address: str, iters: int, warmup: int) -> list[float]:
    async with grpc.aio.insecure_channel(address) as channel:
        rpc = channel.unary_stream("/chain/Generate", request_serializer=_same, response_deserializer=_same)
        image = os.urandom(20_000)
        took = []
        for i in range(warmup + iters):
            start = time.perf_counter()
            async for _ in rpc(image, wait_for_ready=True):
                pass
            if i >= warmup:
                took.append((time.perf_counter() - start) * 1000)
        return took


def run_variant(loop: str, persistent: bool, uds: bool, iters: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        if uds:
            vision_at, llm_at = f"unix:{tmp}/vision.sock", f"unix:{tmp}/llm.sock"
        else:
            vision_at, llm_at = f"127.0.0.1:{free_port('127.0.0.1')}", f"127.0.0.1:{free_port('127.0.0.1')}"
        gateway_at = f"127.0.0.1:{free_port('127.0.0.1')}"
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=vision, args=(vision_at, loop), daemon=True),
            ctx.Process(target=llm, args=(llm_at, loop), daemon=True),
            ctx.Process(target=gateway, args=(gateway_at, vision_at, llm_at, loop, persistent), daemon=True),
        ]
        for p in procs:
            p.start()
        try:
            deadline = time.monotonic() + 30
            while True:  # wait for the chain to answer
                try:
                    took = eventloop.run(_client(gateway_at, iters, warmup), loop)
                    break
                except grpc.aio.AioRpcError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
        finally:
            for p in procs:
                p.kill()
                p.join()
    took.sort()
    return {
        "loop": loop,
        "hops": "persistent streams" if persistent else "one call per hop",
        "transport": "unix sockets" if uds else "tcp loopback",
        "p50_ms": statistics.median(took),
        "p90_ms": took[int(0.9 * (len(took) - 1))],
        "p99_ms": took[int(0.99 * (len(took) - 1))],
        "iters": iters,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=400, help="timed requests per variant (default %(default)s)")
    p.add_argument("--warmup", type=int, default=50, help="untimed requests first (default %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = p.parse_args()
    loops = ["asyncio"] + (["uvloop"] if eventloop.resolve("auto") == "uvloop" else [])
    variants = [(loop, False, False) for loop in loops]
    variants += [(loop, False, True) for loop in loops] + [(loop, True, False) for loop in loops]
    rows = []
    for loop, persistent, uds in variants:
        print(f"running loop={loop} persistent={persistent} uds={uds} ...", file=sys.stderr, flush=True)
        rows.append(run_variant(loop, persistent, uds, args.iters, args.warmup))
    if args.out:
        args.out.write_text(json.dumps({"cpus": os.cpu_count(), "grpc": grpc.__version__, "rows": rows}, indent=1))
    print(
        "bare grpc.aio chain: client -> gateway -> vision unary, then a relayed 16-message llm stream; "
        f"ms over {args.iters} requests"
    )
    print(f"{'loop':<9}{'hops':<20}{'transport':<14}{'p50':>7}{'p90':>7}{'p99':>7}")
    for r in rows:
        print(
            f"{r['loop']:<9}{r['hops']:<20}{r['transport']:<14}{r['p50_ms']:7.2f}{r['p90_ms']:7.2f}{r['p99_ms']:7.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
