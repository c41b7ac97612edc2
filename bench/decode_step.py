"""The native engine's decode step against the memory-bandwidth floor, on a CUDA GPU.

For each batch size it runs the engine's own step (`ModelRunner.step`: staging copy, the
captured decode graph, greedy tokens back to the host) over sequences of `--context`
positions and reads the engine's step timer (CUDA events around each graph replay). The
floor is the bytes one step must read (every decoder weight but the embedding table, of
which it reads b rows, plus each sequence's K and V) over the device-to-device copy
bandwidth measured in the same run (bytes read + written).

With `--prefill T` it also times the engine's prefill steps of 1 and of 3 prompts of T
positions (a W1 prompt is 608: 576 image and 32 text positions), and of one prompt beside
`--mixed` decoding sequences, against the compute floor (2 x parameters x rows at the bf16
matmul rate of BENCHMARKS.md); where the runner has the packed step, three ways: packed (one
forward, graph-captured; a lone fresh prompt attends by SDPA), packed with flex for it too, and
per chunk (the same runner with its packed step set aside).

The steps run over the engine's own `Request`s, in the state its scheduler leaves them in
(`admitted`), so the tool reads a request as the runner does.

`--device cpu` runs the same steps on the CPU's runner (eager, per chunk): wall times against
the host's copy bandwidth, no device times and no compute floor (that is the H200's); CI runs
it so, on a tiny model, to keep the tool working.

    python -m bench.decode_step [--model preset:llava-7b-shaped] [--quantize none] [--batches 1,8,32]
        [--context 640] [--steps 50] [--prefill 608] [--mixed 16] [--no-skinny-gemv] [--profile]
        [--device cuda] [--copy-mib 2048] [--out decode_step.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch

from services.common.config import QUANTIZATIONS
from services.common.qos import QosLevel
from services.common.sampling import Sampling
from services.llm.block_manager import BlockManager
from services.llm.kv_cache import KvConfig, page_bytes
from services.llm.request import Request
from services.llm.runner import ModelRunner, RunnerConfig
from services.llm.scheduler import Chunk
from services.model.qlinear import Int4Linear, Int8Linear
from services.model.quantize import weight_bytes as stored_bytes
from services.model.spec import load_spec

MATMUL_FLOPS = 785e12  # bf16, measured on the H200 (BENCHMARKS.md)
GREEDY = Sampling(max_tokens=None, temperature=0.0, top_p=1.0, seed=None, stop=(), min_tokens=0, ignore_eos=True)


def admitted(pages: BlockManager, prompt: int, generated: int = 0) -> Request:
    """A text-only request of `prompt` positions as the scheduler leaves it at admission, its pages
    taken from `pages` for the positions it will hold; with `generated` tokens sampled, its prefill
    is done and the next step decodes it (its last token at its last computed position).

    The engine's own Request: the detokenizer and the output callback are the engine's, which the
    runner never calls."""
    req = Request(
        id=f"bench-{prompt}+{generated}",
        prompt_ids=[7] * prompt,
        image_positions=[],
        image_features=[],
        text_tokens=prompt,
        sampling=GREEDY,
        max_new=generated + 1,
        qos=QosLevel.STANDARD,
        detok=None,
        emit=None,
    )
    req.blocks = pages.allocate(pages.pages_for(prompt + generated))
    req.prefill_target = prompt
    req.output_ids = [1] * generated
    req.computed = prompt + generated - 1 if generated else 0
    return req


def time_prefill(
    runner: ModelRunner, prompts: int, tokens: int, decodes: int, context: int, steps: int = 10, profile_rows: int = 0
) -> dict:
    """Steps of `prompts` prompts of `tokens` positions, `decodes` sequences decoding at `context` beside them."""
    pages = BlockManager(runner.n_pages, runner.page_size)
    reqs = [admitted(pages, tokens) for _ in range(prompts)]
    seqs = [admitted(pages, context - 1, 1) for _ in range(decodes)]

    def one_step() -> None:
        for r in reqs:
            r.computed = 0
        for s in seqs:
            s.computed = context - 1
        runner.step([Chunk(r, 0, tokens) for r in reqs], seqs)

    wall, table = [], ""
    for _ in range(steps + 3):
        t0 = time.perf_counter()
        one_step()
        wall.append(time.perf_counter() - t0)
    if profile_rows:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            one_step()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=profile_rows)
    rows = tokens * prompts + decodes
    return {
        "mode": "chunks" if runner.packed is None else "packed",
        "prompts": prompts,
        "tokens": tokens,
        "decodes": decodes,
        "wall_s": statistics.median(wall[3:]),
        # The floor is the H200's bf16 matmul rate: none on the CPU.
        "floor_s": 2 * matmul_weights(runner.model) * rows / MATMUL_FLOPS if runner.device.type == "cuda" else None,
        "profile": table,
    }


def time_prefills(runner: ModelRunner, tokens: int, decodes: int, context: int, profile_rows: int) -> list[dict]:
    """1 and 3 prompts, then 1 beside `decodes` decodes; packed, packed with flex for a fresh
    prompt too (its SDPA path off), and per chunk (the packed step set aside)."""
    packed, out = runner.packed, []
    sdpa = packed is not None and packed.fresh_sdpa  # False where its graphs could not be captured
    modes = ("packed", "packed-flex", "chunks") if packed is not None else ("chunks",)
    for mode in modes:
        runner.packed = None if mode == "chunks" else packed
        if packed is not None:
            packed.fresh_sdpa = sdpa and mode != "packed-flex"
        cases = ((1, 0), (3, 0), (1, decodes)) if decodes else ((1, 0), (3, 0))
        for prompts, beside in cases if mode != "packed-flex" else [c for c in cases if c[0] == 1]:
            out.append(time_prefill(runner, prompts, tokens, beside, context, profile_rows=profile_rows))
            out[-1]["mode"] = mode
    runner.packed = packed
    if packed is not None:
        packed.fresh_sdpa = sdpa
    return out


def copy_bandwidth(device: torch.device, nbytes: int, iters: int = 20) -> float:
    """A copy of `nbytes` within the device's memory, bytes read + written per second (median of `iters`)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(iters + 3):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1000)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times[3:])


def matmul_weights(model: torch.nn.Module) -> int:
    """Weights a prompt token multiplies by: all but the embedding table, quantized projections
    counted as in x out (their packed data holds several weights an element)."""
    total = 0
    for module in model.modules():
        if isinstance(module, Int4Linear | Int8Linear):
            total += module.in_features * module.out_features
        elif module is not model.embed_tokens:
            total += sum(p.numel() for p in module.parameters(recurse=False))
    return total


def weight_bytes(runner: ModelRunner, batch: int) -> int:
    """What one decode step reads of the weights: all but the embedding table, and b of its rows.

    Quantized weights count as stored (their int data and scales): a variant's floor is its own bytes.
    """
    model = runner.model
    total = stored_bytes(model)
    table = model.embed_tokens.weight
    return total - table.numel() * table.element_size() + batch * table.shape[1] * table.element_size()


def time_batch(runner: ModelRunner, batch: int, context: int, steps: int) -> dict:
    """Decode steps of `batch` sequences at `context` positions: the device's time (CUDA events
    around the step; None on the CPU) and the wall time to the tokens on the host, medians."""
    pages = BlockManager(runner.n_pages, runner.page_size)
    seqs = [admitted(pages, context - 1, 1) for _ in range(batch)]
    cuda = runner.device.type == "cuda"
    runner.decode.timings = [] if cuda else None
    wall = []
    for _ in range(steps + 5):
        for s in seqs:
            s.computed = context - 1  # the same positions each step: a fixed context
        t0 = time.perf_counter()
        runner.step([], seqs)  # ends with the tokens on the host
        wall.append(time.perf_counter() - t0)
    device = [start.elapsed_time(end) / 1000 for _, start, end in runner.decode.timings[5:]] if cuda else []
    runner.decode.timings = None
    kv = batch * context * page_bytes(runner.spec, runner.dtype, runner.page_size) // runner.page_size
    return {
        "batch": batch,
        "bucket": runner.decode.bucket(batch),
        "context": context,
        "weight_bytes": weight_bytes(runner, batch),
        "kv_bytes": kv,
        "device_s": statistics.median(device) if device else None,
        "wall_s": statistics.median(wall[5:]),
    }


def profile(runner: ModelRunner, batch: int, context: int, rows: int = 15) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    pages = BlockManager(runner.n_pages, runner.page_size)
    seqs = [admitted(pages, context - 1, 1) for _ in range(batch)]

    def step() -> None:
        for s in seqs:
            s.computed = context - 1  # the same positions each step, as time_batch runs them
        runner.step([], seqs)

    for _ in range(3):
        step()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
    return prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows)


def fmt(ms: float | None) -> str:
    """A table cell: the figure, or - where this device gives none."""
    return "-" if ms is None else f"{ms:.2f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.decode_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="preset:llava-7b-shaped", help="checkpoint or preset (default %(default)s)")
    p.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"), help="cpu: eager steps, wall times (default %(default)s)"
    )
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float16", "float32"),
        help="weights and activations (default %(default)s)",
    )
    p.add_argument("--quantize", default="none", choices=QUANTIZATIONS, help="decoder quantization (default none)")
    p.add_argument("--batches", default="1,2,4,8,16,32", help="decode batch sizes (default %(default)s)")
    p.add_argument("--context", type=int, default=640, help="positions each sequence holds (default %(default)s)")
    p.add_argument("--steps", type=int, default=50, help="timed steps per batch size (default %(default)s)")
    p.add_argument("--prefill", type=int, default=0, help="also time prefills of this many positions (0: no)")
    p.add_argument("--mixed", type=int, default=16, help="decodes beside one prompt in the mixed prefill step")
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=2048,
        help="the runner's prompt rows a step, as docs/PERF.md's figures were taken; fewer capture fewer "
        "packed-step graphs, a quicker start where only decodes are timed (default %(default)s)",
    )
    p.add_argument(
        "--no-skinny-gemv", dest="skinny_gemv", action="store_false", help="the decode step's linears on cuBLAS"
    )
    p.add_argument(
        "--profile", action="store_true", help="print torch.profiler's kernel tables (decode, prefill; CUDA)"
    )
    p.add_argument(
        "--copy-mib", type=int, default=2048, help="MiB copied to measure the copy bandwidth (default %(default)s)"
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA GPU here (--device cpu runs the CPU's step)")
    if args.profile and device.type != "cuda":
        p.error("--profile: the kernel tables are CUDA's; use --device cuda")
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches {args.batches!r}: give a comma list of batch sizes, e.g. 1,8,32")
    spec = load_spec(args.model)
    max_prefill = args.max_prefill_tokens
    if max_prefill < 16:
        p.error(f"--max-prefill-tokens {max_prefill}: give 16 or more")
    if not 1 < args.context <= spec.text.max_context:
        p.error(f"--context {args.context}: give 2 to the model's context, {spec.text.max_context}")
    if not 0 <= args.prefill <= min(max_prefill, spec.text.max_context):
        p.error(f"--prefill {args.prefill}: give 0 (none) to {min(max_prefill, spec.text.max_context)}")
    if min(batches) < 1 or args.steps < 1 or args.mixed < 0 or args.copy_mib < 1:
        p.error("--batches, --steps and --copy-mib take numbers >= 1, --mixed >= 0")
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    max_batch = max(*batches, 3 + args.mixed if args.prefill else 1)  # what the prefill steps sample
    gemv = "skinny" if args.skinny_gemv else "cuBLAS"
    what = f"{args.dtype} on {device}, --quantize {args.quantize}, decode linears on {gemv}, batches up to {max_batch}"
    print(f"building the engine's runner for {spec.model_id} ({what}) ...", flush=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")  # the build's progress
    kv = KvConfig(128, 0.0, 0.6)
    cfg = RunnerConfig(max_batch, kv, max_prefill, quantize=args.quantize, skinny_gemv=args.skinny_gemv)
    runner = ModelRunner(spec, device, dtype, cfg)
    print(f"ready in {time.perf_counter() - t0:.1f} s (weights, warm-up, compile, graph capture)", flush=True)
    bandwidth = copy_bandwidth(device, args.copy_mib * 2**20)
    results = []
    for b in batches:
        r = time_batch(runner, b, args.context, args.steps)
        r["floor_s"] = (r["weight_bytes"] + r["kv_bytes"]) / bandwidth
        results.append(r)
        took = "on the device" if r["device_s"] is not None else "wall"
        ms = r["device_s"] if r["device_s"] is not None else r["wall_s"]
        print(f"batch {b}: {ms * 1e3:.3f} ms {took}, floor {r['floor_s'] * 1e3:.3f} ms", flush=True)
    if args.profile:
        for b in sorted({batches[0], batches[-1]}):
            print(f"\nprofile, batch {b}, 10 steps:\n{profile(runner, b, args.context)}")
    rows = 15 if args.profile else 0
    prefills = time_prefills(runner, args.prefill, args.mixed, args.context, rows) if args.prefill else []
    for r in prefills:
        table = r.pop("profile")
        if table:
            print(f"\nprofile, {r['mode']} prefill of {r['prompts']} x {r['tokens']}, {r['decodes']} decodes:\n{table}")
    out = {
        "model": spec.model_id,
        "device": str(device),
        "dtype": args.dtype,
        "quantize": args.quantize,
        "skinny_gemv": args.skinny_gemv,
        "copy_bandwidth_Bps": bandwidth,
        "results": results,
        "prefill": prefills,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2, allow_nan=False)
    gbps = bandwidth / 1e12
    head = f"--quantize {args.quantize}, decode linears on {gemv}"
    print(f"\n{head}: copy bandwidth {gbps:.2f} TB/s (read + written); context {args.context}")
    print("| batch | bucket | GB read | floor ms | step ms (device) | x floor | step ms (wall) | x floor |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        gb = (r["weight_bytes"] + r["kv_bytes"]) / 1e9
        f, w = r["floor_s"] * 1e3, r["wall_s"] * 1e3
        d = None if r["device_s"] is None else r["device_s"] * 1e3
        print(
            f"| {r['batch']} | {r['bucket']} | {gb:.2f} | {f:.2f} | {fmt(d)} | {ratio(d, f)} | {w:.2f} | {w / f:.2f} |"
        )
    if prefills:
        print("\n| prefill | prompts | positions | decodes beside | floor ms | step ms (wall) | x floor |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in prefills:
            f = None if r["floor_s"] is None else r["floor_s"] * 1e3
            w, n = r["wall_s"] * 1e3, r["prompts"] * r["tokens"]
            print(f"| {r['mode']} | {r['prompts']} | {n} | {r['decodes']} | {fmt(f)} | {w:.2f} | {ratio(w, f)} |")


if __name__ == "__main__":
    main()
