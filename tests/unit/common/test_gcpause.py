"""services/common/gcpause.py: the start-up heap frozen, each collection's pause observed."""

import gc

from prometheus_client import REGISTRY

from services.common import gcpause


def full_collections() -> float:
    samples = REGISTRY.get_sample_value
    return sum(
        samples("vlmesh_gc_pause_seconds_count", {"service": s, "generation": "2"}) or 0 for s in ("test", "other")
    )


def test_each_collection_is_observed_once():
    gcpause.watch_pauses("test")
    gcpause.watch_pauses("other")  # a second call registers nothing more
    gc.disable()  # no automatic collection in between (threads left by earlier tests allocate too)
    try:
        before = full_collections()
        gc.collect()
        assert full_collections() == before + 1
    finally:
        gc.enable()


def test_the_startup_heap_is_frozen_and_what_comes_later_is_not():
    try:
        assert gcpause.freeze_startup_heap() == gc.get_freeze_count() > 1000
        late = [[i] for i in range(10)]  # after the freeze: in a generation collections walk
        assert any(x is late for x in gc.get_objects())
        assert len(gc.get_objects(2)) < gc.get_freeze_count() / 10  # a full collection walks few now
    finally:
        gc.unfreeze()
