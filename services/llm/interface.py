"""The Engine interface: what the llm servicer and the in-process pipeline ask of an engine.

Two engines implement it: the native one (services/llm/engine.py: scheduler, model runner,
zero-copy CUDA features) and vLLM's AsyncLLM (services/llm/vllm_engine.py). Callers hold an
`Engine` and never ask which one it is.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from services.common.qos import QosLevel
from services.common.sampling import Sampling
from services.llm.request import Output, Request

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Job:
    """One generation as an engine receives it: validated, its QoS parsed, its features opened."""

    request_id: str
    prompt: str | list[dict]  # a prompt, or a conversation (services/common/validation.py check_conversation)
    features: list[torch.Tensor]  # one [image_tokens, H] per image, in prompt order
    sampling: Sampling
    qos: QosLevel
    feature_keys: list[bytes] = field(default_factory=list)  # content key per image (b"" unknown); may be empty
    max_prompt_tokens: int = 0  # the tenant's limit on the prompt, image tokens included; 0: none
    # `features` are placeholders [image_tokens, 0]: the engine serves the prompt from its prefix
    # cache by `feature_keys` (LlmGenerateRequest.cached_image_keys), or raises FeaturesNeeded.
    features_cached: bool = False


class Leases(Protocol):
    """Features that alias the producer's memory (read in place): valid only while their leases hold."""

    def verify(self) -> None:
        """Raise FailedPrecondition unless every lease still holds (the producer cannot have reused a slot)."""

    def release(self) -> None:
        """Hand the leases back; callable from any thread, once."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of an engine's load."""

    running: int  # requests holding KV space
    waiting: int  # requests queued for it
    free_slots: int  # room for more running requests


class Submission(Protocol):
    """One submitted request: its stream of outputs, and its Request for usage and stage clocks."""

    req: Request

    def outputs(self) -> AsyncIterator[Output]:
        """Coalesced deltas; the last has `finish` set. Leaving the stream early aborts the request."""


class Engine(Protocol):
    """A decoder behind the llm service: submit, stream, abort, stats."""

    device: torch.device  # where it wants the image features

    @property
    def reads_in_place(self) -> bool:
        """Whether it reads features from the producer's memory after `submit` returns.

        True: `submit` takes the features' Leases and releases them once its prefill has read
        them. False: it copies the features during `submit`, so the caller releases them then.
        """

    @property
    def reads_cached_images(self) -> bool:
        """Whether `submit` takes a Job with `features_cached` (serving it from a prefix cache)."""

    def start(self) -> None:
        """Start serving (threads, background loops); call once, before `submit`."""

    def submit(self, job: Job, leases: Leases | None = None) -> Submission:
        """Queue a request (INVALID_ARGUMENT if its prompt leaves no room); call from the event loop."""

    def abort(self, request_id: str) -> None:
        """Stop a request (by `Submission.req.id`) soon; its stream ends with Finish.ABORT. Idempotent."""

    def stats(self) -> EngineStats:
        """The current load."""

    def stop(self) -> None:
        """Abort what is left and release the engine's resources."""
