"""bench.soak's judgement of memory growth, run as its users run it (`python -m bench.soak --judge
FILE` on a saved soak's JSON) on made-up series: a held heap's one step passes the extended soak,
a steady leak fails it, and so does a rise that stopped within the first window."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import ROOT

BOUND = "0.01"


def judge(tmp_path, series: list[float], extended: bool, lost: int = 0, fds: int = 20) -> tuple[int, str]:
    """Exit status and stderr of `bench.soak --judge` on one service ('llm') whose private memory
    and RSS take these values, a sample a second, after 60 s of warm-up and 180 s of load."""
    samples = [
        {"t_s": float(t), "shm_segments": 0, "llm": {"rss_mib": v, "private_mib": v, "fds": fds if t > 200 else 20}}
        for t, v in enumerate(series)
    ]
    saved = {
        "args": {"warmup": 60.0, "duration": 180.0},
        "lost": lost,
        "extended": {"to_s": 300.0} if extended else None,
        "load_end_s": float(len(series) - 1),
        "samples": samples,
    }
    path = tmp_path / "soak.json"
    path.write_text(json.dumps(saved))
    cmd = [
        sys.executable,
        "-m",
        "bench.soak",
        "--judge",
        str(path),
        "--max-growth",
        BOUND,
        "--judge-memory",
        "rss,private",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    return done.returncode, done.stderr


def step(until: int = 300) -> list[float]:
    """Flat at 305 MiB, a step of 6 MiB at 110 s, flat after (CI's llm on a296e3d, in outline)."""
    return [305.0 + (t % 3) * 0.5 + (6.0 if t >= 110 else 0.0) for t in range(until)]


def test_a_step_the_heap_took_once_passes_once_the_fresh_window_is_flat(tmp_path):
    code, err = judge(tmp_path, step(181), extended=False)
    assert code == 1 and "after the warm-up" in err  # over the bound at 180 s: this is what extends the soak
    assert judge(tmp_path, step(), extended=True) == (0, "")


def test_a_steady_leak_fails_the_extended_soak(tmp_path):
    leak = [300.0 * (1 + 0.012 * t / 120) + (t % 3) * 0.5 for t in range(300)]
    code, err = judge(tmp_path, leak, extended=True)
    assert code == 1 and "from --duration on" in err, err


def test_a_rise_that_stopped_in_the_first_window_fails_on_the_whole_series(tmp_path):
    """6% over the two minutes after the warm-up, flat after: the fresh window is flat, the whole
    series past twice the bound. A 1.2% rise that stopped passes (the step above, as a ramp)."""
    for rise, fails in ((0.06, True), (0.012, False)):
        series = [300.0 * (1 + rise * min(max(t - 60, 0), 120) / 120) + (t % 3) * 0.5 for t in range(300)]
        code, err = judge(tmp_path, series, extended=True)
        assert code == int(fails), (rise, err)
        assert not fails or "after the warm-up" in err


def test_lost_requests_and_descriptors_fail_and_a_bad_file_is_named(tmp_path):
    code, err = judge(tmp_path, [300.0] * 300, extended=False, lost=1, fds=23)
    assert code == 1 and "1 requests lost" in err and "more open descriptors" in err, err
    (tmp_path / "bad.json").write_text("{}")
    cmd = [sys.executable, "-m", "bench.soak", "--judge", str(tmp_path / "bad.json")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "bad.json: not a soak's JSON" in done.stderr, done.stderr
