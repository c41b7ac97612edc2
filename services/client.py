"""`vlmesh generate`: a streaming command-line client of vlmesh.v1.Gateway."""

from __future__ import annotations

import argparse
import mimetypes
import sys
import time
from pathlib import Path

import grpc

from services.common.qos import QOS_METADATA_KEY, QosLevel
from services.common.server import GRPC_OPTIONS
from services.gateway.config import DEFAULT_TARGET
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc

STAGES = (
    ("admission", "admission_ms"),
    ("vision queue", "vision_queue_ms"),
    ("preprocess", "preprocess_ms"),
    ("vision encode", "vision_ms"),
    ("hand-off", "handoff_ms"),
    ("llm queue", "llm_queue_ms"),
    ("prefill", "prefill_ms"),
    ("decode", "decode_ms"),
)


def build_request(
    image: Path,
    prompt: str,
    max_tokens: int | None,
    temperature: float | None,
    seed: int | None,
    stop: list[str],
) -> gateway_pb2.GenerateRequest:
    data = image.read_bytes()
    mime = mimetypes.guess_type(image.name)[0] or ""
    sampling = pb.SamplingParams(stop=stop)
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    if temperature is not None:
        sampling.temperature = temperature
    if seed is not None:
        sampling.seed = seed
    return gateway_pb2.GenerateRequest(
        images=[pb.Image(data=data, mime_type=mime if mime.startswith("image/") else "")],
        prompt=prompt,
        sampling=sampling,
    )


def format_timings(t: pb.StageTimings) -> str:
    """A per-stage table of one request, as the gateway measured it."""
    rows = [f"  {name:<14}{getattr(t, field):9.2f} ms" for name, field in STAGES]
    rows.append(f"  {'first token':<14}{t.ttft_ms:9.2f} ms")
    rows.append(f"  {'total':<14}{t.total_ms:9.2f} ms")
    return "\n".join(rows)


def generate(
    target: str, request: gateway_pb2.GenerateRequest, qos: str, timeout: float | None, out=sys.stdout
) -> gateway_pb2.GenerateResponse:
    """Stream one request, writing text as it arrives; return the final message."""
    with grpc.insecure_channel(target, options=GRPC_OPTIONS) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        final = None
        for msg in stub.Generate(request, metadata=((QOS_METADATA_KEY, qos),), timeout=timeout):
            out.write(msg.text)
            out.flush()
            final = msg
        out.write("\n")
        return final


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="vlmesh generate",
        description="Ask the mesh about one image; tokens stream as they are generated.",
    )
    p.add_argument("--image", type=Path, required=True, help="image file (JPEG, PNG, WebP, ...)")
    p.add_argument("--prompt", required=True, help="question or instruction about the image")
    p.add_argument("--target", default=DEFAULT_TARGET, help="gateway HOST:PORT (default %(default)s)")
    p.add_argument(
        "--qos-level",
        default="standard",
        choices=[q.wire for q in QosLevel],
        help="priority class (default %(default)s)",
    )
    p.add_argument("--max-tokens", type=int, default=None, help="tokens to generate at most (default: server's)")
    p.add_argument("--temperature", type=float, default=None, help="0 or unset = greedy")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--timeout", type=float, default=60.0, help="deadline in seconds (default %(default)s)")
    p.add_argument("--timings", action="store_true", help="print the per-stage breakdown after the answer")
    args = p.parse_args(argv)
    if not args.image.is_file():
        p.error(f"--image {args.image}: no such file")
    request = build_request(args.image, args.prompt, args.max_tokens, args.temperature, args.seed, args.stop)
    start = time.perf_counter()
    try:
        final = generate(args.target, request, args.qos_level, args.timeout)
    except grpc.RpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    wall = (time.perf_counter() - start) * 1000
    u = final.usage
    print(
        f"[{pb.FinishReason.Name(final.finish_reason).removeprefix('FINISH_REASON_').lower()}: "
        f"{u.output_tokens} tokens; prompt {u.prompt_tokens} text + {u.image_tokens} image tokens; "
        f"{wall:.0f} ms at the client]",
        file=sys.stderr,
    )
    if args.timings:
        print(format_timings(final.timings), file=sys.stderr)
    return 0
