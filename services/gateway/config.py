"""Typed configuration of the gateway, admission's included (its logic: services/gateway/admission.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.config import DEFAULT_HOST, LLM_MAX_BATCH, MESH_METRICS_PORTS, MESH_PORTS, ServerConfig
from services.common.flags import flag, nested, parse_config
from services.common.qos import QosLevel, parse_qos
from services.gateway.tenants import TenantRegistry

DEFAULT_PORT = MESH_PORTS["gateway"]
DEFAULT_METRICS_PORT = MESH_METRICS_PORTS["gateway"]
DEFAULT_TARGET = f"{DEFAULT_HOST}:{DEFAULT_PORT}"  # where clients find the gateway
DEFAULT_VISION_TARGET = f"{DEFAULT_HOST}:{MESH_PORTS['vision']}"
DEFAULT_LLM_TARGET = f"{DEFAULT_HOST}:{MESH_PORTS['llm']}"

STAGES = ("preprocess", "vision", "prefill", "decode")
DEFAULT_STAGE_BUDGETS_MS = {"preprocess": 120.0, "vision": 300.0, "prefill": 180.0, "decode": 200.0}
BUDGET_OUTPUT_TOKENS = 16  # the decode budget is for this many output tokens (the write-ups' workloads)
IMAGE_KEY_CACHE = 8192  # images whose vision content key the gateway remembers (services/gateway/image_keys.py)
DEFAULT_CLASS_SCALE = {QosLevel.REALTIME: 5.0, QosLevel.STANDARD: 10.0, QosLevel.BEST_EFFORT: 40.0}
# Default in-flight limits, in multiples of the mesh's parallelism (the llm's batch).
IN_FLIGHT_PER_BATCH = {QosLevel.REALTIME: 8, QosLevel.STANDARD: 6, QosLevel.BEST_EFFORT: 3}


def parse_pairs(text: str, flag: str, keys) -> dict[str, float]:
    """'a=1,b=2' -> {'a': 1.0, 'b': 2.0}; ValueError naming the flag on a bad or unknown key."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not sep or key not in keys or not number > 0:
            raise ValueError(f"{flag} {text!r}: expected {','.join(f'{k}=N' for k in keys)} with N > 0")
        out[key] = number
    return out


def parse_class_pairs(text: str, flag: str) -> dict[QosLevel, float]:
    return {parse_qos(k): v for k, v in parse_pairs(text, flag, [q.wire for q in QosLevel]).items()}


def pairs_text(pairs: dict) -> str:
    """{'a': 1.0, QosLevel.REALTIME: 2} -> 'a=1,realtime=2' (exact: what parse_pairs reads back)."""

    def number(v: float) -> str:
        short = f"{v:g}"
        return short if float(short) == v else repr(float(v))

    return ",".join(f"{getattr(k, 'wire', k)}={number(v)}" for k, v in pairs.items())


def default_limits(parallelism: int) -> dict[QosLevel, int]:
    return {q: n * parallelism for q, n in IN_FLIGHT_PER_BATCH.items()}


def parse_limits(text: str) -> dict[QosLevel, int]:
    """--max-in-flight: the classes it names (the others get IN_FLIGHT_PER_BATCH x parallelism)."""
    limits = parse_class_pairs(text, "--max-in-flight")
    for q, n in limits.items():
        if n != int(n):
            raise ValueError(f"--max-in-flight {text!r}: {q.wire} needs a whole number")
    return {q: int(n) for q, n in limits.items()}


def parse_stage_budgets(text: str) -> dict[str, float]:
    return {**DEFAULT_STAGE_BUDGETS_MS, **parse_pairs(text, "--stage-budgets-ms", STAGES)}


def parse_class_scale(text: str) -> dict[QosLevel, float]:
    return {**DEFAULT_CLASS_SCALE, **parse_class_pairs(text, "--class-budget-scale")}


@dataclass(frozen=True, kw_only=True)
class AdmissionConfig:
    FLAGS_TITLE = "admission (gateway; see services/gateway/admission.py)"

    # Given: the classes --max-in-flight names; __post_init__ adds the others' defaults.
    max_in_flight: dict[QosLevel, int] = flag(
        "--max-in-flight",
        default_factory=dict,
        parse=parse_limits,
        text=pairs_text,
        help="per class, e.g. realtime=64,standard=48,best-effort=24: admit while the mesh's total in flight "
        "is below this, so lower classes are refused first (default: 8, 6 and 3 times the llm's batch)",
    )
    stage_budgets_ms: dict[str, float] = flag(
        "--stage-budgets-ms",
        default_factory=lambda: dict(DEFAULT_STAGE_BUDGETS_MS),
        parse=parse_stage_budgets,
        text=pairs_text,
        help="per-stage latency budgets, decode for 16 output tokens (default: the write-ups', %(default)s)",
    )
    class_scale: dict[QosLevel, float] = flag(
        "--class-budget-scale",
        default_factory=lambda: dict(DEFAULT_CLASS_SCALE),
        parse=parse_class_scale,
        text=pairs_text,
        help="per class: its budget is the stage budgets' sum times this (default %(default)s)",
    )
    parallelism: int = flag(
        "--admission-parallelism",
        default=LLM_MAX_BATCH,
        help="requests the mesh serves at once, for the admission estimate: the llm's --max-llm-batch "
        "(default %(default)s; vlmesh up passes it on)",
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_in_flight", {**default_limits(self.parallelism), **self.max_in_flight})

    def check(self) -> None:
        limits = [self.max_in_flight[q] for q in QosLevel]
        if limits != sorted(limits, reverse=True):
            raise ValueError(f"--max-in-flight: a higher class needs a limit at least as high, got {limits}")
        if self.parallelism < 1:
            raise ValueError(f"--admission-parallelism {self.parallelism} must be >= 1")

    def budget_s(self, qos: QosLevel) -> float:
        return sum(self.stage_budgets_ms.values()) * self.class_scale[qos] / 1000


@dataclass(frozen=True, kw_only=True)
class HttpConfig:
    """The OpenAI-compatible HTTP API beside gRPC (services/gateway/http/)."""

    FLAGS_TITLE = "gateway: OpenAI-compatible HTTP API"

    port: int = flag(
        "--http-port",
        default=-1,
        help="serve /v1/chat/completions, /v1/models and /health over HTTP on this port, beside gRPC (same "
        "admission, tenants, QoS, traces; metrics on --metrics-port); 0 picks a free one, -1 turns it off "
        "(default %(default)s)",
    )
    image_urls: bool = flag(
        "--http-image-urls",
        default=False,
        help="fetch http(s) image_url parts; off, only data: URLs are taken (default: off, so that a caller "
        "cannot make the gateway fetch from its network)",
    )
    image_url_max_mib: float = flag(
        "--http-image-url-max-mib",
        default=20.0,
        help="largest image fetched from a URL, and largest data: URL (default %(default)s MiB)",
    )
    image_url_timeout_s: float = flag(
        "--http-image-url-timeout-s", default=10.0, help="time to fetch one image URL (default %(default)s s)"
    )

    def check(self) -> None:
        if not -1 <= self.port <= 65535:
            raise ValueError(f"--http-port {self.port} must be a port, 0 (a free one) or -1 (off)")
        if self.image_url_max_mib <= 0:
            raise ValueError(f"--http-image-url-max-mib {self.image_url_max_mib} must be > 0")
        if self.image_url_timeout_s <= 0:
            raise ValueError(f"--http-image-url-timeout-s {self.image_url_timeout_s} must be > 0")

    @property
    def max_image_bytes(self) -> int:
        return int(self.image_url_max_mib * 1024 * 1024)


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    FLAGS_TITLE = "gateway"
    PROG = "vlmesh serve gateway"
    DESCRIPTION = (
        "The public API (vlmesh.v1.Gateway): validates requests and the qos-level, calls "
        "vision.Encode, then streams llm.Generate back to the client."
    )

    server: ServerConfig = nested(ServerConfig, port=DEFAULT_PORT, metrics_port=DEFAULT_METRICS_PORT)
    vision_target: str = flag(
        "--vision-target",
        default=DEFAULT_VISION_TARGET,
        help="vision service HOST:PORT; a comma list for several workers, the i-th beside the i-th "
        "--llm-target (default %(default)s)",
    )
    llm_target: str = flag(
        "--llm-target", default=DEFAULT_LLM_TARGET, help="llm service HOST:PORT, or a comma list (default %(default)s)"
    )
    breaker_failures: int = flag(
        "--breaker-failures",
        default=5,
        help="calls in a row that fail for a worker's sake (UNAVAILABLE, INTERNAL) before the gateway "
        "stops sending it requests (default %(default)s)",
    )
    breaker_cooldown_s: float = flag(
        "--breaker-cooldown-s",
        default=5.0,
        help="seconds a cut-off worker gets no requests before one probes it (doubled after each failed "
        "probe) (default %(default)s)",
    )
    degrade_target: str | None = flag(
        "--degrade-target",
        default=None,
        metavar="HOST:PORT",
        help="the gateway of a cheaper variant of this model: best-effort requests that admission would "
        "refuse for the queue are relayed there instead, marked x-vlmesh-degraded (vlmesh up --variants "
        "sets it; default: none)",
    )
    degrade_variant: str | None = flag(
        "--degrade-variant",
        default=None,
        metavar="NAME",
        help="the cheaper variant's name, sent as x-model-variant on each relayed request, so that a "
        "router in front of several variants (Istio, Envoy) takes it there (default: none, for a "
        "--degrade-target that is that variant's own gateway)",
    )
    max_images: int = flag(
        "--max-images",
        default=4,
        help="pictures one request may send, each one placeholder in the prompt (default %(default)s)",
    )
    skip_cached_encode: bool = flag(
        "--skip-cached-encode",
        default=True,
        help="send an image the worker's llm has read before as its content key alone, without calling the "
        "vision, where the llm reports reads_cached_images: it answers from its prefix cache, or asks for the "
        "features (one llm round trip more); --no-skip-cached-encode encodes every image (default: on)",
    )
    image_key_cache: int = flag(
        "--image-key-cache",
        default=IMAGE_KEY_CACHE,
        metavar="N",
        help="images whose content key --skip-cached-encode remembers, least recently used out; about 250 "
        "bytes each (default %(default)s)",
    )
    tenants: str | None = flag(
        "--tenants",
        default=None,
        metavar="FILE",
        help="JSON file of tenants (API keys, max qos-level, rate limits); auth is off without it",
    )
    access_log: bool = flag(
        "--access-log",
        default=True,
        help="one log line per Generate/GenerateUnary request at info (request.id, tenant.id, qos.level, status, "
        "output_tokens, ms, method), however it ends; --no-access-log turns it off (default: on)",
    )
    admission: AdmissionConfig = nested(AdmissionConfig)
    http: HttpConfig = nested(HttpConfig)

    def check(self) -> None:
        self.server.check()
        self.admission.check()
        self.http.check()
        for flag_name, targets in (("--vision-target", self.vision_target), ("--llm-target", self.llm_target)):
            for target in targets.split(","):
                if ":" not in target:
                    raise ValueError(f"{flag_name} {target!r} must be HOST:PORT (or unix:PATH)")
        if len(self.vision_target.split(",")) != len(self.llm_target.split(",")):
            raise ValueError("--vision-target and --llm-target must name as many addresses: one of each per worker")
        if self.degrade_target is not None and ":" not in self.degrade_target:
            raise ValueError(f"--degrade-target {self.degrade_target!r} must be HOST:PORT (or unix:PATH)")
        if self.degrade_variant is not None and self.degrade_target is None:
            raise ValueError("--degrade-variant needs --degrade-target")
        if self.image_key_cache < 1:
            raise ValueError(f"--image-key-cache {self.image_key_cache} must be >= 1 (--no-skip-cached-encode: none)")
        if self.breaker_failures < 1 or self.breaker_cooldown_s <= 0:
            raise ValueError("--breaker-failures must be >= 1 and --breaker-cooldown-s > 0")
        if self.tenants:
            TenantRegistry.load(self.tenants)  # a bad file fails here, before `vlmesh up` starts anything


def parse(argv: list[str] | None = None) -> GatewayConfig:
    return parse_config(GatewayConfig, argv)
