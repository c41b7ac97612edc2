"""The garbage collector in a serving process: its start-up heap frozen, its pauses measured.

A process that has loaded torch, transformers and a model holds a large heap of tracked objects,
and a full collection walks them all while every thread waits on the GIL, landing in some
request's tail latency (docs/PERF.md). `freeze_startup_heap` moves everything alive once the
service is built into the permanent generation (`gc.freeze()`, as vLLM's engine and Instagram's
servers do), so later collections walk only what serving allocated. `watch_pauses` observes each
collection's pause in `vlmesh_gc_pause_seconds{service, generation}`.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)
_watching: list = []  # the callback registered, at most one per process


def freeze_startup_heap() -> int:
    """Collect once, then freeze what is left (the service's long-lived heap); returns the objects frozen."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("gc: %d objects frozen at start-up in %.0f ms", frozen, (time.perf_counter() - start) * 1e3)
    return frozen


def watch_pauses(service: str) -> None:
    """Observe every collection's pause in this process (idempotent)."""
    if _watching:
        return
    from services.common.metrics import GC_PAUSE  # prometheus_client, only in the services

    started = [0.0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            GC_PAUSE.labels(service, str(info["generation"])).observe(time.perf_counter() - started[0])

    gc.callbacks.append(callback)
    _watching.append(callback)
