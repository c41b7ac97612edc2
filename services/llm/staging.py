"""A step's host-made inputs, crossing to the device in one copy.

One pinned host buffer of 32-bit words and its device twin. A step starts with `begin`,
writes its ids, positions, block tables and sampling parameters into the host side (numpy
views; floats share the words through a float32 view), then `upload` copies the used prefix once,
without blocking the host. The front `fixed` words are the decode step's inputs: their
device addresses never change, which is what a captured CUDA graph needs.

The next step is staged while the last one runs (the shared lane plans a step ahead), so
`begin` first waits for the last upload's copy to have read the host side (an event, recorded
after it: it is done by the time the step before the last ends), and a copy in flight never
reads a half-written buffer. The device side is rewritten by the next upload only after the
steps queued before it on the stream have read it.
"""

from __future__ import annotations

import numpy as np
import torch


class Staging:
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
