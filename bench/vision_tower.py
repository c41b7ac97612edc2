"""Time the vision service's ViT + projector on CUDA, as it serves: graph-captured per batch bucket.

For each batch: the captured tower alone (CUDA events around a replay); then, for pictures
resized on the GPU (`--gpu-resize`, the default) and by Pillow (`--no-gpu-resize`), `pixels()`
on one JPEG of `--picture` size as a preprocessing thread runs it (CPU), and `encode()` as the
servicer calls it (uint8 pixels uploaded, resized if left to the GPU, normalised, the replay,
the features cloned out), wall time to a sync; p50 of `--steps` after 5 warm-ups. `--profile`
adds torch.profiler's kernel table for 10 replays of one image. A tower whose pictures take
tokens by their size (Qwen2.5-VL) runs a graph per batch of picture grids: its replay column is
one graph of `--batches` pictures of `--picture`, and `--eager` times it without graphs too.

    python -m bench.vision_tower [--model preset:llava-7b-shaped] [--batches 1,2,4,8] [--profile]
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image

from services.model.family import family_of
from services.model.spec import load_spec
from services.vision.encoder import VisionEncoder


def jpeg(width: int, height: int) -> bytes:
    """A photo-like picture (smooth gradients and noise), as JPEG."""
    yy, xx = np.mgrid[0:height, 0:width]
    arr = np.stack([xx * 255 // max(width, 1), yy * 255 // max(height, 1), (xx + yy) % 256], -1)
    arr = (arr + np.random.default_rng(0).integers(0, 32, arr.shape)).clip(0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def replay_inputs(enc: VisionEncoder, data: bytes, b: int) -> tuple[Callable, tuple]:
    """The graphed tower and its inputs for `b` pictures: a batch of zeros for a bucketed tower, or
    `b` of this picture's patches for a tower graphed per batch of grids."""
    if enc.grid_graphs is not None:
        inputs = enc.processor.tower_inputs([enc.pixels(data)] * b, torch.device("cuda"))
        return enc.grid_graphs.pictures, (inputs[0].to(enc.dtype), inputs[1])
    return enc.graphed, tuple(torch.zeros(b, *s, device="cuda", dtype=enc.dtype) for s in enc.tower.input_shapes())


def time_replay(enc: VisionEncoder, data: bytes, b: int, steps: int) -> float:
    """The captured tower alone: ms on the device, p50 over `steps`."""
    run, x = replay_inputs(enc, data, b)
    for _ in range(5):
        run(*x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replay = []
    for _ in range(steps):
        start.record()
        run(*x)
        end.record()
        end.synchronize()
        replay.append(start.elapsed_time(end))
    return statistics.median(replay)


def time_serving(enc: VisionEncoder, data: bytes, b: int, steps: int) -> tuple[float, float]:
    """(pixels() ms per picture on the CPU, encode() ms wall for `b` pictures), p50 over `steps`."""
    prep = []
    for _ in range(steps + 5):
        t = time.perf_counter()
        pixels = enc.pixels(data)
        prep.append((time.perf_counter() - t) * 1e3)
    batch = [pixels] * b
    for _ in range(5):
        enc.encode(batch)
    torch.cuda.synchronize()
    wall = []
    for _ in range(steps):
        t = time.perf_counter()
        enc.encode(batch)
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t) * 1e3)
    return statistics.median(prep[5:]), statistics.median(wall)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.vision_tower", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="preset:llava-7b-shaped")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--steps", type=int, default=20, help="timed runs per batch (default %(default)s)")
    p.add_argument("--picture", default="224x224", help="WIDTHxHEIGHT of the JPEG served (default %(default)s)")
    p.add_argument("--profile", action="store_true", help="print the kernel table of 10 replays of one image")
    p.add_argument("--eager", action="store_true", help="a tower graphed per batch of grids: time encode() eagerly too")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("python -m bench.vision_tower needs a CUDA GPU")
    batches = [int(b) for b in args.batches.split(",")]
    spec = load_spec(args.model)
    t0 = time.perf_counter()
    print(f"building the vision tower of {spec.model_id} ({args.dtype}, graphs up to {max(batches)}) ...", flush=True)
    enc = VisionEncoder(spec, "cuda", args.dtype, graphs_up_to=max(batches))
    if enc.graphed is None and enc.grid_graphs is None:
        raise SystemExit("the tower could not be captured in CUDA graphs (see the log above)")
    graphs = "a graph per batch of grids" if enc.grid_graphs is not None else f"buckets {enc.graphed.buckets}"
    print(f"ready in {time.perf_counter() - t0:.1f} s; {graphs}", flush=True)
    data = jpeg(*(int(n) for n in args.picture.split("x")))
    on_gpu, by_pillow = enc.processor, family_of(spec).image_processor(spec)
    rows = []
    for b in batches:
        row = [b, time_replay(enc, data, b, args.steps)]
        for processor in (on_gpu, by_pillow):
            enc.processor = processor
            row += time_serving(enc, data, b, args.steps)
        rows.append(row)
        enc.processor = on_gpu
    if args.eager and enc.grid_graphs is not None:
        grid_graphs, enc.grid_graphs = enc.grid_graphs, None
        for b in batches:
            print(f"eager, {b} x {args.picture}: encode() {time_serving(enc, data, b, args.steps)[1]:.3f} ms (wall)")
        enc.grid_graphs = grid_graphs
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        run, x = replay_inputs(enc, data, 1)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                run(*x)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    print(f"pictures: one {args.picture} JPEG; pixels() is per picture, on a CPU thread")
    print("| images | replay ms (device) | ms per image | GPU resize: pixels() ms | encode() ms (wall) "
          "| Pillow: pixels() ms | encode() ms (wall) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for b, replay, *t in rows:
        print(f"| {b} | {replay:.3f} | {replay / b:.3f} | " + " | ".join(f"{x:.3f}" for x in t) + " |")


if __name__ == "__main__":
    main()
