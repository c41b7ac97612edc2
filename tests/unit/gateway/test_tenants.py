"""Tenant keys, QoS caps and token buckets."""

from __future__ import annotations

import json
import time

import pytest

from services.common.errors import PermissionDenied, ResourceExhausted, Unauthenticated
from services.common.qos import QosLevel
from services.gateway.tenants import TenantRegistry, TokenBucket


def registry(tmp_path, **overrides) -> TenantRegistry:
    tenant = {"id": "acme", "api_keys": ["k1", "k2"], "max_qos": "standard", "requests_per_second": 2, "burst": 2}
    tenant.update(overrides)
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": [tenant, {"id": "rt", "api_keys": ["k3"], "max_qos": "realtime"}]}))
    return TenantRegistry.load(path)


def test_keys(tmp_path):
    reg = registry(tmp_path)
    assert reg.authenticate([("authorization", "Bearer k2")]).id == "acme"
    assert reg.authenticate([("authorization", "bearer k3")]).id == "rt"
    for md in ([], [("authorization", "Bearer nope")], [("authorization", "Basic k1")]):
        with pytest.raises(Unauthenticated):
            reg.authenticate(md)


def test_qos_cap_and_request_rate(tmp_path):
    reg = registry(tmp_path)
    acme = reg.authenticate([("authorization", "Bearer k1")])
    with pytest.raises(PermissionDenied, match="standard or lower"):
        reg.admit(acme, QosLevel.REALTIME)
    reg.admit(acme, QosLevel.STANDARD)
    reg.admit(acme, QosLevel.BEST_EFFORT)  # burst of 2 used up
    with pytest.raises(ResourceExhausted) as info:
        reg.admit(acme, QosLevel.STANDARD)
    assert 0 < info.value.retry_after_s <= 0.5
    time.sleep(info.value.retry_after_s + 0.05)
    reg.admit(acme, QosLevel.STANDARD)


def test_output_token_budget(tmp_path):
    reg = registry(tmp_path, requests_per_second=100, burst=100, output_tokens_per_second=100, token_burst=50)
    acme = reg.authenticate([("authorization", "Bearer k1")])
    reg.admit(acme, QosLevel.STANDARD)
    acme.tokens.charge(80)  # the request generated more than the bucket held
    with pytest.raises(ResourceExhausted, match="output-token rate") as info:
        reg.admit(acme, QosLevel.STANDARD)
    assert 0.2 < info.value.retry_after_s <= 0.3


def test_bucket_refills_to_capacity():
    bucket = TokenBucket(rate=1000, capacity=3)
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take() > 0
    time.sleep(0.01)
    assert bucket.take() == 0.0


@pytest.mark.parametrize(
    "bad",
    [
        '{"tenants": [{"id": "x"}]}',
        "not json",
        '{"tenants": [{"id": "x", "api_keys": ["a"], "max_qos": "gold"}]}',
        '{"tenants": [{"id": "x", "api_keys": ["a"]}, {"id": "y", "api_keys": ["a"]}]}',
    ],
)
def test_bad_files_are_rejected(tmp_path, bad):
    path = tmp_path / "t.json"
    path.write_text(bad)
    with pytest.raises(ValueError, match="--tenants"):
        TenantRegistry.load(path)
