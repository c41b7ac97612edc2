"""Tenant keys, QoS caps and token buckets."""

from __future__ import annotations

import json
import time

import pytest

from services.common.errors import PermissionDenied, ResourceExhausted, Unauthenticated
from services.common.qos import QosLevel
from services.gateway.tenants import TenantRegistry, TokenBucket


def registry_file(tmp_path, **overrides):
    tenant = {"id": "acme", "api_keys": ["k1", "k2"], "max_qos": "standard", "requests_per_second": 2, "burst": 2}
    tenant.update(overrides)
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": [tenant, {"id": "rt", "api_keys": ["k3"], "max_qos": "realtime"}]}))
    return path


def registry(tmp_path, **overrides) -> TenantRegistry:
    return TenantRegistry.load(registry_file(tmp_path, **overrides))


def test_keys(tmp_path):
    reg = registry(tmp_path)
    assert reg.authenticate([("authorization", "Bearer k2")]).id == "acme"
    assert reg.authenticate([("authorization", "bearer k3")]).id == "rt"
    for md in ([], [("authorization", "Bearer nope")], [("authorization", "Basic k1")]):
        with pytest.raises(Unauthenticated):
            reg.authenticate(md)


@pytest.mark.parametrize("header", ["k1", "Basic k1", "Bearer", "Bearer   ", "Token k1"])
def test_an_authorization_header_without_bearer_says_how_it_must_look(tmp_path, header):
    with pytest.raises(Unauthenticated) as err:
        registry(tmp_path).authenticate([("authorization", header)])
    assert err.value.message == 'authorization metadata must be "Bearer <API key>"'


def test_a_wrong_key_and_a_missing_header_keep_their_messages(tmp_path):
    reg = registry(tmp_path)
    with pytest.raises(Unauthenticated) as err:
        reg.authenticate([("authorization", "Bearer nope")])
    assert err.value.message == "unknown API key"
    with pytest.raises(Unauthenticated) as err:
        reg.authenticate([])
    assert err.value.message == "missing 'authorization: Bearer <API key>' metadata"


def test_the_internal_key_is_accepted_only_when_it_matches(tmp_path):
    reg = TenantRegistry.load(registry_file(tmp_path), internal_key="warm-key")
    warm = reg.authenticate([("authorization", "Bearer warm-key")])
    assert (warm.id, warm.internal, warm.max_qos) == ("vlmesh-warmup", True, QosLevel.REALTIME)
    for _ in range(5):  # no limits, any class
        reg.admit(warm, QosLevel.REALTIME)
    assert reg.authenticate([("authorization", "Bearer k1")]).id == "acme"  # tenants still work
    for key in ("warm-ke", "warm-key2", "WARM-KEY", "k3 warm-key"):
        with pytest.raises(Unauthenticated, match="unknown API key"):
            reg.authenticate([("authorization", f"Bearer {key}")])
    for empty in ("", None):
        reg = TenantRegistry.load(registry_file(tmp_path), internal_key=empty)
        for header in ("Bearer ", "Bearer warm-key"):
            with pytest.raises(Unauthenticated):
                reg.authenticate([("authorization", header)])


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
    with pytest.raises(ValueError) as err:
        TenantRegistry.load(path)
    assert str(err.value).startswith(f"tenants file {path}: ")


ACME = {"id": "acme", "api_keys": ["sk-1"]}


@pytest.mark.parametrize(
    "tenants,message",
    [
        (
            [{**ACME, "requests_per_second": "ten"}],
            """tenant "acme": requests_per_second must be a number > 0, got 'ten'""",
        ),
        ([{**ACME, "requests_per_second": 0}], 'tenant "acme": requests_per_second must be a number > 0, got 0'),
        ([{**ACME, "requests_per_second": True}], 'tenant "acme": requests_per_second must be a number > 0, got True'),
        ([{**ACME, "burst": 0.5}], 'tenant "acme": burst must be a number >= 1, got 0.5'),
        (
            [{**ACME, "output_tokens_per_second": -5}],
            'tenant "acme": output_tokens_per_second must be a number > 0, got -5',
        ),
        ([{**ACME, "token_burst": "lots"}], """tenant "acme": token_burst must be a number > 0, got 'lots'"""),
        (
            [{**ACME, "max_qos": "gold"}],
            """tenant "acme": max_qos must be one of realtime, standard, best-effort, got 'gold'""",
        ),
        ([{"id": "acme"}], 'tenant "acme": api_keys must be a non-empty list of non-empty strings, got None'),
        (
            [{**ACME, "api_keys": "sk-1"}],
            """tenant "acme": api_keys must be a non-empty list of non-empty strings, got 'sk-1'""",
        ),
        (
            [{**ACME, "requests_per_s": 5}],
            "tenant \"acme\": unknown field 'requests_per_s' (the fields are id, api_keys, ",
        ),
        ([ACME, {"api_keys": ["sk-2"]}], "tenant #2: id must be a non-empty string, got None"),
        ([ACME, {"id": "b", "api_keys": ["sk-1"]}], 'tenant "b": an API key is also given to "acme"'),
        ([ACME, {**ACME, "api_keys": ["sk-2"]}], 'tenant "acme": the id appears twice'),
        ([{**ACME, "id": "vlmesh-warmup"}], 'tenant "vlmesh-warmup": the id is reserved for the launcher\'s warm-up'),
    ],
    ids=[
        "rps-text",
        "rps-zero",
        "rps-bool",
        "burst",
        "token-rate",
        "token-burst",
        "max-qos",
        "no-keys",
        "keys-text",
        "unknown-field",
        "no-id",
        "shared-key",
        "same-id",
        "reserved-id",
    ],
)
def test_a_bad_value_is_named_with_its_tenant_and_field(tmp_path, tenants, message):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"tenants": tenants}))
    with pytest.raises(ValueError) as err:
        TenantRegistry.load(path)
    assert str(err.value).startswith(f"tenants file {path}: {message}")
    assert "\n" not in str(err.value) and "float" not in str(err.value)


def test_the_gateway_config_check_loads_the_file(tmp_path):
    """`vlmesh up` runs every config's check before starting anything: a bad file stops it there."""
    from services.gateway.config import GatewayConfig, parse
    from services.launcher import MeshOptions

    path = tmp_path / "t.json"
    path.write_text(json.dumps({"tenants": [{**ACME, "requests_per_second": "ten"}]}))
    want = f"""tenants file {path}: tenant "acme": requests_per_second must be a number > 0, got 'ten'"""
    for check in (
        lambda: GatewayConfig(tenants=str(path)).check(),
        lambda: parse(["--tenants", str(path)]),
        lambda: MeshOptions.from_flags(model="/m", tenants=str(path)),
    ):
        with pytest.raises(ValueError) as err:
            check()
        assert str(err.value) == want
    with pytest.raises(ValueError) as err:
        GatewayConfig(tenants=str(tmp_path / "none.json")).check()
    assert str(err.value) == f"tenants file {tmp_path / 'none.json'}: cannot read it: No such file or directory"
    path.write_text(json.dumps({"tenants": [ACME]}))
    GatewayConfig(tenants=str(path)).check()


def png(width: int, height: int) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (width, height)).save(buf, "PNG")
    return buf.getvalue()


def test_max_streams_counts_requests_in_flight(tmp_path):
    reg = registry(tmp_path, max_streams=2, requests_per_second=100, burst=100)
    acme = reg.authenticate([("authorization", "Bearer k1")])
    reg.admit(acme, QosLevel.STANDARD)
    reg.admit(acme, QosLevel.STANDARD)
    with pytest.raises(ResourceExhausted, match="2 requests in flight, its max_streams") as err:
        reg.admit(acme, QosLevel.STANDARD)
    assert err.value.retry_after_s > 0
    level = acme.requests.level
    reg.done(acme)  # one answered: room for one more
    reg.admit(acme, QosLevel.STANDARD)
    reg.refund(acme)  # admitted, then refused further on: not in flight, its token back
    assert acme.in_flight == 1 and acme.requests.level >= level - 1e-6
    other = reg.authenticate([("authorization", "Bearer k3")])  # no limit of its own
    for _ in range(5):
        reg.admit(other, QosLevel.REALTIME)


def test_image_byte_and_pixel_limits(tmp_path):
    from services.common.errors import InvalidArgument
    from vlmesh.v1 import common_pb2 as pb

    reg = registry(tmp_path, max_image_bytes=2000, max_image_pixels=100 * 100, requests_per_second=100, burst=100)
    acme = reg.authenticate([("authorization", "Bearer k1")])
    reg.admit(acme, QosLevel.STANDARD, [pb.Image(data=png(100, 100))])
    with pytest.raises(InvalidArgument, match=r"images\[0\] is 101x100 = 10100 pixels; tenant 'acme' allows 10000"):
        reg.admit(acme, QosLevel.STANDARD, [pb.Image(data=png(101, 100))])
    with pytest.raises(InvalidArgument, match="the images are 3000 bytes; tenant 'acme' may send at most 2000"):
        reg.admit(acme, QosLevel.STANDARD, [pb.Image(data=bytes(3000))])
    reg.admit(acme, QosLevel.STANDARD, [pb.Image(data=b"not a picture")])  # the vision says what is wrong
    assert acme.in_flight == 2  # refused requests were never counted


@pytest.mark.parametrize("value", [0, 1.5, "8", True])
@pytest.mark.parametrize("limit", ["max_streams", "max_prompt_tokens", "degrade_max_tokens"])
def test_a_bad_limit_is_refused(tmp_path, value, limit):
    with pytest.raises(ValueError, match=f'tenant "acme": {limit} must be'):
        registry(tmp_path, **{limit: value})


def test_the_prompt_and_degradation_limits_are_read():
    import json

    from services.gateway.tenants import TenantRegistry

    entry = {"id": "t", "api_keys": ["k"], "max_prompt_tokens": 900, "degrade_max_tokens": 32}
    tenant = TenantRegistry._parse(json.dumps({"tenants": [entry]}))["k"]
    assert tenant.limits == {"max_prompt_tokens": 900, "degrade_max_tokens": 32}
