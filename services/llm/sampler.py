"""Next-token sampling on the device: greedy, temperature, top-p, per-request seeds.

No host syncs: every input is already on the device (the step's staging copy), and the
tokens come back with the rest of the step in one copy. Random draws follow vLLM's
exponential race: sampling from p is argmax(p / q) with q ~ Exp(1), and each request draws
its q from its own `torch.Generator` (seeded when the request gives a seed, randomly
otherwise). So a request's tokens do not depend on what else is in the batch, and a seeded
request repeats itself exactly.
"""

from __future__ import annotations

import torch

MIN_TEMPERATURE = 1e-5


def sample(
    logits: torch.Tensor,  # [n, V] fp32, EOS already masked where min_tokens forbids it
    temperature: torch.Tensor,  # [n] fp32, 0 = greedy
    top_p: torch.Tensor,  # [n] fp32 in (0, 1]
    generators: list[torch.Generator | None],  # per row; None for greedy rows
    any_top_p: bool,  # whether some row has top_p < 1 (known on the host: skips the sort otherwise)
) -> torch.Tensor:
    """-> token ids [n] (int64, on the device)."""
    greedy = logits.argmax(-1)
    if all(g is None for g in generators):
        return greedy
    probs = torch.softmax(logits / temperature.clamp_min(MIN_TEMPERATURE)[:, None], dim=-1)
    if any_top_p:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the most likely token always stays).
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p[:, None]
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
    race = torch.ones_like(probs)
    for i, gen in enumerate(generators):
        if gen is not None:
            race[i].exponential_(generator=gen)
    drawn = (probs / race).argmax(-1)
    return torch.where(temperature > 0, drawn, greedy)


def new_generator(device: torch.device, seed: int | None) -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
