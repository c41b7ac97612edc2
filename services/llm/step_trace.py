"""A per-step trace of the native engine, for finding where a loaded engine's time goes.

With `--step-trace PATH` the engine thread appends one JSON line per step: when its launch began
(`t`, seconds of the host's monotonic clock); the host time before it (`gap_ms`: draining the
inbox and scheduling, since the previous step ended or the engine woke); the step itself
(`run_ms`: launch to the host sync that ends it, so the device time plus its launches); the
postprocess (`post_ms`: EOS, stop strings, detokenizing, handing outputs to the event loop); and
what the step carried (`prompts`, `prompt_rows`, `decodes`). On CUDA `run_ms` is split further
(services/llm/transfers.py): `stage_ms`, the host's staging before the step's first device work;
`device_ms`, the device's span from that work to the step's end; and `wake_ms`, the rest: the
GPU taking the step's first work late (another process's turn on a time-sliced GPU) and the
engine thread running again after the sync (a wait for the GIL).
On CUDA the engine launches a step before the one ahead of it is handed out (services/llm/engine.py, `OneAhead`), so
a step's span starts at its launch or at the end of the last step's handling, whichever is later:
the spans do not overlap, and a step launched ahead has no gap and no staging of its own.
`python -m bench.step_trace PATH` sums it up.

Lines are buffered and written in blocks, so a step pays a list append; the file is flushed
when the engine stops.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

FLUSH_EVERY = 512  # steps


class StepTrace:
    def __init__(self, path: str | Path) -> None:
        self._file = open(path, "a", encoding="utf-8")  # held for the engine's life
        self._rows: list[str] = []
        self._last_end = time.perf_counter()

    def record(
        self,
        launched: float,
        ran: float,
        end: float,
        rows: int,
        prompts: int,
        decodes: int,
        marked: float = 0.0,
        device_ms: float | None = None,
    ) -> None:
        """One step's clock readings (time.perf_counter) and what it carried; `marked` (the host
        clock at its first device work) and `device_ms` where the device timed it."""
        start = max(launched, self._last_end)
        row = {
            "t": round(start, 6),
            "gap_ms": round((start - self._last_end) * 1e3, 3),
            "run_ms": round((ran - start) * 1e3, 3),
            "post_ms": round((end - ran) * 1e3, 3),
            "prompts": prompts,
            "prompt_rows": rows,
            "decodes": decodes,
        }
        if device_ms is not None:
            row["stage_ms"] = round(max(0.0, marked - start) * 1e3, 3)
            row["device_ms"] = round(device_ms, 3)
            row["wake_ms"] = round(max(0.0, (ran - max(marked, start)) * 1e3 - device_ms), 3)
        self._last_end = end
        self._rows.append(json.dumps(row))
        if len(self._rows) >= FLUSH_EVERY:
            self.flush()

    def idle(self) -> None:
        """The engine waited for work: the next step's gap starts now, not at the last step's end."""
        self._last_end = time.perf_counter()

    def flush(self) -> None:
        if self._rows:
            self._file.write("\n".join(self._rows) + "\n")
            self._file.flush()
            self._rows.clear()

    def close(self) -> None:
        self.flush()
        self._file.close()
