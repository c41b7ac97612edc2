"""The garbage collector in a serving process: its start-up heap frozen, its pauses measured.

A process that has loaded torch, transformers and a model holds some 290,000 objects the
collector tracks. A full collection (generation 2) walks them all: 169 ms on the 2-core CPU host,
and every thread of the process waits meanwhile (the collector holds the GIL): the event loop's
streams and the engine's steps alike. Python runs one whenever the objects that survived into
the oldest generation grew by a quarter since the last, so under load it comes now and then, and
lands in some request's tail latency. `freeze_startup_heap` moves everything alive once the
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
