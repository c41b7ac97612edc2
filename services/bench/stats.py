"""Percentiles and summaries, written out so that the harness's own test can check them."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default method). NaN for an empty sample."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float | None]:
    """n, mean, P50, P90 and P99; None where there is no sample (results.json holds null: JSON has no NaN)."""
    if not values:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    return {
        "n": len(values),
        "mean": sum(values) / len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }


def exponential_ks(samples: Sequence[float], rate: float) -> float:
    """Kolmogorov-Smirnov distance between `samples` and Exponential(rate)."""
    xs = sorted(samples)
    n = len(xs)
    d = 0.0
    for i, x in enumerate(xs):
        cdf = 1.0 - math.exp(-rate * x)
        d = max(d, (i + 1) / n - cdf, cdf - i / n)
    return d
