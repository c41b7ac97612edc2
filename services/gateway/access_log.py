"""The gateway's access log: one line per Generate/GenerateUnary request, whatever its outcome.

At `info`, logger `services.gateway.access_log`; in JSON (services/common/logs.py) with the fields
`request.id`, `tenant.id` (null when the request was refused before it was authenticated),
`qos.level` (null before it was read), `status` (the gRPC status name: OK when answered),
`output_tokens` (generated tokens the client got; 0 when none), `ms` (wall time at the gateway)
and `method`. Off with `--no-access-log`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from services.common.errors import MeshError

log = logging.getLogger(__name__)


@dataclass
class Entry:
    """What the servicer learns about a request as it goes (None: not known yet)."""

    method: str
    request_id: str | None = None
    tenant_id: str | None = None
    qos: str | None = None
    output_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)

    def relayed(self, msg) -> None:
        """Count a response's tokens; the final one's usage is the total."""
        if msg.finish_reason:
            self.output_tokens = msg.usage.output_tokens
        else:
            self.output_tokens += len(msg.token_ids)


def status_of(err: BaseException | None, context: grpc.aio.ServicerContext) -> str:
    """The status the client gets for a handler that ended with `err` (None: answered)."""
    if err is None:
        return "OK"
    if isinstance(err, MeshError):
        return err.code.name
    if isinstance(err, asyncio.CancelledError | GeneratorExit):
        remaining = context.time_remaining()
        return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
    if isinstance(err, grpc.aio.AbortError):
        code = context.code()
        return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    return "INTERNAL"  # services/common/rpc.py maps any other exception to INTERNAL


class AccessLog:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled

    @contextlib.contextmanager
    def request(self, method: str, context: grpc.aio.ServicerContext) -> Iterator[Entry]:
        """Yield the request's Entry to fill; write its line once the handler ends, however it ends."""
        entry = Entry(method)
        err: BaseException | None = None
        try:
            yield entry
        except BaseException as caught:  # re-raised: this only looks
            err = caught
            raise
        finally:
            if self.enabled:
                self.write(entry, status_of(err, context))

    @staticmethod
    def write(entry: Entry, status: str) -> None:
        ms = round((time.perf_counter() - entry.started) * 1000, 3)
        fields = {
            "request.id": entry.request_id,
            "tenant.id": entry.tenant_id,
            "qos.level": entry.qos,
            "status": status,
            "output_tokens": entry.output_tokens,
            "ms": ms,
            "method": entry.method,
        }
        log.info(
            "%s %s request=%s tenant=%s qos=%s output_tokens=%d ms=%.1f",
            entry.method,
            status,
            entry.request_id or "-",
            entry.tenant_id or "-",
            entry.qos or "-",
            entry.output_tokens,
            ms,
            extra={"fields": fields},
        )
