"""What `vlmesh bench` reports: strict JSON, the write-ups' figures compared like with like, and
P99s over few samples marked as such."""

from __future__ import annotations

import json

import pytest

from services.bench.load import Record
from services.bench.report import (
    FEW_SAMPLES,
    cache_table,
    compare_seeds,
    cpu_table,
    plot,
    qos_table,
    summarize_run,
    table,
    write_json,
)
from services.bench.targets import Outcome
from services.bench.workloads import BenchRequest
from services.common.qos import QosLevel


def record(i: int, outcome: Outcome, qos: QosLevel = QosLevel.STANDARD, at: float = 1.0) -> Record:
    return Record(BenchRequest(i, b"", i, "p", 4, qos), at, at, outcome)


def run_of(target: str, workload: str, p99_ms: float, rps: float) -> dict:
    e2e = {"n": 100, "mean": p99_ms, "p50": p99_ms, "p90": p99_ms, "p99": p99_ms}
    return {"target": target, "workload": workload, "summary": {"e2e_ms": e2e, "throughput_rps": rps}}


def no_nan(text: str):
    raise AssertionError(f"{text} in results.json: not JSON")


def test_a_run_with_figures_missing_writes_null_and_every_reader_copes(tmp_path):
    # Best-effort all refused (memory), the rest OK from a target that reports no stages and no first
    # token (transformers' generate): no e2e for one class, no TTFT, TPOT or stages for anyone.
    refused = [record(i, Outcome("RESOURCE_EXHAUSTED", 0.001), QosLevel.BEST_EFFORT) for i in range(3)]
    served = [record(3 + i, Outcome("OK", 0.2, None, 16)) for i in range(5)]
    summary = summarize_run(refused + served, 2.0, 5.0, 0.5, {})
    runs = [{"target": "hf", "workload": "W1", "summary": summary}]
    records = {"hf W1 2/s": refused + served}
    write_json(tmp_path / "results.json", {}, {}, runs, records)
    data = json.loads((tmp_path / "results.json").read_text(), parse_constant=no_nan)
    s = data["runs"][0]["summary"]
    assert s["ttft_ms"] == {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    assert s["outside_stages_ms"]["p99"] is None and s["by_qos"]["best-effort"]["e2e_ms"]["p50"] is None
    assert s["e2e_ms"]["p50"] == pytest.approx(200.0)
    # The tables, the comparison and the plots read the same figures, nulls included.
    runs = data["runs"]
    row = table(runs).splitlines()[1].split()
    assert row[:8] == ["hf", "W1", "2", "1.1", "18", "200.0", "200.0", "200.0"]  # req/s over 4.5 s, tok/s
    assert row[8:12] == ["-", "-", "-", "-"]  # TTFT and TPOT
    best_effort = next(line for line in qos_table(runs).splitlines() if "best-effort" in line)
    assert best_effort.split()[5:8] == ["-", "-", "-"]
    assert cache_table(runs) == "" and cpu_table(runs) == ""  # in-process: no servers
    assert "hf" in compare_seeds(runs)
    assert all(p.stat().st_size > 1000 for p in plot(tmp_path, runs, records, 0.5))


def test_the_write_ups_p99_is_compared_with_ours_at_the_same_p99():
    # Their W1: P99 387 ms at 24.1 req/s. Ours at 30 req/s has P99 500 ms (within the mesh's 800 ms
    # SLO, but not within their P99); at 20 req/s, 380 ms: that is the like of theirs.
    runs = [
        run_of("mesh", "W1", 120.0, 10.0),
        run_of("mesh", "W1", 380.0, 20.0),
        run_of("mesh", "W1", 500.0, 30.0),
        run_of("hf", "W1", 900.0, 1.2),
        run_of("mesh", "W3", 100.0, 50.0),
    ]
    lines = compare_seeds(runs).splitlines()
    mesh = next(line for line in lines if line.startswith("W1") and " mesh " in line)
    assert mesh.split()[-2:] == ["380.0", "20.0"]
    hf = next(line for line in lines if line.startswith("W1") and " hf " in line)
    assert hf.split()[-2:] == ["n/a", "n/a"]  # none of its runs held their P99
    assert next(line for line in lines if line.startswith("W2")).split()[-3:] == ["-", "n/a", "n/a"]  # not run
    assert "within theirs" in lines[-1]


def test_a_qos_class_p99_over_few_requests_is_marked_and_explained():
    few, many = FEW_SAMPLES - 1, FEW_SAMPLES
    recs = [record(i, Outcome("OK", 0.1 + i / 1000, 0.05, 4), QosLevel.REALTIME) for i in range(few)]
    recs += [record(few + i, Outcome("OK", 0.1 + i / 1000, 0.05, 4)) for i in range(many)]
    summary = summarize_run(recs, 10.0, 5.0, 0.5, {})
    lines = qos_table([{"target": "mesh", "workload": "W1", "summary": summary}]).splitlines()
    realtime = next(line for line in lines if "realtime" in line).split()
    standard = next(line for line in lines if "standard" in line).split()
    assert realtime[6].endswith("*") and realtime[7].endswith("*")  # e2e p99, TTFT p99
    assert not standard[6].endswith("*") and not standard[7].endswith("*")
    assert lines[-1].startswith(f"* a P99 over fewer than {FEW_SAMPLES} requests")
    # With enough requests in every class, no note.
    summary = summarize_run(recs[few:], 10.0, 5.0, 0.5, {})
    assert "*" not in qos_table([{"target": "mesh", "workload": "W1", "summary": summary}])


_BURN = """
import sys, time
t = time.process_time()
while time.process_time() - t < 0.3:
    pass
print("burned", flush=True)
sys.stdin.readline()
"""
_PARENT = f"""
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", {_BURN!r}], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
print(child.stdout.readline(), end="", flush=True)
sys.stdin.readline()
child.stdin.close()
child.wait()
print("reaped", flush=True)
sys.stdin.readline()
"""


def test_a_servers_cpu_keeps_the_time_of_a_child_that_ended():
    """A child's CPU stays in the server's figure after the child ends (its parent reaps it)."""
    import subprocess
    import sys

    from services.bench.cli import server_cpu_s

    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline() == "burned\n"
        alive = server_cpu_s([("llm", parent.pid)])["llm"]
        parent.stdin.write("\n")
        parent.stdin.flush()
        assert parent.stdout.readline() == "reaped\n"
        ended = server_cpu_s([("llm", parent.pid)])["llm"]
    finally:
        parent.kill()
        parent.wait()
    assert alive >= 0.3 and ended >= alive - 0.01, (alive, ended)


def test_each_servers_cpu_is_its_own_share_and_the_variants_of_one_service_are_summed():
    import os

    from services.bench.cli import cpu_cores, server_cpu_s

    before = {"gateway": 1.0, "llm": 10.0}
    after = {"gateway": 1.5, "llm": 12.0, "vision": 0.25}  # vision restarted: no earlier reading
    assert cpu_cores(before, after, 2.0) == {"gateway": 0.25, "llm": 1.0, "vision": 0.125}
    me = os.getpid()
    one, two = server_cpu_s([("llm", me)])["llm"], server_cpu_s([("llm", me), ("llm", me)])["llm"]
    assert one > 0 and two >= 2 * one - 1e-6  # two processes of one name add up (the sums round apart)
    assert server_cpu_s([("gone", 2**22 + 7)]) == {}  # a process that ended is left out
    runs = [
        {"target": "mesh", "workload": "W1", "summary": {"offered_rps": 80.0, "service_cpu_cores": after}},
        {"target": "mesh", "workload": "W1", "summary": {"offered_rps": 100.0, "service_cpu_cores": before}},
    ]
    head, first, second = cpu_table(runs).splitlines()[:3]
    assert head.split() == ["target", "wl", "load", "gateway", "llm", "vision"]
    assert first.split() == ["mesh", "W1", "80", "1.50", "12.00", "0.25"]
    assert second.split() == ["mesh", "W1", "100", "1.00", "10.00", "-"]
