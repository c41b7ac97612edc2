"""bench.soak's judgement of memory growth (`growth_of`, `verdict`) on made-up series: a held heap's
one step passes the extended soak, a steady leak fails it, and a leak under the bound once is not
rescued by the extension."""

from __future__ import annotations

from bench.soak import growth_of, verdict

BOUND = 0.01


def samples(values: list[float]) -> list[dict]:
    """One sample a second of one service whose private memory (and RSS) take these values."""
    return [{"t_s": float(t), "llm": {"rss_mib": v, "private_mib": v, "fds": 20}} for t, v in enumerate(values)]


def result(series: list[float], warmup: int, duration: int, extended: bool) -> dict:
    s = samples(series)

    def growth(since: int) -> dict:
        return {"llm": growth_of([x for x in s if x["t_s"] >= since], "llm")}

    return {"lost": 0, "growth_after_warmup": growth(warmup), "growth_fresh": growth(duration) if extended else None}


def step() -> list[float]:
    """Flat at 305 MiB, a step of 6 MiB at 110 s, flat after (CI's llm on a296e3d, in outline)."""
    return [305.0 + (t % 3) * 0.5 + (6.0 if t >= 110 else 0.0) for t in range(300)]


def leak(per_2min: float) -> list[float]:
    return [300.0 * (1 + per_2min * t / 120) + (t % 3) * 0.5 for t in range(300)]


def test_a_step_the_heap_took_once_passes_once_the_fresh_window_is_flat():
    once = result(step()[:180], warmup=60, duration=180, extended=False)
    assert verdict(once, BOUND)  # over the bound at 180 s: this is what extends the soak
    assert not verdict(result(step(), warmup=60, duration=180, extended=True), BOUND)


def test_a_steady_leak_fails_the_extended_soak():
    problems = verdict(result(leak(0.012), warmup=60, duration=180, extended=True), BOUND)
    assert problems and "from --duration on" in problems[0], problems


def test_a_rise_that_stopped_in_the_first_window_fails_on_the_whole_series():
    """6% over the two minutes after the warm-up, flat after: the fresh window is flat, the whole
    series past twice the bound. A 1.2% rise that stopped passes (the step above, as a ramp)."""
    for rise, fails in ((0.06, True), (0.012, False)):
        series = [300.0 * (1 + rise * min(max(t - 60, 0), 120) / 120) + (t % 3) * 0.5 for t in range(300)]
        problems = verdict(result(series, warmup=60, duration=180, extended=True), BOUND)
        assert bool(problems) == fails, (rise, problems)
        assert not fails or "after the warm-up" in problems[0]


def test_lost_requests_and_descriptors_fail():
    r = result(leak(0.0), warmup=60, duration=180, extended=False)
    r["lost"] = 1
    r["growth_after_warmup"]["llm"]["fds"] = 3
    assert len(verdict(r, BOUND)) == 2
