"""A step's tokens to the host: one copy into pinned memory, one sync.

The tokens also stay on the device (`tokens`), where the next step, launched before this one's
tokens are read, takes the ones it feeds (services/llm/runner.py). A lane has two fetches and
alternates them, so the step in flight and the one after it never share a buffer.

With `timed` on (the engine's `--step-trace`), it also says where a CUDA step's time went:
`mark()` records an event as the step's first device work is queued, and the event that ends
the step closes the span, so `device_ms` is the device's time from the step's first work to its
last (its kernels, and any wait for another process's kernels on the same GPU). The host clock
is read at the mark and after the sync, so a trace can split a step into host staging, device
time, and the rest: the device starting late (another process's turn on a time-sliced GPU) and
the engine thread's wake-up after the sync (a wait for the GIL).
"""

from __future__ import annotations

import time

import torch


class TokenFetch:
    def __init__(self, max_batch: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self._host = torch.zeros(max_batch, dtype=torch.int64, pin_memory=cuda)
        self.tokens = torch.zeros(max_batch, dtype=torch.int64, device=device)  # the last step's, on the device
        self._done = torch.cuda.Event(enable_timing=True) if cuda else None
        self._start = torch.cuda.Event(enable_timing=True) if cuda else None
        self.timed = False
        self.marked_at = 0.0  # host clock (time.perf_counter) at mark(), when timed
        self._marked = False
        self._n, self._tokens = 0, []

    def mark(self) -> None:
        """The step's device work starts now (call before its first upload or launch)."""
        if self.timed:
            self.marked_at = time.perf_counter()
            self._marked = self._start is not None
            if self._marked:
                self._start.record()

    def start(self, tokens: torch.Tensor | None) -> None:
        """Queue the step's tokens' copy to the host and the event that ends the step (no sync)."""
        self._n = 0 if tokens is None else tokens.shape[0]
        if self._n:
            self.tokens[: self._n].copy_(tokens)
        if self._done is None:  # CPU: the tensor is already there
            self._tokens = [] if tokens is None else tokens.tolist()
            return
        if self._n:
            self._host[: self._n].copy_(self.tokens[: self._n], non_blocking=True)
        self._done.record()

    def ready(self) -> bool:
        """Whether the started step has ended (its tokens can be read without waiting)."""
        return self._done is None or self._done.query()

    def wait(self) -> list[int]:
        """The started step's tokens, once it has ended (the host sync)."""
        if self._done is None:
            return self._tokens
        self._done.synchronize()
        return self._host[: self._n].tolist()

    def fetch(self, tokens: torch.Tensor | None) -> list[int]:
        """The step's tokens (None: it sampled none, but still ends when its work does)."""
        self.start(tokens)
        return self.wait()

    def device_ms(self) -> float | None:
        """The last timed step's device span, mark to end (None on the CPU or when not timed)."""
        if not self._marked:
            return None
        self._marked = False
        return self._start.elapsed_time(self._done)
