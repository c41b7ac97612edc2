"""GPU memory watermarks, as the write-ups set them: warn at 75% of the device's memory, shrink
caches at 90%, refuse best-effort work at 95%.

The share is of the whole device (every process on it: vision and llm share one GPU), read
from the driver at most every `interval_s`. Crossing a watermark upwards is logged once; at the
shrink watermark the service frees what it caches (PyTorch's cached blocks), once per
crossing; at the refuse watermark best-effort requests get
RESOURCE_EXHAUSTED with retry info, counted as rejections for `memory`; the message gives the
reading, the watermark, and how much of it this process holds against the others (another
process on the device can push a service over the mark by itself). Realtime and standard
work is never refused here. Gauges: `vlmesh_gpu_memory_used_ratio` and
`vlmesh_memory_pressure` (0 ok, 1 warn, 2 shrink, 3 refuse).

Imports no torch at module level: the configs that declare `--memory-watermarks` import it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.common.errors import ResourceExhausted
from services.common.qos import QosLevel

log = logging.getLogger(__name__)

LEVELS = ("ok", "warn", "shrink", "refuse")
RETRY_S = 1.0
GIB = 2**30


@dataclass(frozen=True)
class Watermarks:
    warn: float = 0.75
    shrink: float = 0.90
    refuse: float = 0.95

    def level(self, ratio: float) -> int:
        """0 below warn, 1 from warn, 2 from shrink, 3 from refuse."""
        return sum(ratio >= mark for mark in (self.warn, self.shrink, self.refuse))

    def text(self) -> str:
        return f"warn={self.warn:g},shrink={self.shrink:g},refuse={self.refuse:g}"


def parse_watermarks(text: str) -> Watermarks:
    """'warn=0.75,shrink=0.9,refuse=0.95' (any of them; the rest keep their defaults)."""
    problem = f"--memory-watermarks {text!r}: expected warn=F,shrink=F,refuse=F with 0 < warn <= shrink <= refuse <= 1"
    values: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        try:
            values[key.strip()] = float(value) if sep else float("nan")
        except ValueError:
            raise ValueError(problem) from None
    if not set(values) <= {"warn", "shrink", "refuse"}:
        raise ValueError(problem)
    marks = Watermarks(**values)
    if not 0 < marks.warn <= marks.shrink <= marks.refuse <= 1:
        raise ValueError(problem)
    return marks


def cuda_probe(device) -> Callable[[], tuple[int, int]]:
    """(bytes in use on the device by every process, total bytes), from the driver."""
    import torch

    def probe() -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(device)
        return total - free, total

    return probe


class MemoryGuard:
    """One service's view of its GPU's memory: the level, the shrink, the refusals."""

    def __init__(
        self,
        service: str,
        probe: Callable[[], tuple[int, int]] | None,
        marks: Watermarks,
        shrink: Callable[[], None] | None = None,
        interval_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        held: Callable[[], int] | None = None,
    ) -> None:
        """`probe` None (a CPU service): the level is always ok and nothing is refused. `held`: the
        bytes of the device this process holds (PyTorch's allocator), for the refusal's message."""
        self.service, self.probe, self.marks, self.shrink, self.held = service, probe, marks, shrink, held
        self.interval_s, self.clock = interval_s, clock
        self.ratio, self._level, self._sampled = 0.0, 0, -float("inf")
        self.used = self.total = 0  # bytes, at the last reading
        self._lock = threading.Lock()
        if probe is not None:
            from services.common.metrics import GPU_MEMORY_RATIO, MEMORY_PRESSURE

            GPU_MEMORY_RATIO.labels(service).set_function(lambda: self.sample()[0])
            MEMORY_PRESSURE.labels(service).set_function(lambda: self.sample()[1])

    @classmethod
    def for_device(cls, service: str, device, marks: Watermarks):
        """The guard of a service on `device`: watching the GPU on CUDA (shrinking frees PyTorch's
        cached blocks), inert on the CPU."""
        if getattr(device, "type", "cpu") != "cuda":
            return cls(service, None, marks)
        import torch

        return cls(
            service, cuda_probe(device), marks, torch.cuda.empty_cache, held=lambda: torch.cuda.memory_reserved(device)
        )

    def sample(self) -> tuple[float, int]:
        """(share of the device in use, level), read anew when the last reading is `interval_s` old."""
        if self.probe is None:
            return 0.0, 0
        with self._lock:
            now = self.clock()
            if now - self._sampled < self.interval_s:
                return self.ratio, self._level
            self._sampled = now
            used, total = self.probe()
            self.used, self.total = used, total
            self.ratio = used / total if total else 0.0
            level, before = self.marks.level(self.ratio), self._level
            self._level = level
        if level != before:
            say = log.warning if level > before else log.info
            say(
                "GPU memory %.1f%% in use: %s (watermarks %s)",
                100 * self.ratio,
                LEVELS[level],
                self.marks.text(),
                extra={"fields": {"memory.level": LEVELS[level], "memory.ratio": round(self.ratio, 4)}},
            )
        if level >= 2 > before and self.shrink is not None:  # once per crossing of the shrink watermark
            self.shrink()
        return self.ratio, level

    def admit(self, qos: QosLevel) -> None:
        """Refuse best-effort work (RESOURCE_EXHAUSTED, retry info) while memory is over the refuse watermark."""
        if qos is not QosLevel.BEST_EFFORT or self.probe is None:
            return
        ratio, level = self.sample()
        if level >= 3:
            from services.common.metrics import REJECTIONS

            REJECTIONS.labels(self.service, qos.wire, "memory").inc()
            err = ResourceExhausted(self._refusal(ratio), retry_after_s=RETRY_S)
            err.reason = "memory"
            raise err

    def _refusal(self, ratio: float) -> str:
        """What a refusal says: the reading, the watermark, and who holds the memory."""
        text = (
            f"GPU memory is {100 * ratio:.1f}% in use ({self.used / GIB:.2f} of {self.total / GIB:.2f} GiB), over "
            f"the {100 * self.marks.refuse:g}% watermark (--memory-watermarks {self.marks.text()})"
        )
        if self.held is not None:
            held = self.held()
            text += (
                f": this process ({self.service}, pid {os.getpid()}) holds {held / GIB:.2f} GiB through PyTorch, "
                f"other processes and CUDA contexts {max(0, self.used - held) / GIB:.2f} GiB"
            )
        return text + "; best-effort requests are refused until it falls"
