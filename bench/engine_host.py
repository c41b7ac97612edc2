"""The native engine's host cost per step, with the model's work taken out.

The engine's own runner, built on the CPU, stages each step's inputs as it does on any device
but runs no model: every sampled row gets one token at once, through the runner's own token
fetch. So what a step costs here is what the engine thread does around the model on any device:
scheduling, staging, the postprocess (EOS and length
checks, incremental detokenization, stop strings) and handing each output to the servicer's
event loop. On a GPU that time is added to every step: the device waits for the host's next
launch. `--batch` requests of `--tokens` tokens each are queued first, then the engine starts;
each step's host time is read from the engine's own step trace (`--step-trace`: the time
before the launch, the launch and the postprocess), and the figure is the median step at the
full batch.

    python -m bench.engine_host [--model models/demo] [--batch 32] [--tokens 200] [--stop STRING]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

import torch

from services.common.qos import QosLevel
from services.common.sampling import Sampling
from services.llm.engine import NativeEngine
from services.llm.interface import Job
from services.llm.kv_cache import KvConfig
from services.llm.runner import ModelRunner, RunnerConfig, StepInputs
from services.llm.scheduler import DEFAULT_MAX_PREFILL_TOKENS
from services.model.prompt import PromptBuilder
from services.model.spec import load_spec

# A step's host time, split as the step trace does: planning before the launch, the launch (staging
# the inputs; no model), the postprocess.
PARTS = ("gap", "run", "post")
PAGE_SIZE = 16  # KV positions a page: the pool holds --batch sequences of the model's context, never written


class NoModel(ModelRunner):
    """The engine's runner on the CPU with the model's work taken out: a step's forward runs nothing
    and every sampled row gets `token` (the model's weights are loaded, never run: use a small checkpoint)."""

    token = 0

    def forward(self, step: StepInputs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [], []

    def sample(self, step: StepInputs, logits: list, argmax: list) -> torch.Tensor | None:
        return torch.full((len(step.sampled),), self.token, dtype=torch.int64) if step.sampled else None


async def measure(model: str, batch: int, tokens: int, stop: tuple[str, ...]) -> dict:
    spec = load_spec(model)
    prompts = PromptBuilder(spec)
    cfg = RunnerConfig(batch, KvConfig(PAGE_SIZE, 0.0, 0.0), DEFAULT_MAX_PREFILL_TOKENS)
    runner = NoModel(spec, torch.device("cpu"), torch.float32, cfg)
    runner.token = prompts.tokenizer("a", add_special_tokens=False)["input_ids"][-1]  # a plain word piece
    sampling = Sampling(
        max_tokens=tokens, temperature=0.0, top_p=1.0, seed=None, stop=stop, min_tokens=0, ignore_eos=True
    )
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "steps.jsonl"
        engine = NativeEngine(runner, batch, prompts, tokens, prefix_cache=False, step_trace=str(trace))
        jobs = [Job(f"r{i}", "What is in the image?", [], sampling, QosLevel.STANDARD) for i in range(batch)]
        subs = [engine.submit(job) for job in jobs]
        engine.start()  # after the queueing, so that every step runs the whole batch
        for sub in subs:
            async for _ in sub.outputs():
                pass
        engine.stop()  # flushes the trace
        steps = [json.loads(line) for line in trace.read_text().splitlines()]
    full = [s for s in steps if s["decodes"] == batch]
    if not full:
        raise SystemExit(f"no step ran the whole batch of {batch}: give --tokens more than 1")
    parts = {part: statistics.median(s[f"{part}_ms"] for s in full) for part in PARTS}
    return {
        "batch": batch,
        "steps": len(full),
        "median_ms": statistics.median(sum(s[f"{part}_ms"] for part in PARTS) for s in full),
        **{f"{part}_ms": ms for part, ms in parts.items()},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.engine_host", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/demo", help="checkpoint whose tokenizer and spec are used")
    p.add_argument("--batch", type=int, default=32, help="requests decoding together (default %(default)s)")
    p.add_argument("--tokens", type=int, default=200, help="tokens each request generates (default %(default)s)")
    p.add_argument("--stop", action="append", default=[], help="a stop string every request carries (repeatable)")
    args = p.parse_args(argv)
    if args.batch < 1 or args.tokens < 2:
        p.error("--batch takes 1 or more, --tokens 2 or more (the first token comes from the prompt's step)")
    result = asyncio.run(measure(args.model, args.batch, args.tokens, tuple(args.stop)))
    batch, ms, n = result["batch"], result["median_ms"], result["steps"]
    split = ", ".join(f"{part} {result[f'{part}_ms']:.3f}" for part in PARTS)
    print(f"engine host time per step at batch {batch}: {ms:.3f} ms (median of {n}; medians: {split})")


if __name__ == "__main__":
    main()
