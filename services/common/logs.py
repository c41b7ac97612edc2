"""Structured logs: one JSON object per line, carrying the trace and the request.

Each record has `ts`, `level`, `service`, `logger`, `msg`, and, when known, `trace_id` and
`span_id` (of the current OpenTelemetry span), `request.id` and `tenant.id` (set per request
by the servicers through `request_context`). A record may carry more fields as
`extra={"fields": {...}}` (the gateway's access log); they replace those of the same name.
`--log-format text` gives plain lines instead.
"""

from __future__ import annotations

import contextvars
import datetime as dt
import json
import logging
import sys

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("json", "text")

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
TENANT_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("tenant_id", default=None)


def request_context(request_id: str | None, tenant_id: str | None = None) -> None:
    """Tag this task's later log records with the request (contextvars are per asyncio task)."""
    REQUEST_ID.set(request_id or None)
    TENANT_ID.set(tenant_id)


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        from services.common import telemetry

        if telemetry.ENABLED:
            from opentelemetry import trace

            ctx = trace.get_current_span().get_span_context()
            if ctx.is_valid:
                out["trace_id"] = f"{ctx.trace_id:032x}"
                out["span_id"] = f"{ctx.span_id:016x}"
        if (rid := REQUEST_ID.get()) is not None:
            out["request.id"] = rid
        if (tid := TENANT_ID.get()) is not None:
            out["tenant.id"] = tid
        out.update(getattr(record, "fields", None) or {})  # extra={"fields": {...}}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(level: str, service: str, fmt: str = "json") -> None:
    """Log to stderr, as JSON lines (default) or plain text."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler], force=True)
    # transformers is chatty at INFO about things an operator can't act on.
    logging.getLogger("transformers").setLevel(logging.WARNING)
