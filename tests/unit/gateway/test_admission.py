"""Gateway admission without a mesh: limits by class, the estimate, budgets and deadlines."""

from __future__ import annotations

import argparse

import pytest

from services.common.errors import ResourceExhausted
from services.common.flags import add_flags, from_args
from services.common.qos import QosLevel
from services.common.timings import Timings
from services.gateway.admission import Admission
from services.gateway.config import AdmissionConfig

RT, ST, BE = QosLevel.REALTIME, QosLevel.STANDARD, QosLevel.BEST_EFFORT


def config(argv: list[str], parallelism: int = 2) -> AdmissionConfig:
    p = argparse.ArgumentParser()
    add_flags(p, AdmissionConfig)
    cfg = from_args(AdmissionConfig, p.parse_args([*argv, "--admission-parallelism", str(parallelism)]))
    cfg.check()
    return cfg


def test_defaults_scale_with_the_batch_and_flags_override_some_classes():
    cfg = config([], parallelism=8)
    assert cfg.max_in_flight == {RT: 64, ST: 48, BE: 24}
    assert config(["--max-in-flight", "best-effort=5"], 8).max_in_flight == {RT: 64, ST: 48, BE: 5}
    assert cfg.budget_s(RT) == pytest.approx(0.8 * 5)  # the write-ups' 800 ms of stages, x5


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--max-in-flight", "urgent=3"], "--max-in-flight"),
        (["--max-in-flight", "standard=0"], "N > 0"),
        (["--max-in-flight", "realtime=2,standard=4"], "higher class"),
        (["--max-in-flight", "standard=2.5"], "whole number"),
        (["--stage-budgets-ms", "network=5"], "--stage-budgets-ms"),
        (["--class-budget-scale", "realtime=x"], "--class-budget-scale"),
    ],
)
def test_bad_flags_name_the_flag(argv, match):
    with pytest.raises(ValueError, match=match):
        config(argv)


def test_lower_classes_are_refused_first_and_tickets_end_once():
    adm = Admission(config(["--max-in-flight", "realtime=4,standard=3,best-effort=2"]))
    tickets = [adm.admit(ST, None, 1) for _ in range(2)]
    with pytest.raises(ResourceExhausted) as err:
        adm.admit(BE, None, 1)
    assert err.value.reason == "queue_full" and err.value.retry_after_s > 0
    tickets.append(adm.admit(ST, None, 1))
    with pytest.raises(ResourceExhausted):
        adm.admit(ST, None, 1)
    tickets.append(adm.admit(RT, None, 1))
    assert adm.in_flight == {RT: 1, ST: 3, BE: 0}
    for t in tickets:
        adm.finish(t)
        adm.finish(t)  # a second end changes nothing
    assert adm.in_flight == {RT: 0, ST: 0, BE: 0}


def test_estimate_counts_only_work_ahead_and_refuses_what_cannot_finish():
    adm = Admission(config([], parallelism=2))
    t = adm.admit(ST, None, 1)
    # 10 + 20 + 30 ms of stages, decode 5 ms per token after the first (21 tokens: 100 ms)
    adm.finish(t, Timings(preprocess=0.010, vision=0.020, prefill=0.030, decode=0.100), output_tokens=21)
    assert adm.estimate_s(ST, 10)[0] == pytest.approx(0.06 + 0.05)
    held = [adm.admit(BE, None, 1) for _ in range(4)]
    assert adm.estimate_s(RT, 10)[0] == pytest.approx(0.11)  # best-effort work is not ahead of realtime
    assert adm.estimate_s(BE, 10) == pytest.approx((0.11 * 3, 0.11 * 2))  # 4 ahead, 2 at a time
    with pytest.raises(ResourceExhausted) as err:
        adm.admit(ST, deadline_s=0.05, output_tokens=10)
    assert err.value.reason == "deadline"
    # 5 s of decode, over realtime's 4 s budget, but nothing of its class ahead: an idle mesh serves it.
    alone = [adm.admit(RT, None, output_tokens=1000) for _ in range(2)]  # 2 at a time: neither waits
    with pytest.raises(ResourceExhausted) as err:
        adm.admit(RT, None, output_tokens=1000)  # the same behind a batch of it: refused
    assert err.value.reason == "budget"
    for h in alone:
        adm.finish(h)
    # 2 batches of best-effort ahead, 5.05 s each: 15 s, within best-effort's 32 s budget
    assert adm.admit(BE, None, output_tokens=1000)
    for h in held:
        adm.finish(h)


def test_an_idle_mesh_refuses_no_request_for_its_budget():
    """However slow the stages were measured, nothing ahead means nothing to wait for."""
    adm = Admission(config([], parallelism=2))
    t = adm.admit(RT, None, 16)
    adm.finish(t, Timings(preprocess=1.0, vision=2.0, prefill=3.0, decode=15.0), output_tokens=16)  # 7 s, budget 4 s
    first = adm.admit(RT, None, 16)
    second = adm.admit(RT, None, 16)  # one in flight, parallelism 2: still no batch ahead
    with pytest.raises(ResourceExhausted) as err:
        adm.admit(RT, None, 16)  # a whole batch ahead now
    assert err.value.reason == "budget"
    for h in (first, second):
        adm.finish(h)
    with pytest.raises(ResourceExhausted) as err:
        adm.admit(RT, deadline_s=1.0, output_tokens=16)  # idle, but a client deadline counts the whole estimate
    assert err.value.reason == "deadline"
