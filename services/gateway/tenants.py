"""Tenants: API keys, the highest QoS class each may use, and token-bucket rate limits.

Auth is on when the gateway gets `--tenants FILE` and off otherwise. The file is JSON:

    {"tenants": [{"id": "acme", "api_keys": ["sk-acme-1"], "max_qos": "realtime",
                  "requests_per_second": 10, "burst": 20,
                  "output_tokens_per_second": 2000, "token_burst": 8000}]}

Requests carry `authorization: Bearer KEY`. A missing or unknown key is UNAUTHENTICATED, a
class above the tenant's `max_qos` is PERMISSION_DENIED, and an empty bucket is
RESOURCE_EXHAUSTED with the time until it refills as google.rpc RetryInfo. Requests are
charged when admitted (a request the gateway refuses after the tenant check, as invalid or
over a queue limit or its deadline, gets its token back); generated tokens when the request
ends (a bucket may go negative, and then admits nothing until it has refilled).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.common.errors import MeshError, PermissionDenied, ResourceExhausted, Unauthenticated
from services.common.qos import QosLevel, parse_qos


class TokenBucket:
    """`rate` tokens per second up to `capacity`; thread-safe."""

    def __init__(self, rate: float, capacity: float) -> None:
        self.rate, self.capacity = rate, capacity
        self.level = capacity
        self.updated = time.monotonic()
        self._lock = threading.Lock()

    def _refill(self) -> None:
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def take(self, n: float = 1.0) -> float:
        """Take n tokens if there are; else return the seconds until there will be (nothing taken)."""
        with self._lock:
            self._refill()
            if self.level >= n:
                self.level -= n
                return 0.0
            return (n - self.level) / self.rate

    def refund(self, n: float) -> None:
        """Give back n tokens taken for work that was then refused."""
        with self._lock:
            self._refill()
            self.level = min(self.capacity, self.level + n)

    def charge(self, n: float) -> None:
        """Take n tokens even if that leaves the bucket in debt."""
        with self._lock:
            self._refill()
            self.level -= n


@dataclass
class Tenant:
    id: str
    max_qos: QosLevel
    requests: TokenBucket
    tokens: TokenBucket | None = field(default=None)


class TenantRegistry:
    def __init__(self, tenants: dict[str, Tenant]) -> None:
        self._by_key = tenants

    @classmethod
    def load(cls, path: str | Path) -> TenantRegistry:
        try:
            raw = json.loads(Path(path).read_text())
            by_key: dict[str, Tenant] = {}
            for entry in raw["tenants"]:
                rps = float(entry.get("requests_per_second", 10))
                tps = entry.get("output_tokens_per_second")
                tenant = Tenant(
                    id=str(entry["id"]),
                    max_qos=parse_qos(entry.get("max_qos", "standard")),
                    requests=TokenBucket(rps, float(entry.get("burst", max(1.0, rps)))),
                    tokens=TokenBucket(float(tps), float(entry.get("token_burst", tps))) if tps else None,
                )
                if rps <= 0 or not entry.get("api_keys"):
                    raise ValueError(f"tenant {tenant.id!r}: requests_per_second must be > 0 and api_keys non-empty")
                for key in entry["api_keys"]:
                    if key in by_key:
                        raise ValueError(f"API key of tenant {tenant.id!r} is also given to {by_key[key].id!r}")
                    by_key[key] = tenant
        except (OSError, KeyError, TypeError, ValueError, json.JSONDecodeError, MeshError) as err:
            raise ValueError(f"--tenants {path}: {getattr(err, 'message', err)}") from err
        return cls(by_key)

    def authenticate(self, metadata) -> Tenant:
        header = next((v for k, v in metadata or () if k == "authorization"), None)
        if header is None:
            raise Unauthenticated("missing 'authorization: Bearer <API key>' metadata")
        scheme, _, key = (header.decode() if isinstance(header, bytes) else header).partition(" ")
        tenant = self._by_key.get(key.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise Unauthenticated("unknown API key")
        return tenant

    @staticmethod
    def admit(tenant: Tenant, qos: QosLevel) -> None:
        if qos < tenant.max_qos:  # lower value = higher class
            raise PermissionDenied(
                f"tenant {tenant.id!r} may use qos-level {tenant.max_qos.wire} or lower, not {qos.wire}"
            )
        if tenant.tokens is not None:
            wait = tenant.tokens.take(0.0) if tenant.tokens.level >= 0 else -tenant.tokens.level / tenant.tokens.rate
            if wait > 0:
                raise ResourceExhausted(f"tenant {tenant.id!r} is over its output-token rate", retry_after_s=wait)
        wait = tenant.requests.take(1.0)
        if wait > 0:
            raise ResourceExhausted(f"tenant {tenant.id!r} is over its request rate", retry_after_s=wait)
