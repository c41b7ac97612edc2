"""Degradation before refusal (services/gateway/degrade.py), on admission alone: which refusals
degrade, to a cheaper variant or to a tenant's smaller max_tokens, and which stay refusals."""

from __future__ import annotations

import pytest

from services.common import metrics
from services.common.errors import ResourceExhausted
from services.common.qos import QosLevel
from services.common.sampling import Sampling
from services.gateway.admission import Admission
from services.gateway.config import AdmissionConfig
from services.gateway.degrade import CheaperVariant, Degrader, capped

RT, ST, BE = QosLevel.REALTIME, QosLevel.STANDARD, QosLevel.BEST_EFFORT
LONG = Sampling(max_tokens=512, temperature=0.0, top_p=1.0, seed=None, stop=(), min_tokens=0, ignore_eos=True)
DEFAULT_MAX = 256


def busy(cap_in_flight: int = 100) -> Admission:
    """Parallelism 1, stages measured: 0.1 s before decode, 20 ms a token; best-effort's budget 32 s."""
    adm = Admission(AdmissionConfig(max_in_flight={RT: 100, ST: 100, BE: cap_in_flight}, parallelism=1))
    adm.stage_s.update(preprocess=0.05, vision=0.05, prefill=0.0, decode=0.02)
    return adm


def occupy(adm: Admission, n: int) -> None:
    for _ in range(n):
        adm.admit(RT, None, 1)


def degraded(kind: str) -> float:
    return metrics.DEGRADATIONS.labels(BE.wire, kind)._value.get()


def test_a_full_queue_sends_best_effort_to_the_cheaper_variant_only():
    adm = busy(cap_in_flight=2)
    occupy(adm, 2)
    d = Degrader(adm, CheaperVariant("localhost:1", "int8", None, []))
    got = d.admit(BE, None, 16, (), None, LONG, DEFAULT_MAX)
    assert got.ticket is None and got.refusal is not None and got.refusal.reason == "queue_full"
    assert sum(adm.in_flight.values()) == 2  # a relay is not counted in flight here
    with pytest.raises(ResourceExhausted):  # pinned to this variant: it stays, and is refused
        d.admit(BE, None, 16, (("x-model-variant", "full"),), None, LONG, DEFAULT_MAX)
    with pytest.raises(ResourceExhausted):  # relayed here already: never relayed on
        d.admit(BE, None, 16, (("x-vlmesh-degraded", "relayed"),), None, LONG, DEFAULT_MAX)


@pytest.mark.parametrize("qos", [RT, ST])
def test_higher_classes_are_never_degraded(qos):
    adm = Admission(AdmissionConfig(max_in_flight={RT: 1, ST: 1, BE: 1}, parallelism=1))
    occupy(adm, 1)
    with pytest.raises(ResourceExhausted):
        Degrader(adm, CheaperVariant("localhost:1", "int8", None, [])).admit(qos, None, 16, (), 8, LONG, DEFAULT_MAX)


def test_a_tenant_cap_admits_what_fits_the_budget_with_fewer_tokens():
    adm = busy()
    occupy(adm, 5)  # 5 batches ahead: 6 x (0.1 + 0.02 x tokens) s
    d = Degrader(adm, None)
    with pytest.raises(ResourceExhausted) as refused:  # 512 tokens: 6 x 10.3 s, over 32 s
        d.admit(BE, None, 512, (), None, LONG, DEFAULT_MAX)
    assert refused.value.reason == "budget"
    before = degraded("max_tokens")
    got = d.admit(BE, None, 512, (), 64, LONG, DEFAULT_MAX)  # 64 tokens: 6 x 1.4 s
    assert got.ticket is not None and got.sampling.max_tokens == 64
    assert got.headers == (("x-vlmesh-degraded", "max_tokens=64"),)
    assert degraded("max_tokens") == before + 1 and adm.in_flight[BE] == 1
    with pytest.raises(ResourceExhausted):  # a cap still over the budget: the refusal stands
        d.admit(BE, None, 512, (), 400, LONG, DEFAULT_MAX)


def test_a_deadline_refusal_does_not_degrade():
    adm = busy()
    with pytest.raises(ResourceExhausted) as refused:
        Degrader(adm, CheaperVariant("localhost:1", "int8", None, [])).admit(BE, 0.01, 512, (), 8, LONG, DEFAULT_MAX)
    assert refused.value.reason == "deadline"


def test_capped_keeps_min_tokens_under_the_cap_and_fills_a_missing_max():
    s = capped(Sampling(None, 0.0, 1.0, None, (), 100, False), 32, DEFAULT_MAX)
    assert (s.max_tokens, s.min_tokens) == (32, 32)
    assert capped(LONG, 1000, DEFAULT_MAX).max_tokens == 512


def test_a_relay_copies_the_key_the_class_and_custom_headers_only():
    from services.gateway.degrade import relayed

    assert [k for k in ("authorization", "qos-level", "x-request-id", "x-tenant-note") if not relayed(k)] == []
    dropped = ("content-length", "connection", "user-agent", "grpc-timeout", ":authority", "traceparent", "te")
    assert [k for k in (*dropped, "x-vlmesh-degraded", "x-model-variant") if relayed(k)] == []
