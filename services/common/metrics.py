"""Prometheus metrics of the three services (one definition, each process exports its own).

Names and units follow Prometheus conventions (base units, `_total` counters, `_seconds`
and `_bytes` suffixes) and are listed in docs/OBSERVABILITY.md. `start_metrics_server`
serves them on `/metrics` at the port given by `--metrics-port`.
"""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from services.common.qos import QosLevel

log = logging.getLogger(__name__)

# Latency buckets from 1 ms to 60 s; per-token buckets from 0.1 ms to 1 s.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 0.8, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

REQUESTS = Counter("vlmesh_requests_total", "RPCs answered, by final gRPC status code", ["service", "method", "code"])
REQUEST_DURATION = Histogram(
    "vlmesh_request_duration_seconds", "End-to-end latency at the gateway", ["qos_level"], buckets=LATENCY_BUCKETS
)
TTFT = Histogram(
    "vlmesh_time_to_first_token_seconds",
    "Request received to first token sent (gateway)",
    ["qos_level"],
    buckets=LATENCY_BUCKETS,
)
TPOT = Histogram(
    "vlmesh_time_per_output_token_seconds",
    "Mean time between output tokens of a request (gateway)",
    ["qos_level"],
    buckets=TOKEN_BUCKETS,
)
OUTPUT_TOKENS = Counter("vlmesh_output_tokens_total", "Tokens generated", ["qos_level"])
QUEUE_DEPTH = Gauge("vlmesh_queue_depth", "Requests waiting", ["service", "qos_level"])
QUEUE_WAIT = Histogram(
    "vlmesh_queue_wait_seconds", "Time from enqueue to start of work", ["service", "qos_level"], buckets=LATENCY_BUCKETS
)
PREEMPTIONS = Counter(
    "vlmesh_preemptions_total", "Running requests preempted for a higher class", ["service", "qos_level"]
)
ADMISSIONS = Counter("vlmesh_admissions_total", "Requests admitted at the gateway", ["qos_level"])
REJECTIONS = Counter(
    "vlmesh_rejections_total",
    "Requests refused before any work: auth, tenant limits, queue limits, budgets",
    ["service", "qos_level", "reason"],
)
DEGRADATIONS = Counter(
    "vlmesh_degradations_total",
    "Requests served degraded instead of refused under overload (kind: variant, max_tokens)",
    ["qos_level", "kind"],
)
IN_FLIGHT = Gauge("vlmesh_in_flight", "Admitted requests not yet answered (gateway)", ["qos_level"])
WORKER_CIRCUIT = Gauge(
    "vlmesh_worker_circuit", "The gateway's breaker of each worker: 0 closed, 1 half-open, 2 open", ["worker"]
)
GATEWAY_READY = Gauge(
    "vlmesh_gateway_ready",
    "1 while some worker of the gateway has its vision and llm answering health checks (services/gateway/readiness.py)",
)
GC_PAUSE = Histogram(
    "vlmesh_gc_pause_seconds",
    "Python garbage collections and how long each held the process (services/common/gcpause.py)",
    ["service", "generation"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)
STAGE_DURATION = Histogram(
    "vlmesh_stage_duration_seconds", "Time spent in one stage of a request", ["stage"], buckets=LATENCY_BUCKETS
)
BATCH_SIZE = Histogram(
    "vlmesh_batch_size",
    "Requests per batch (vision forward, llm decode step)",
    ["service"],
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64),
)
CACHE_LOOKUPS = Counter("vlmesh_feature_cache_lookups_total", "Feature cache lookups", ["result"])
VISION_SKIPS = Counter(
    "vlmesh_vision_skips_total",
    "Requests the gateway sent to the llm with their images' content keys alone (services/gateway/image_keys.py): "
    "served from the llm's prefix cache (skipped), or sent again with features (fallback)",
    ["result"],
)
HANDOFFS = Counter("vlmesh_handoffs_total", "Feature tensors handed over, by transport", ["transport"])
HANDOFF_BYTES = Counter("vlmesh_handoff_bytes_total", "Bytes of features handed over, by transport", ["transport"])
HANDOFF_FALLBACKS = Counter(
    "vlmesh_handoff_fallbacks_total", "Hand-offs that fell back from the consumer's preferred transport", ["to"]
)
ARENA_PAGES = Gauge("vlmesh_arena_pages", "Feature arena pages (a picture takes a run of them)", ["arena", "state"])
# An info metric (always 1): join it on the instance to label any series by model and variant.
MODEL_INFO = Gauge(
    "vlmesh_model_info", "The model and variant a server serves (value 1)", ["service", "model", "variant"]
)
KV_SLOTS = Gauge("vlmesh_kv_slots", "Batch places of the llm engine (running sequences)", ["state"])
KV_PAGES = Gauge("vlmesh_kv_pages", "Pages of the llm engine's paged KV pool", ["state"])
PREFIX_TOKENS = Counter(
    "vlmesh_prefix_cache_tokens_total",
    "Prompt positions at admission: hit (their KV came from the prefix cache) or miss (computed)",
    ["result"],
)
PREFIX_FIRST_TOKENS = Counter(
    "vlmesh_prefix_first_tokens_total",
    "Greedy prompts whose first token the prefix cache held with their whole prompt: no forward before their decode",
)
GPU_MEMORY_RATIO = Gauge(
    "vlmesh_gpu_memory_used_ratio", "Share of the GPU's memory in use, by every process on it", ["service"]
)
MEMORY_PRESSURE = Gauge(
    "vlmesh_memory_pressure",
    "GPU memory watermark reached: 0 ok, 1 warn (75%), 2 shrink caches (90%), 3 refuse best-effort (95%)",
    ["service"],
)
GPU_MEMORY = Gauge(
    "vlmesh_gpu_memory_bytes", "GPU memory held by this process's PyTorch allocator", ["service", "kind"]
)


def start_metrics_server(port: int, host: str) -> int:
    """Serve /metrics on `port` (0: a free port); return the port."""
    server, _thread = start_http_server(port, addr=host)
    bound = server.server_address[1]
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound


def watch_scheduler(sched) -> None:
    """The llm scheduler's batch places, KV pages and queue, read on each scrape (services/llm/scheduler.py)."""
    pages = sched.blocks
    KV_SLOTS.labels("used").set_function(lambda: len(sched.running))
    KV_SLOTS.labels("free").set_function(lambda: sched.free_places)
    KV_PAGES.labels("used").set_function(lambda: pages.capacity - pages.free)
    KV_PAGES.labels("free").set_function(lambda: pages.free)
    KV_PAGES.labels("cached").set_function(lambda: pages.cached)
    for q in QosLevel:
        QUEUE_DEPTH.labels("llm", q.wire).set_function(lambda q=q: sched.waiting_by_qos[q])


def watch_gpu_memory(service: str, device) -> None:
    """Report the allocator's memory on each scrape (no cost between scrapes)."""
    if getattr(device, "type", "cpu") != "cuda":
        return
    import torch

    GPU_MEMORY.labels(service, "allocated").set_function(lambda: torch.cuda.memory_allocated(device))
    GPU_MEMORY.labels(service, "reserved").set_function(lambda: torch.cuda.memory_reserved(device))
