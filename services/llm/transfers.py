"""A step's traffic between host and device: its inputs up in one copy, its tokens back in one.

`Staging`: one pinned host buffer of 32-bit words and its device twin. A step starts with `begin`,
writes its ids, positions, block tables and sampling parameters into the host side (numpy views;
floats share the words through a float32 view), then `upload` copies the used prefix once,
without blocking the host. The front `fixed` words are the decode step's inputs: their device
addresses never change, which is what a captured CUDA graph needs. The next step is staged while
the last one runs (the engine's `OneAhead` pacing), so `begin` first waits for the last upload's
copy to have read the host side (an event recorded after it), and a copy in flight never reads a
half-written buffer.

`TokenFetch`: a step's tokens to the host, one copy into pinned memory and one sync. The tokens
also stay on the device (`tokens`), where the next step, launched before this one's tokens are
read, takes the ones it feeds (services/llm/runner.py); the runner alternates two fetches, so the
step in flight and the one after it never share a buffer. With `timed` on (`--step-trace`),
`mark()` records an event as the step's first device work is queued and the event that ends the
step closes the span: `device_ms` is the device's time from the step's first work to its last,
and the host clock at the mark and after the sync splits a step into host staging, device time,
and the rest (the device starting late, the engine thread's wake-up after the sync).
"""

from __future__ import annotations

import time

import numpy as np
import torch


class Staging:
    """A step's inputs, staged on the host and uploaded in one copy."""

    def __init__(self, capacity: int, fixed: int, device: torch.device) -> None:
        on_gpu = device.type == "cuda"
        self.host = torch.zeros(capacity, dtype=torch.int32, pin_memory=on_gpu)
        self.dev = torch.zeros(capacity, dtype=torch.int32, device=device) if on_gpu else self.host
        self._np = self.host.numpy()
        self.capacity, self.fixed, self._cursor = capacity, fixed, fixed
        self._read = torch.cuda.Event() if on_gpu else None  # the last upload has read the host side
        self._uploaded = False

    def fixed_view(self, start: int, n: int) -> tuple[np.ndarray, torch.Tensor]:
        """Words [start, start + n) of the fixed front: (host view to write, device view to read)."""
        return self._np[start : start + n], self.dev[start : start + n]

    def ints(self, values) -> torch.Tensor:
        """Stage int values after the fixed front; returns their device view (valid after `upload`)."""
        n = len(values)
        at = self._take(n)
        self._np[at : at + n] = values
        return self.dev[at : at + n]

    def floats(self, values) -> torch.Tensor:
        """Stage float32 values; returns their device view (valid after `upload`)."""
        n = len(values)
        at = self._take(n)
        self._np[at : at + n].view(np.float32)[:] = values
        return self.dev[at : at + n].view(torch.float32)

    def _take(self, n: int) -> int:
        at = self._cursor
        if at + n > self.capacity:
            raise RuntimeError(f"step inputs need {at + n} staging words, {self.capacity} allocated")
        self._cursor += n
        return at

    def begin(self) -> None:
        """Start a step's staging (also after a step that failed half-way through its own)."""
        if self._uploaded:
            self._read.synchronize()
            self._uploaded = False
        self._cursor = self.fixed

    def upload(self) -> None:
        """Copy what this step staged to the device, asynchronously."""
        if self.dev is not self.host:
            self.dev[: self._cursor].copy_(self.host[: self._cursor], non_blocking=True)
            self._read.record()
            self._uploaded = True


class TokenFetch:
    """A step's tokens, back to the host in one copy after one sync."""

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
