"""The workloads of BENCHMARKS.md: W1 short, W2 long, W3 repeat (Zipf over a pool of 50), W4 many
(two 1280x720 pictures a request).

Pictures are the demo task's shapes (services/model/shapes.py) resized to the workload's
size and encoded as JPEG (quality 90), made locally. Prompts are padded to the workload's
token length with the served model's tokenizer; output length is forced with
min_tokens = max_tokens and ignore_eos, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.common.qos import QosLevel
from services.model.shapes import encode, render


@dataclass(frozen=True)
class Workload:
    name: str
    image_size: int | tuple[int, int]  # a square's side, or (width, height)
    prompt_tokens: int
    output_tokens: int
    pool: int | None = None  # draw images from a pool of this size (else all distinct)
    zipf_s: float = 1.1
    images: int = 1  # pictures a request

    @property
    def picture_size(self) -> tuple[int, int]:
        size = self.image_size
        return (size, size) if isinstance(size, int) else size


WORKLOADS = {
    "W1": Workload("W1", 224, 32, 16),
    "W2": Workload("W2", 384, 128, 16),
    "W3": Workload("W3", 224, 32, 16, pool=50),
    "W4": Workload("W4", (1280, 720), 64, 16, images=2),
}

BASE_PROMPT = "What is in the image?"


@dataclass(frozen=True)
class BenchRequest:
    index: int
    images: tuple[bytes, ...]  # in prompt order, before the text
    image_key: int  # the first picture's: equal keys mean equal bytes (W3 repeats)
    prompt: str
    max_tokens: int
    qos: QosLevel


FILLERS = (" image", " shape", " a", " the", " more", " x")


def padded_prompt(tokenizer, n_tokens: int) -> str:
    """BASE_PROMPT followed by a filler word that costs one token each, to n_tokens text tokens
    (the closest below when no filler is a single token)."""

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    base = count(BASE_PROMPT)
    if n_tokens <= base:
        return BASE_PROMPT
    for filler in FILLERS:
        if count(BASE_PROMPT + filler * 3) - base == 3:
            return BASE_PROMPT + filler * (n_tokens - base)
    text = BASE_PROMPT
    while count(text + FILLERS[-1]) <= n_tokens:
        text += FILLERS[-1]
    return text


# Distinct image keys a run may take: run r's request i is key r * RUN_KEYS + i.
RUN_KEYS = 10**6


class RequestFactory:
    """Request i of a run is fixed by (seed, run, i): picture, QoS class, pool draw.

    `run` numbers the runs of one bench invocation. A workload of distinct images gives each run
    images of its own, so a later rate of a sweep is not served from the prefix cache the earlier
    runs filled (docs/PERF.md). A pool (W3) is one set of images for every run, as its users send them.
    """

    def __init__(
        self, workload: Workload, tokenizer, seed: int, qos_mix: tuple[float, float, float], run: int = 0
    ) -> None:
        self.workload = workload
        self.seed = seed
        self.first_key = run * RUN_KEYS
        self.prompt = padded_prompt(tokenizer, workload.prompt_tokens)
        self.prompt_tokens = len(tokenizer(self.prompt, add_special_tokens=False)["input_ids"])
        total = sum(qos_mix)
        self.qos_p = np.array(qos_mix) / total
        self._cache: dict[int, bytes] = {}
        if workload.pool:
            ranks = np.arange(1, workload.pool + 1, dtype=np.float64)
            self.pool_p = ranks**-workload.zipf_s / (ranks**-workload.zipf_s).sum()

    def image(self, key: int) -> bytes:
        data = self._cache.get(key)
        if data is None:
            # A pool draws its pictures from another stream than the distinct ones: a W3 run after a
            # W1 run on the same mesh must not find its pool in the feature cache already.
            stream = 17 if self.workload.pool else 7
            pic = render(np.random.default_rng([self.seed, stream, key]))
            data = encode(pic.image.resize(self.workload.picture_size), "JPEG", 90)
            if self.workload.pool:
                self._cache[key] = data  # a pool is small; distinct images are not kept
        return data

    def make(self, i: int) -> BenchRequest:
        rng = np.random.default_rng([self.seed, 11, i])
        n = self.workload.images
        key = int(rng.choice(self.workload.pool, p=self.pool_p)) if self.workload.pool else self.first_key + i * n
        qos = QosLevel(int(rng.choice(3, p=self.qos_p)))
        images = tuple(self.image(key + j) for j in range(n))  # several: distinct keys (no pool has several)
        return BenchRequest(i, images, key, self.prompt, self.workload.output_tokens, qos)
