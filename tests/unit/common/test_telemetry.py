"""Which gRPC services stay out of traces (tests/integration/test_tracing.py checks it on a mesh)."""

from __future__ import annotations

import pytest

from services.common import telemetry

VARIABLE = "OTEL_PYTHON_GRPC_EXCLUDED_SERVICES"


def test_health_and_reflection_are_untraced_by_default(monkeypatch):
    monkeypatch.delenv(VARIABLE, raising=False)
    assert telemetry.untraced_services() == ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection")


@pytest.mark.parametrize(
    ("listed", "untraced"),
    [("", ()), ("vlmesh.v1.Vision", ("vlmesh.v1.Vision",)), (" a.B , c.D,", ("a.B", "c.D"))],
)
def test_opentelemetrys_variable_replaces_the_default(monkeypatch, listed, untraced):
    """Set, the variable says which services go untraced; empty, every call is traced again."""
    monkeypatch.setenv(VARIABLE, listed)
    assert telemetry.untraced_services() == untraced
