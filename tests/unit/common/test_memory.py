"""GPU memory watermarks with a fake device: levels, the shrink once per crossing, refusals of best-effort only."""

from __future__ import annotations

import os

import pytest

from services.common.errors import ResourceExhausted
from services.common.memory import MemoryGuard, Watermarks, parse_watermarks
from services.common.qos import QosLevel
from tests.helpers import sample


class Device:
    def __init__(self) -> None:
        self.used, self.total, self.reads = 0, 100, 0

    def probe(self) -> tuple[int, int]:
        self.reads += 1
        return self.used, self.total


def guard(device: Device, clock: list[float], shrinks: list[int]) -> MemoryGuard:
    return MemoryGuard(
        "test", device.probe, Watermarks(), lambda: shrinks.append(1), interval_s=0.5, clock=lambda: clock[0]
    )


def test_levels_follow_the_watermarks_and_the_cache_is_shrunk_once_per_crossing():
    device, clock, shrinks = Device(), [0.0], []
    g = guard(device, clock, shrinks)
    seen = []
    for used in (10, 75, 89, 90, 93, 96, 91, 50, 92):
        device.used = used
        clock[0] += 1.0
        seen.append(g.sample()[1])
    assert seen == [0, 1, 1, 2, 2, 3, 2, 0, 2]
    assert len(shrinks) == 2  # entering the shrink level at 90, and again at 92 after falling to 50


def test_readings_are_cached_for_the_interval():
    device, clock = Device(), [0.0]
    g = guard(device, clock, [])
    for _ in range(5):
        g.sample()
    assert device.reads == 1
    clock[0] += 0.6
    g.sample()
    assert device.reads == 2


def test_only_best_effort_is_refused_and_only_over_the_refuse_watermark():
    device, clock = Device(), [0.0]
    g = guard(device, clock, [])
    device.used = 94
    g.admit(QosLevel.BEST_EFFORT)  # shrink level: still admitted
    device.used, clock[0] = 97, 1.0
    for qos in (QosLevel.REALTIME, QosLevel.STANDARD):
        g.admit(qos)
    with pytest.raises(ResourceExhausted, match=r"97\.0% in use \(0\.00 of 0\.00 GiB\), over the 95% watermark") as err:
        g.admit(QosLevel.BEST_EFFORT)
    assert err.value.retry_after_s > 0 and err.value.reason == "memory"


def test_a_refusal_says_what_it_saw_and_how_much_this_process_holds_against_the_others():
    # An 80 GiB device 97% full, of which this process holds 10 GiB: the other 67.6 are someone else's
    # (the bench's in-process engine beside the mesh it started, say).
    gib = 2**30
    device, clock = Device(), [0.0]
    device.used, device.total = int(77.6 * gib), 80 * gib
    g = MemoryGuard("llm", device.probe, Watermarks(), held=lambda: 10 * gib, clock=lambda: clock[0])
    with pytest.raises(ResourceExhausted) as err:
        g.admit(QosLevel.BEST_EFFORT)
    said = err.value.message
    assert "GPU memory is 97.0% in use (77.60 of 80.00 GiB)" in said
    assert "over the 95% watermark (--memory-watermarks warn=0.75,shrink=0.9,refuse=0.95)" in said
    assert (
        f"this process (llm, pid {os.getpid()}) holds 10.00 GiB through PyTorch, "
        "other processes and CUDA contexts 67.60 GiB" in said
    )


def test_a_cpu_service_is_never_refused():
    g = MemoryGuard("cpu", None, Watermarks())
    assert g.sample() == (0.0, 0)
    g.admit(QosLevel.BEST_EFFORT)


def test_the_gauges_read_the_device_on_scrape():
    from prometheus_client import generate_latest

    device, clock = Device(), [0.0]
    guard(device, clock, [])
    device.used = 80
    text = generate_latest().decode()
    assert sample(text, 'vlmesh_gpu_memory_used_ratio{service="test"}') == pytest.approx(0.8)
    assert sample(text, 'vlmesh_memory_pressure{service="test"}') == 1.0


@pytest.mark.parametrize("text", ["warn=0.9,shrink=0.5", "warn=0", "refuse=1.5", "panic=0.9", "warn=x", "warn"])
def test_bad_watermarks_name_the_flag(text):
    with pytest.raises(ValueError, match="--memory-watermarks"):
        parse_watermarks(text)


def test_watermarks_round_trip():
    marks = parse_watermarks("warn=0.5,refuse=0.99")
    assert marks == Watermarks(0.5, 0.9, 0.99)
    assert parse_watermarks(marks.text()) == marks
