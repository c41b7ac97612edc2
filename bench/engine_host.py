"""The native engine's host cost per step, with the model's work taken out.

A stand-in runner returns a token for every sampled row at once, so what a step costs here is
what the engine thread does between two steps on any device: scheduling, the postprocess
(EOS and length checks, incremental detokenization, stop strings) and handing each output to
the servicer's event loop. On a GPU that time is added to every step: the device waits for
the host's next launch. `--batch` requests of `--tokens` tokens each are queued first, then
the engine starts; the figure is the median step at the full batch.

    python -m bench.engine_host [--model models/demo] [--batch 32] [--tokens 200] [--stop STRING]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from services.common.qos import QosLevel
from services.common.sampling import Sampling
from services.llm.engine import NativeEngine
from services.llm.interface import Job
from services.model.prompt import PromptBuilder
from services.model.spec import load_spec


class NoModel:
    """A runner without a model: every sampled row gets token `token`, at once."""

    def __init__(self, spec, token: int) -> None:
        self.spec, self.token, self.page_size, self.n_pages = spec, token, 16, 8192
        self.max_context, self.device = spec.text.max_context, "cpu"

    def step(self, chunks, decodes) -> list[int]:
        for c in chunks:
            c.req.computed = c.end
        for r in decodes:
            r.computed += 1
        return [self.token] * (sum(c.completes for c in chunks) + len(decodes))

    def new_generator(self, seed):
        return None


async def measure(model: str, batch: int, tokens: int, stop: tuple[str, ...]) -> dict:
    spec = load_spec(model)
    prompts = PromptBuilder(spec)
    token = prompts.tokenizer("a", add_special_tokens=False)["input_ids"][-1]  # a plain word piece
    engine = NativeEngine(NoModel(spec, token), batch, prompts, tokens, prefix_cache=False)
    steps: list[tuple[int, float]] = []
    run = engine._step

    def timed(plan) -> None:
        start = time.perf_counter()
        run(plan)
        steps.append((len(plan.decode), time.perf_counter() - start))

    engine._step = timed
    sampling = Sampling(
        max_tokens=tokens, temperature=0.0, top_p=1.0, seed=None, stop=stop, min_tokens=0, ignore_eos=True
    )
    subs = [engine.submit(Job(f"r{i}", "What is in the image?", [], sampling, QosLevel.STANDARD)) for i in range(batch)]
    engine.start()  # after the queueing, so that every step runs the whole batch
    for sub in subs:
        async for _ in sub.outputs():
            pass
    engine.stop()
    full = [s for n, s in steps if n == batch]
    return {"batch": batch, "steps": len(full), "median_ms": 1e3 * statistics.median(full)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/demo", help="checkpoint whose tokenizer and spec are used")
    p.add_argument("--batch", type=int, default=32, help="requests decoding together (default %(default)s)")
    p.add_argument("--tokens", type=int, default=200, help="tokens each request generates (default %(default)s)")
    p.add_argument("--stop", action="append", default=[], help="a stop string every request carries (repeatable)")
    args = p.parse_args()
    result = asyncio.run(measure(args.model, args.batch, args.tokens, tuple(args.stop)))
    batch, ms, n = result["batch"], result["median_ms"], result["steps"]
    print(f"engine host time per step at batch {batch}: {ms:.3f} ms (median of {n})")


if __name__ == "__main__":
    main()
