"""Per-request state of the llm engine.

Imports no torch (tensors appear in type hints only), so the scheduler that orders these
requests stays a pure policy.

Who changes what: the scheduler changes a request's place in line and its KV pages
(`status` WAITING <-> RUNNING, `blocks`, `prefill_target`, `preempted_at`, and where its prefill
starts: `computed`, past the pages it shares from the prefix cache, or 0); the model runner
changes its tensors and KV state (`computed`, `image_features`); the engine changes its outputs,
its stage clocks and `status` FINISHED.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from services.common.qos import QosLevel
from services.common.sampling import Sampling
from services.common.timings import Timings

if TYPE_CHECKING:
    import torch

    from services.llm.detokenizer import Detokenizer
    from services.llm.interface import Leases


class Status(enum.Enum):
    WAITING = "waiting"  # queued: new, or preempted and waiting to resume by recomputation
    RUNNING = "running"  # admitted: it holds a batch place and the KV pages of its whole sequence
    FINISHED = "finished"  # its last output is out; what it holds goes once no launched step holds it


class Finish(enum.Enum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the context
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # the engine failed this request


@dataclass
class Output:
    """What the engine hands back after a step: a delta, and on the last one, the end."""

    text: str
    token_ids: list[int]
    finish: Finish | None = None
    error: str | Exception | None = None  # an Exception carries its own gRPC status (services/common/errors)


@dataclass
class Request:
    id: str
    prompt_ids: list[int]  # image positions hold the image token id
    image_positions: list[int]  # first prompt position of each image's features
    image_features: list[torch.Tensor]  # each [its tokens, H]; may alias the vision arena (see leases)
    text_tokens: int
    sampling: Sampling
    max_new: int  # resolved: sampling.max_tokens or what the context leaves
    qos: QosLevel
    detok: Detokenizer
    emit: Callable[[Output], None]  # thread-safe hand-off to the caller's event loop
    arrival: float = field(default_factory=time.perf_counter)
    status: Status = Status.WAITING
    image_keys: list[bytes] = field(default_factory=list)  # per image, b"" unknown (see `images`)
    output_ids: list[int] = field(default_factory=list)
    # KV pages held while running, in position order: page i holds positions
    # [i * page_size, (i + 1) * page_size). Reserved at admission for the whole sequence
    # (prompt + max_new), so a running request never waits for memory mid-decode.
    blocks: list[int] = field(default_factory=list)
    prefill_target: int = 0  # positions the prefill covers: the prompt, and after a preemption the tokens so far
    computed: int = 0  # positions whose K/V are in the cache
    # Prefix cache: the keys of the prompt's full pages (None until the scheduler needs them),
    # how many of its pages are registered in the pool, whether its pages' parts are, and the
    # prompt positions its first admission found cached (usage.cached_tokens).
    page_keys: list[bytes] | None = None
    part_keys: dict[int, list[tuple[int, bytes]]] = field(default_factory=dict)  # by page (PrefixCache._parts)
    registered: int = 0
    parts_registered: bool = False
    cached_tokens: int = 0
    # (source page, positions): the leading positions of a cached page that match its prompt, to be
    # copied into its own page of the same index before its prefill (set at admission, done by the
    # runner before the step's forward).
    kv_copy: tuple[int, int] | None = None
    generator: torch.Generator | None = None
    # Multimodal RoPE (services/model/mrope.py): the prompt's positions [3, prompt_len], and the
    # offset of every later position (index + rope_delta); None and 0 for plain RoPE.
    mrope: np.ndarray | None = None
    rope_delta: int = 0
    # Launched steps that hold it and whose tokens are not back yet (0-2). While it is in one, its
    # pages and leases are not released (a step may still read or write them).
    in_flight: int = 0
    # Sent as content keys alone (cached_image_keys): `image_features` are placeholders of the right
    # length, never read. It runs only if the prefix cache holds every image position, and is never
    # preempted (a resume would recompute them).
    features_cached: bool = False
    # Copy the features before the prefill reads them: they alias the vision's memory, whose
    # lease ends after the prefill, and this request may be preempted and recomputed later.
    copy_features: bool = False
    # Features read in place from the vision arena (CUDA IPC): verified before and after the
    # prefill reads them, then released (once, see drop_leases).
    leases: Leases | None = None
    preempted_at: list[float] = field(default_factory=list)  # scheduler clock, once per preemption
    # Stage clocks (perf_counter seconds), for the final message's timings.
    scheduled_at: float = 0.0
    prefill_done_at: float = 0.0
    finished_at: float = 0.0

    def drop_leases(self) -> None:
        leases, self.leases = self.leases, None
        if leases is not None:
            leases.release()

    def rope_positions(self, start: int, end: int) -> np.ndarray:
        """The M-RoPE positions [end - start, 3] of sequence indices [start, end)."""
        out = np.repeat(np.arange(start + self.rope_delta, end + self.rope_delta, dtype=np.int32)[:, None], 3, axis=1)
        upto = min(end, self.prompt_len)
        if upto > start and self.mrope is not None:
            out[: upto - start] = self.mrope[:, start:upto].T
        return out

    def token_at(self, position: int) -> int:
        """The token id at a position of its sequence (prompt, then generated)."""
        n = len(self.prompt_ids)
        return self.prompt_ids[position] if position < n else self.output_ids[position - n]

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def seq_len(self) -> int:
        """Prompt and generated tokens: the positions a prefill starting now would cover."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prefill_target

    @property
    def unseen(self) -> int:
        """Tokens sampled by launched steps and not back yet: 1 from the launch of the step that
        samples its next token until that step's tokens are processed (the engine plans the next
        step meanwhile, feeding it this token on the device), else 0."""
        if self.prefilling or self.status is not Status.RUNNING:
            return 0
        return max(0, self.computed + 1 - self.seq_len)

    @property
    def generated(self) -> int:
        """Tokens sampled so far, the unseen one included."""
        return len(self.output_ids) + self.unseen

    @property
    def features_end(self) -> int:
        """One past the last position that reads image features (0 without images)."""
        return max((p + f.shape[0] for p, f in zip(self.image_positions, self.image_features, strict=True)), default=0)

    @property
    def images(self) -> list[tuple[int, int, bytes]]:
        """(first position, positions, content key) of each image; b"" where the key is unknown."""
        keys = self.image_keys or [b""] * len(self.image_features)
        return [(p, f.shape[0], k) for p, f, k in zip(self.image_positions, self.image_features, keys, strict=True)]

    @property
    def image_tokens(self) -> int:
        return sum(f.shape[0] for f in self.image_features)

    def timings(self) -> Timings:
        """The llm's stages of a finished request."""
        return Timings(
            llm_queue=self.scheduled_at - self.arrival,
            prefill=self.prefill_done_at - self.scheduled_at,
            decode=self.finished_at - self.prefill_done_at,
        )
