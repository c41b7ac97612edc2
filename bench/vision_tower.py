"""Time the vision service's ViT + projector on CUDA, as it serves: graph-captured per batch bucket.

For each batch: the captured tower alone (CUDA events around a replay), and `encode()` as the
servicer calls it (uint8 pixels uploaded, normalised on the device, the replay, the features
cloned out), wall time to a sync; p50 of `--steps` after 5 warm-ups. `--profile` adds
torch.profiler's kernel table for 10 replays of one image.

    python -m bench.vision_tower [--model preset:llava-7b-shaped] [--batches 1,2,4,8] [--profile]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from services.model.spec import load_spec
from services.vision.encoder import VisionEncoder


def time_batch(enc: VisionEncoder, b: int, steps: int) -> tuple[float, float]:
    """(replay ms on the device, encode() ms wall), p50 over `steps`."""
    shapes = enc.tower.input_shapes()
    pixels = [tuple(torch.randint(0, 255, (s[1], s[2], 3), dtype=torch.uint8).pin_memory() for s in shapes)] * b
    x = [torch.zeros(b, *s, device="cuda", dtype=enc.dtype) for s in shapes]
    for _ in range(5):
        enc.encode(pixels)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replay, wall = [], []
    for _ in range(steps):
        start.record()
        enc.graphed(*x)
        end.record()
        end.synchronize()
        replay.append(start.elapsed_time(end))
    for _ in range(steps):
        t = time.perf_counter()
        enc.encode(pixels)
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t) * 1e3)
    return statistics.median(replay), statistics.median(wall)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.vision_tower", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="preset:llava-7b-shaped")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--steps", type=int, default=20, help="timed runs per batch (default %(default)s)")
    p.add_argument("--profile", action="store_true", help="print the kernel table of 10 replays of one image")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("python -m bench.vision_tower needs a CUDA GPU")
    batches = [int(b) for b in args.batches.split(",")]
    spec = load_spec(args.model)
    t0 = time.perf_counter()
    print(f"building the vision tower of {spec.model_id} ({args.dtype}, graphs up to {max(batches)}) ...", flush=True)
    enc = VisionEncoder(spec, "cuda", args.dtype, graphs_up_to=max(batches))
    if enc.graphed is None:
        raise SystemExit("the tower could not be captured in CUDA graphs (see the log above)")
    print(f"ready in {time.perf_counter() - t0:.1f} s; buckets {enc.graphed.buckets}", flush=True)
    rows = [(b, *time_batch(enc, b, args.steps)) for b in batches]
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        x = [torch.zeros(1, *s, device="cuda", dtype=enc.dtype) for s in enc.tower.input_shapes()]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                enc.graphed(*x)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    print("| images | replay ms (device) | ms per image | encode() ms (wall) |")
    print("| --- | --- | --- | --- |")
    for b, replay, wall in rows:
        print(f"| {b} | {replay:.3f} | {replay / b:.3f} | {wall:.3f} |")


if __name__ == "__main__":
    main()
