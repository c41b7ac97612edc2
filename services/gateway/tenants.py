"""Tenants: API keys, the highest QoS class each may use, and token-bucket rate limits.

Auth is on when the gateway gets `--tenants FILE` and off otherwise. The file is JSON:

    {"tenants": [{"id": "acme", "api_keys": ["sk-acme-1"], "max_qos": "realtime",
                  "requests_per_second": 10, "burst": 20,
                  "output_tokens_per_second": 2000, "token_burst": 8000,
                  "max_streams": 16, "max_image_bytes": 4000000, "max_image_pixels": 12000000,
                  "max_prompt_tokens": 2048, "degrade_max_tokens": 64}]}

Only `id` and `api_keys` are required; `max_qos` defaults to standard, `requests_per_second`
to 10, `burst` to max(1, requests_per_second), and without `output_tokens_per_second` there is
no token limit (`token_burst` defaults to it). The `max_` limits are off unless given:
requests of the tenant in flight at once (more: RESOURCE_EXHAUSTED), bytes of a request's
images together, pixels of each image, read from its header, and the prompt's tokens, image
tokens included, counted by the llm, which tokenizes (more: INVALID_ARGUMENT; the server's own
limits apply to everyone). `degrade_max_tokens` N lets the gateway serve the
tenant's best-effort requests with max_tokens cut to N under overload, instead of refusing them
(services/gateway/degrade.py). A bad file is refused at start with a message naming the tenant,
the field and the value.

Requests carry `authorization: Bearer KEY`. A missing or unknown key is UNAUTHENTICATED, a
class above the tenant's `max_qos` is PERMISSION_DENIED, and an empty bucket is
RESOURCE_EXHAUSTED with the time until it refills as google.rpc RetryInfo. Requests are
charged when admitted (a request the gateway refuses after the tenant check, as invalid or
over a queue limit or its deadline, gets its token back); generated tokens when the request
ends (a bucket may go negative, and then admits nothing until it has refilled).

One more key is accepted: the launcher's warm-up key (`VLMESH_WARMUP_KEY` in the gateway's
environment, random per run, never in the file). It authenticates the internal tenant
`vlmesh-warmup`: any qos-level, no rate limits, no tenant's usage.
"""

from __future__ import annotations

import hmac
import io
import json
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from services.common.errors import InvalidArgument, PermissionDenied, ResourceExhausted, Unauthenticated
from services.common.qos import QosLevel

WARMUP_TENANT_ID = "vlmesh-warmup"
LIMITS = ("max_streams", "max_image_bytes", "max_image_pixels", "max_prompt_tokens", "degrade_max_tokens")
FIELDS = (
    *("id", "api_keys", "max_qos", "requests_per_second", "burst", "output_tokens_per_second", "token_burst"),
    *LIMITS,
)
STREAM_RETRY_S = 0.5  # what a request over max_streams is told to wait: about one short request
BEARER_FORMAT = 'authorization metadata must be "Bearer <API key>"'


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
    internal: bool = False  # the launcher's warm-up: no limits, not charged
    limits: dict[str, int] = field(default_factory=dict)  # the LIMITS given
    in_flight: int = 0  # its requests admitted and not yet answered


def _number(entry: dict, name: str, default: float | None, least: float, above: bool) -> float | None:
    """entry[name] as a float (> least if `above`, else >= least); `default` when absent or null."""
    value = entry.get(name)
    if value is None:
        return default
    number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not number or not (value > least if above else value >= least):
        raise ValueError(f"{name} must be a number {'>' if above else '>='} {least:g}, got {value!r}")
    return float(value)


def _tenant(entry: Any, index: int) -> tuple[Tenant, list[str]]:
    """One entry of the file -> (tenant, its keys); ValueError naming the tenant, field and value."""
    if not isinstance(entry, dict):
        raise ValueError(f"tenant #{index + 1} must be a JSON object, got {entry!r}")
    name = entry.get("id")
    if not isinstance(name, str) or not name:
        raise ValueError(f"tenant #{index + 1}: id must be a non-empty string, got {name!r}")
    try:
        if unknown := [k for k in entry if k not in FIELDS]:
            raise ValueError(f"unknown field {unknown[0]!r} (the fields are {', '.join(FIELDS)})")
        keys = entry.get("api_keys")
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k.strip() for k in keys):
            raise ValueError(f"api_keys must be a non-empty list of non-empty strings, got {keys!r}")
        levels = {q.wire: q for q in QosLevel}
        max_qos = entry.get("max_qos", "standard")
        if not isinstance(max_qos, str) or max_qos.strip().lower() not in levels:
            raise ValueError(f"max_qos must be one of {', '.join(levels)}, got {max_qos!r}")
        rps = _number(entry, "requests_per_second", 10.0, 0, above=True)
        burst = _number(entry, "burst", max(1.0, rps), 1, above=False)
        tps = _number(entry, "output_tokens_per_second", None, 0, above=True)  # None: no token limit
        token_burst = _number(entry, "token_burst", tps, 0, above=True)
        limits = {}
        for limit in LIMITS:
            value = _number(entry, limit, None, 1, above=False)
            if value is not None:
                if value != int(value):
                    raise ValueError(f"{limit} must be a whole number, got {entry[limit]!r}")
                limits[limit] = int(value)
    except ValueError as err:
        raise ValueError(f"tenant {json.dumps(name)}: {err}") from None
    tenant = Tenant(
        id=name,
        max_qos=levels[max_qos.strip().lower()],
        requests=TokenBucket(rps, burst),
        tokens=TokenBucket(tps, token_burst) if tps is not None else None,
        limits=limits,
    )
    return tenant, keys


class TenantRegistry:
    def __init__(self, tenants: dict[str, Tenant], internal_key: str | None = None) -> None:
        self._by_key = tenants
        # An empty key authenticates nothing; compared in constant time.
        self._internal_key = internal_key.encode() if internal_key else None
        self._internal = Tenant(WARMUP_TENANT_ID, QosLevel.REALTIME, TokenBucket(1.0, 1.0), internal=True)

    @classmethod
    def load(cls, path: str | Path, internal_key: str | None = None) -> TenantRegistry:
        """Read and check the file; ValueError `tenants file PATH: ...` naming what is wrong."""
        try:
            return cls(cls._parse(Path(path).read_text()), internal_key)
        except OSError as err:
            raise ValueError(f"tenants file {path}: cannot read it: {err.strerror or err}") from None
        except ValueError as err:
            raise ValueError(f"tenants file {path}: {err}") from None

    @staticmethod
    def _parse(text: str) -> dict[str, Tenant]:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"not valid JSON: {err.msg} at line {err.lineno} column {err.colno}") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("tenants"), list) or set(raw) != {"tenants"}:
            raise ValueError('expected {"tenants": [...]}, one object per tenant')
        by_key: dict[str, Tenant] = {}
        ids: set[str] = set()
        for index, entry in enumerate(raw["tenants"]):
            tenant, keys = _tenant(entry, index)
            if tenant.id in ids or tenant.id == WARMUP_TENANT_ID:
                why = "is reserved for the launcher's warm-up" if tenant.id == WARMUP_TENANT_ID else "appears twice"
                raise ValueError(f"tenant {json.dumps(tenant.id)}: the id {why}")
            ids.add(tenant.id)
            for key in keys:
                if (owner := by_key.get(key)) is not None:
                    raise ValueError(
                        f"tenant {json.dumps(tenant.id)}: an API key is also given to {json.dumps(owner.id)}"
                    )
                by_key[key] = tenant
        return by_key

    def authenticate(self, metadata) -> Tenant:
        header = next((v for k, v in metadata or () if k == "authorization"), None)
        if header is None:
            raise Unauthenticated("missing 'authorization: Bearer <API key>' metadata")
        scheme, _, key = (header.decode() if isinstance(header, bytes) else header).strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise Unauthenticated(BEARER_FORMAT)
        if self._internal_key is not None and hmac.compare_digest(key.encode(), self._internal_key):
            return self._internal
        tenant = self._by_key.get(key)
        if tenant is None:
            raise Unauthenticated("unknown API key")
        return tenant

    @staticmethod
    def admit(tenant: Tenant, qos: QosLevel, images: Sequence = ()) -> None:
        """Charge one request (and count it in flight), or raise why not; `images`: its pb.Image list."""
        if tenant.internal:
            return
        _check_images(tenant, images)
        if qos < tenant.max_qos:  # lower value = higher class
            raise PermissionDenied(
                f"tenant {tenant.id!r} may use qos-level {tenant.max_qos.wire} or lower, not {qos.wire}"
            )
        if tenant.tokens is not None:
            wait = tenant.tokens.take(0.0) if tenant.tokens.level >= 0 else -tenant.tokens.level / tenant.tokens.rate
            if wait > 0:
                raise ResourceExhausted(f"tenant {tenant.id!r} is over its output-token rate", retry_after_s=wait)
        streams = tenant.limits.get("max_streams")
        if streams is not None and tenant.in_flight >= streams:
            raise ResourceExhausted(
                f"tenant {tenant.id!r} has {tenant.in_flight} requests in flight, its max_streams",
                retry_after_s=STREAM_RETRY_S,
            )
        wait = tenant.requests.take(1.0)
        if wait > 0:
            raise ResourceExhausted(f"tenant {tenant.id!r} is over its request rate", retry_after_s=wait)
        tenant.in_flight += 1

    @staticmethod
    def refund(tenant: Tenant) -> None:
        """An admitted request was refused after all: its request token back, no longer in flight."""
        tenant.requests.refund(1.0)
        tenant.in_flight -= 1

    @staticmethod
    def done(tenant: Tenant) -> None:
        """An admitted request has ended, however."""
        tenant.in_flight -= 1


def _check_images(tenant: Tenant, images: Sequence) -> None:
    """INVALID_ARGUMENT when the request's images are over the tenant's byte or pixel limits."""
    limit = tenant.limits.get("max_image_bytes")
    total = sum(len(img.data) for img in images)
    if limit is not None and total > limit:
        raise InvalidArgument(f"the images are {total} bytes; tenant {tenant.id!r} may send at most {limit}")
    limit = tenant.limits.get("max_image_pixels")
    for i, img in enumerate(images if limit is not None else ()):
        try:
            with Image.open(io.BytesIO(img.data)) as opened:  # the header only, not the pixels
                width, height = opened.size
        except Exception:  # unreadable: the vision names what is wrong with it
            continue
        if width * height > limit:
            pixels = width * height
            raise InvalidArgument(
                f"images[{i}] is {width}x{height} = {pixels} pixels; tenant {tenant.id!r} allows {limit}"
            )
