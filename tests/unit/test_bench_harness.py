"""The benchmark harness checked on its own: percentiles, arrivals, and accounting."""

from __future__ import annotations

import asyncio
import math
import random

import numpy as np
import pytest

from services.bench.load import poisson_offsets, run_open_loop
from services.bench.report import summarize_run
from services.bench.stats import exponential_ks, percentile, summarize
from services.bench.targets import Outcome
from services.bench.workloads import WORKLOADS, RequestFactory, padded_prompt


@pytest.mark.parametrize("q", [0, 1, 10, 50, 90, 99, 99.9, 100])
def test_percentiles_match_numpy(q):
    sample = list(np.random.default_rng(1).lognormal(3, 1, 1001))
    assert percentile(sample, q) == pytest.approx(float(np.percentile(sample, q)))


def test_percentiles_on_a_known_sample():
    sample = list(range(1, 101))  # 1..100
    s = summarize(sample)
    assert (s["p50"], s["p90"], s["p99"], s["mean"]) == (50.5, 90.1, 99.01, 50.5)
    assert math.isnan(percentile([], 50))


def test_poisson_interarrivals():
    rate, duration = 20.0, 500.0
    offsets = poisson_offsets(rate, duration, np.random.default_rng(7))
    gaps = np.diff([0.0, *offsets])
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    assert len(offsets) == pytest.approx(rate * duration, rel=0.05)
    # Kolmogorov-Smirnov against Exponential(rate): critical value at alpha = 0.01 is 1.63 / sqrt(n).
    assert exponential_ks(gaps, rate) < 1.63 / math.sqrt(len(gaps))
    # ...and the test has teeth: uniform gaps with the same mean fail it.
    uniform = np.random.default_rng(7).uniform(0, 2 / rate, len(gaps))
    assert exponential_ks(uniform, rate) > 1.63 / math.sqrt(len(gaps))


class FlakyTarget:
    """Answers OK, errors, or raises, at random; never loses a request."""

    def __init__(self) -> None:
        self.rng = random.Random(3)

    async def send(self, req):
        await asyncio.sleep(self.rng.uniform(0, 0.02))
        roll = self.rng.random()
        if roll < 0.1:
            raise RuntimeError("target bug")
        if roll < 0.3:
            return Outcome("RESOURCE_EXHAUSTED", 0.001)
        return Outcome("OK", 0.01, 0.004, 16, {"prefill": 1.0})


def test_sent_equals_sum_of_statuses(tiny_model):
    from transformers import AutoTokenizer

    factory = RequestFactory(WORKLOADS["W3"], AutoTokenizer.from_pretrained(tiny_model), 0, (0.2, 0.6, 0.2))
    records, client = asyncio.run(run_open_loop(FlakyTarget(), factory, 200.0, 1.0, seed=0, progress=False))
    summary = summarize_run(records, 200.0, 1.0, 0.2, client)
    assert summary["sent"] == sum(summary["statuses"].values()) > 150
    assert summary["lost"] == 0
    assert set(summary["statuses"]) == {"OK", "RESOURCE_EXHAUSTED", "CLIENT_RuntimeError"}
    assert summary["tpot_ms"]["p50"] == pytest.approx(6 / 15)
    qos = [r.request.qos for r in records]
    assert 0.1 < sum(q.wire == "realtime" for q in qos) / len(qos) < 0.3


def test_workload_requests(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert len(tok(padded_prompt(tok, 32), add_special_tokens=False)["input_ids"]) == 32
    w3 = RequestFactory(WORKLOADS["W3"], tok, 0, (0.2, 0.6, 0.2))
    keys = [w3.make(i).image_key for i in range(400)]
    assert set(keys) <= set(range(50)) and keys.count(0) > keys.count(49)  # Zipf: rank 1 is most common
    w1 = RequestFactory(WORKLOADS["W1"], tok, 0, (0.2, 0.6, 0.2))
    assert len({w1.make(i).image for i in range(20)}) == 20  # all distinct
    assert w1.make(3).image == w1.make(3).image  # but reproducible
