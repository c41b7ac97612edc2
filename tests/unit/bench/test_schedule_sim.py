"""bench.schedule_sim: the engine's scheduler under a model of each step's time."""

import argparse

import pytest

from bench.schedule_sim import OUT, StepModel, simulate

MODEL = StepModel({1: 4.0, 8: 5.0, 32: 7.0}, 0.5, 14.0, 40.0, 4.6, 0.1, 2.0)


def args(**kw) -> argparse.Namespace:
    base = {"max_batch": 32, "max_prefill_tokens": 2048, "front_ms": 15.0, "back_ms": 2.0, "warmup": 0.0}
    return argparse.Namespace(overheads=None, **{**base, **kw})


def test_alone_a_request_takes_front_prefill_its_decode_steps_and_back():
    # 0.05 req/s over 200 s: requests never overlap, so each one's latency is exact.
    run = simulate(0.05, 200.0, seed=1, model=MODEL, args=args())
    prefill = MODEL.packed(608, 640, 0)  # 14 + 2 = 16 ms
    assert prefill == pytest.approx(16.0)
    want = 15.0 + prefill + (OUT - 1) * MODEL.decode(1) + 2.0
    assert run["e2e"] and all(e == pytest.approx(want) for e in run["e2e"])
    assert all(t == pytest.approx(15.0 + prefill) for t in run["ttft"])


def test_under_load_decodes_ride_and_latency_grows_with_the_rate():
    low, high = (simulate(rate, 60.0, seed=2, model=MODEL, args=args()) for rate in (5.0, 30.0))
    p50 = [sorted(r["e2e"])[len(r["e2e"]) // 2] for r in (low, high)]
    assert p50[1] > p50[0]
    assert high["finished"] == high["sent"] > 1500  # every request finishes: none is lost in the schedule
