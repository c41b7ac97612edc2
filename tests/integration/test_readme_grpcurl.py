"""The README's grpcurl example, run by bash as written, with a picture whose base64 outgrows one
command-line argument (128 KiB on Linux).

grpcurl itself is not installed here: a stand-in on PATH records each call's arguments and
standard input. The test then checks what the example handed grpcurl: the listing, and a body
that is a GenerateRequest in protobuf's JSON mapping (the one grpcurl reads), which the mesh's
gateway answers when sent with the example's metadata.
"""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

import grpc
from google.protobuf import json_format
from PIL import Image

from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
README_TARGET = "127.0.0.1:50051"
RECORDER = """#!/bin/bash
n=$(find "$CALLS" -name '*.args' | wc -l)
printf '%s\\n' "$@" > "$CALLS/$n.args"
cat > "$CALLS/$n.stdin"
"""


def readme_block(marker: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(marker)
    body = text[text.index("\n", start) + 1 :]
    return body[: body.index("```")]


def big_png(path: Path) -> bytes:
    """Noise, which PNG cannot compress: well over the 96 KiB whose base64 fills one argument."""
    size = (256, 256)
    noise = random.Random(7).randbytes(size[0] * size[1] * 3)
    Image.frombytes("RGB", size, noise).save(path, "PNG")
    data = path.read_bytes()
    assert len(data) > 128 * 1024
    return data


def grpcurl_call(args: list[str]) -> tuple[dict[str, str], str | None, list[str]]:
    """(headers, -d value, positional arguments) of one grpcurl command line."""
    headers, data, rest = {}, None, []
    it = iter(args)
    for arg in it:
        if arg == "-H":
            key, _, value = next(it).partition(":")
            headers[key.strip()] = value.strip()
        elif arg == "-d":
            data = next(it)
        elif arg != "-plaintext":
            rest.append(arg)
    return headers, data, rest


def test_the_readme_grpcurl_example_sends_a_big_picture(mesh, tmp_path):
    picture = big_png(tmp_path / "cat.png")
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    calls.mkdir()
    (bin_dir / "grpcurl").write_text(RECORDER)
    (bin_dir / "grpcurl").chmod(0o755)
    target = mesh.target("gateway")
    script = readme_block("```sh grpcurl").replace(README_TARGET, target)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "CALLS": str(calls), "HOME": str(tmp_path)}
    out = subprocess.run(
        ["bash", "-e", "-c", script], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr  # no "Argument list too long"
    listing, generate = (calls / f"{i}.args" for i in range(2))
    assert listing.read_text().split() == ["-plaintext", target, "list"]
    headers, data, rest = grpcurl_call(generate.read_text().splitlines())
    assert data == "@" and rest == [target, "vlmesh.v1.Gateway/Generate"]
    request = json_format.Parse((calls / "1.stdin").read_text(), gateway_pb2.GenerateRequest())  # unknown fields fail
    assert request.images[0].data == picture and request.sampling.max_tokens == 16
    with grpc.insecure_channel(target) as channel:
        answers = list(gateway_pb2_grpc.GatewayStub(channel).Generate(request, metadata=headers.items(), timeout=60))
    assert answers[-1].usage.output_tokens > 0
