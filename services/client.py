"""`vlmesh generate`: a streaming command-line client of vlmesh.v1.Gateway."""

from __future__ import annotations

import argparse
import mimetypes
import os
import sys
import time
from pathlib import Path

import grpc

from services.common.qos import QOS_METADATA_KEY, QosLevel
from services.common.server import GRPC_OPTIONS
from services.common.tls import sync_channel
from services.common.validation import (
    API_KEY_ENV,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    UINT32_MAX,
    UINT64_MAX,
    CliParser,
    api_key,
    api_key_metadata,
    float_in,
    int_in,
    prompt_text,
    stop_text,
)
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


def image_file(text: str) -> Path:
    """An argparse `type=` for --image: a file that exists (read when the request is built)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory: give one image file (JPEG, PNG, WebP, ...)")
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return path


def pem_file(text: str) -> str:
    """An argparse `type=` for --tls-ca: a readable PEM file."""
    try:
        data = Path(text).read_bytes()
    except OSError as err:
        raise argparse.ArgumentTypeError(f"{text}: cannot read it: {err.strerror or err}") from None
    if b"-----BEGIN " not in data:
        raise argparse.ArgumentTypeError(f"{text}: not a PEM file")
    return text


def call_metadata(qos: str, key: str | None) -> tuple[tuple[str, str], ...]:
    """The qos-level, and the API key as `authorization: Bearer KEY` when there is one."""
    return ((QOS_METADATA_KEY, qos), *api_key_metadata(key))


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


# What a plaintext client sees when the gateway speaks TLS: the server drops the connection at
# its first bytes, which are not a TLS handshake, so the call fails before any answer.
PLAINTEXT_TO_TLS = ("Socket closed", "Connection reset by peer")
TLS_HINT = "is the gateway serving TLS? pass --tls-ca CA.pem"


class HintedRpcError(grpc.RpcError):
    """A failed call's status, its details followed by a hint for the user."""

    def __init__(self, err: grpc.RpcError, hint: str) -> None:
        self._code = err.code()
        self._details = f"{err.details()} ({hint})"
        super().__init__(self._details)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def format_timings(t: pb.StageTimings) -> str:
    """A per-stage table of one request, as the gateway measured it."""
    rows = [f"  {name:<14}{getattr(t, field):9.2f} ms" for name, field in STAGES]
    rows.append(f"  {'first token':<14}{t.ttft_ms:9.2f} ms")
    rows.append(f"  {'total':<14}{t.total_ms:9.2f} ms")
    return "\n".join(rows)


def generate(
    target: str,
    request: gateway_pb2.GenerateRequest,
    qos: str,
    timeout: float | None,
    out=sys.stdout,
    api_key: str | None = None,
    tls_ca: str | None = None,
) -> gateway_pb2.GenerateResponse:
    """Stream one request, writing text as it arrives; return the final message. `tls_ca`: TLS,
    verifying the gateway against this CA (PEM file); None: plaintext, and a connection the
    gateway drops at once fails with a hint that it may serve TLS (HintedRpcError)."""
    creds = grpc.ssl_channel_credentials(Path(tls_ca).read_bytes()) if tls_ca else None
    with sync_channel(target, creds, options=GRPC_OPTIONS) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        final = None
        try:
            for msg in stub.Generate(request, metadata=call_metadata(qos, api_key), timeout=timeout):
                out.write(msg.text)
                out.flush()
                final = msg
        except grpc.RpcError as err:
            details = err.details() or ""
            dropped = err.code() == grpc.StatusCode.UNAVAILABLE and any(m in details for m in PLAINTEXT_TO_TLS)
            if tls_ca is None and final is None and dropped:
                raise HintedRpcError(err, TLS_HINT) from err
            raise
        out.write("\n")
        return final


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(
        prog="vlmesh generate",
        description="Ask the mesh about one image; tokens stream as they are generated.",
    )
    p.add_argument("--image", type=image_file, required=True, help="image file (JPEG, PNG, WebP, ...)")
    p.add_argument("--prompt", type=prompt_text, required=True, help="question or instruction about the image")
    p.add_argument("--target", default=DEFAULT_TARGET, help="gateway HOST:PORT (default %(default)s)")
    p.add_argument(
        "--qos-level",
        default="standard",
        choices=[q.wire for q in QosLevel],
        help="priority class (default %(default)s)",
    )
    p.add_argument(
        "--api-key",
        type=api_key,
        default=os.environ.get(API_KEY_ENV) or None,
        metavar="KEY",
        help=f"sent as `authorization: Bearer KEY` (a gateway with --tenants needs one; default: ${API_KEY_ENV})",
    )
    p.add_argument(
        "--max-tokens",
        type=int_in(1, UINT32_MAX, "the server also keeps it below the model's context"),
        default=None,
        help="tokens to generate at most, >= 1 (default: the server's)",
    )
    p.add_argument(
        "--temperature",
        type=float_in(0.0, MAX_TEMPERATURE, note="0 = greedy"),
        default=None,
        help=f"0 to {MAX_TEMPERATURE:g}; 0 or unset = greedy",
    )
    p.add_argument("--seed", type=int_in(0, UINT64_MAX), default=None, help="sampling seed, >= 0")
    p.add_argument(
        "--stop",
        type=stop_text,
        action="append",
        default=[],
        help=f"stop string (repeatable, {MAX_STOP_STRINGS} at most)",
    )
    p.add_argument(
        "--timeout", type=float_in(0.0, lo_open=True), default=60.0, help="deadline in seconds (default %(default)s)"
    )
    p.add_argument("--timings", action="store_true", help="print the per-stage breakdown after the answer")
    p.add_argument(
        "--tls-ca",
        type=pem_file,
        default=None,
        metavar="PEM",
        help="connect with TLS, verifying the gateway against this CA (e.g. the one vlmesh up --tls-throwaway-ca "
        "prints); default: plaintext",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Exit 0 on an answer, 2 on a bad argument (before connecting), 1 when the gateway refuses or fails.

    A failed RPC raises grpc.RpcError; `vlmesh` (services/cli.py) prints it on one line.
    """
    p = build_parser()
    args = p.parse_args(argv)
    if len(args.stop) > MAX_STOP_STRINGS:
        p.error(f"argument --stop: {len(args.stop)} given, at most {MAX_STOP_STRINGS}")
    request = build_request(args.image, args.prompt, args.max_tokens, args.temperature, args.seed, args.stop)
    start = time.perf_counter()
    final = generate(args.target, request, args.qos_level, args.timeout, api_key=args.api_key, tls_ca=args.tls_ca)
    wall = (time.perf_counter() - start) * 1000
    if final is None:
        print("vlmesh generate: error: the gateway ended the stream without a final message", file=sys.stderr)
        return 1
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
