"""Tracing: OpenTelemetry SDK with an OTLP exporter, configured by the standard OTEL_* variables.

Tracing is on when an exporter is configured (`OTEL_EXPORTER_OTLP_ENDPOINT`,
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_TRACES_EXPORTER=otlp`) and off otherwise, or
with `OTEL_TRACES_EXPORTER=none`. The protocol is `OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL`
(`grpc`, the default, or `http/protobuf`); the sampler is `OTEL_TRACES_SAMPLER(_ARG)`; the
service name `OTEL_SERVICE_NAME` (default: the service). W3C trace context travels in gRPC
metadata through OpenTelemetry's own grpc.aio interceptors.

Health checks and server reflection are not traced: Envoy, the kubelet, the launcher and the
gateway's readiness probe poll health every second or faster, and a trace per poll would bury
the requests' traces. `OTEL_PYTHON_GRPC_EXCLUDED_SERVICES` (OpenTelemetry's list of gRPC
services not to trace, comma-separated) replaces that default; set empty, it traces every call.

When tracing is off (or the OpenTelemetry packages are absent, as on a bare GPU host),
`span()` returns a shared null context and no interceptor is installed: nothing is exported
and the hot path pays one boolean test.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence

log = logging.getLogger(__name__)

ENABLED = False
_tracer = None
_NULL = contextlib.nullcontext()


def _wanted() -> bool:
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return exporter == "otlp" or bool(
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def setup_tracing(service: str) -> bool:
    """Install the tracer provider for this process; return whether tracing is on."""
    global ENABLED, _tracer
    if not _wanted():
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("OTEL_* asks for tracing but opentelemetry-sdk is not installed: tracing is off")
        return False
    name = os.environ.get("OTEL_SERVICE_NAME") or f"vlmesh-{service}"

    class ServiceNameAttribute(SpanProcessor):
        """Some backends drop resource attributes: repeat service.name on every span."""

        def on_start(self, span, parent_context=None) -> None:
            span.set_attribute("service.name", name)

    protocol = (
        (
            os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "grpc"
        )
        .strip()
        .lower()
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol.startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: use grpc or http/protobuf")
    provider = TracerProvider(resource=Resource.create({"service.name": name}))  # sampler: OTEL_TRACES_SAMPLER
    provider.add_span_processor(ServiceNameAttribute())
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer("vlmesh")
    ENABLED = True
    log.info("tracing on: %s over OTLP/%s", name, protocol)
    return True


def shutdown_tracing() -> None:
    """Flush what is buffered (on a graceful stop)."""
    if ENABLED:
        from opentelemetry import trace

        provider = trace.get_tracer_provider()
        if hasattr(provider, "shutdown"):
            provider.shutdown()


def untraced_services() -> tuple[str, ...]:
    """The gRPC services whose calls make no span: health and reflection unless
    OTEL_PYTHON_GRPC_EXCLUDED_SERVICES names others (or, empty, none)."""
    listed = os.environ.get("OTEL_PYTHON_GRPC_EXCLUDED_SERVICES")
    if listed is None:
        from grpc_health.v1.health import SERVICE_NAME as HEALTH
        from grpc_reflection.v1alpha.reflection import SERVICE_NAME as REFLECTION

        return (HEALTH, REFLECTION)
    return tuple(name.strip() for name in listed.split(",") if name.strip())


def _traced_calls():
    """The interceptors' filter: True for a call to trace (None: every call)."""
    untraced = untraced_services()
    if not untraced:
        return None
    from opentelemetry.instrumentation.grpc import filters

    return filters.negate(filters.any_of(*(filters.service_name(name) for name in untraced)))


def server_interceptors() -> list:
    if not ENABLED:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(filter_=_traced_calls())]


def client_interceptors() -> list:
    if not ENABLED:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors(filter_=_traced_calls()))


def span(name: str, attributes: dict | None = None, links: Sequence | None = None):
    """A child span of the current one, as a context manager (a null context when off)."""
    if not ENABLED:
        return _NULL
    return _tracer.start_as_current_span(name, attributes=attributes, links=links)


def server_span(name: str, headers: Mapping[str, str], attributes: dict | None = None):
    """A SERVER span for a request that came over HTTP: it continues the caller's W3C trace context
    (`traceparent` in `headers`), or starts a trace (a null context when off)."""
    if not ENABLED:
        return _NULL
    from opentelemetry import propagate, trace

    return _tracer.start_as_current_span(
        name, context=propagate.extract(headers), kind=trace.SpanKind.SERVER, attributes=attributes
    )


def current_span():
    """The current span (None when tracing is off), to annotate it later from a child's scope."""
    if not ENABLED:
        return None
    from opentelemetry import trace

    return trace.get_current_span()


def annotate(attributes: dict, span=None) -> None:
    """Set attributes on `span`, or on the current span (the RPC's span in a servicer)."""
    if ENABLED:
        from opentelemetry import trace

        (span or trace.get_current_span()).set_attributes({k: v for k, v in attributes.items() if v is not None})


def current_context():
    """The current span's context, to link a batch span to the requests it served."""
    if not ENABLED:
        return None
    from opentelemetry import trace

    return trace.get_current_span().get_span_context()


def epoch_ns(perf_t: float) -> int:
    """A time.perf_counter() instant as Unix nanoseconds (span timestamps)."""
    return time.time_ns() - int((time.perf_counter() - perf_t) * 1e9)


def record_span(
    name: str,
    start_perf: float,
    end_perf: float,
    attributes: dict | None = None,
    events: Sequence[tuple[str, float]] = (),
    links: Sequence | None = None,
) -> None:
    """A finished child span from instants measured elsewhere (an engine thread, a batch)."""
    if not ENABLED:
        return
    s = _tracer.start_span(name, start_time=epoch_ns(start_perf), attributes=attributes, links=links)
    for event, at in events:
        s.add_event(event, timestamp=epoch_ns(at))
    s.end(end_time=epoch_ns(end_perf))


@contextlib.contextmanager
def linked(contexts: Sequence) -> Iterator[list]:
    """Links to the given span contexts (skipping None), for a span that serves several requests."""
    if not ENABLED:
        yield []
        return
    from opentelemetry.trace import Link

    yield [Link(c) for c in contexts if c is not None]
