"""JSON log lines carry the request and, under a span, the trace."""

from __future__ import annotations

import asyncio
import json
import logging

from services.common import telemetry
from services.common.logs import JsonFormatter, request_context


def record(msg: str) -> logging.LogRecord:
    return logging.LogRecord("svc", logging.WARNING, __file__, 1, msg, None, None)


def test_request_ids_in_json_lines():
    async def handler(rid: str) -> dict:
        request_context(rid, "tenant-a")
        await asyncio.sleep(0)
        return json.loads(JsonFormatter("vision").format(record(f"hello {rid}")))

    async def two() -> list[dict]:
        return await asyncio.gather(handler("r-1"), handler("r-2"))

    lines = asyncio.run(two())
    assert [(line["request.id"], line["msg"]) for line in lines] == [("r-1", "hello r-1"), ("r-2", "hello r-2")]
    assert lines[0]["tenant.id"] == "tenant-a" and lines[0]["service"] == "vision" and lines[0]["level"] == "warning"
    assert "trace_id" not in lines[0]  # tracing is off


def test_trace_and_span_ids_under_a_span(monkeypatch):
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("test")
    monkeypatch.setattr(telemetry, "ENABLED", True)
    with tracer.start_as_current_span("work") as span:
        line = json.loads(JsonFormatter("llm").format(record("inside")))
        ctx = span.get_span_context()
    assert line["trace_id"] == f"{ctx.trace_id:032x}" and line["span_id"] == f"{ctx.span_id:016x}"
