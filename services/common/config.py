"""The mesh's well-known defaults, the flags every server shares (ServerConfig, ModelConfig),
and the checks that make bad values fail at start-up.

Each field is its own flag (services/common/flags.py); validation is each config's `check()`.
This module imports no torch: the launcher imports every service's config.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from services.common import eventloop, host_profile, tls
from services.common.flags import flag
from services.common.logs import LOG_FORMATS, LOG_LEVELS
from services.common.memory import Watermarks, parse_watermarks

# Python's GIL switch interval for processes that run an engine or batcher thread beside an
# asyncio loop (Python's default, 5 ms, delays every result the loop relays; docs/PERF.md).
SWITCH_INTERVAL_MS = 0.5
# How a CUDA hand-off's reader knows the slot is written (services/common/cuda_arena.py).
READY_SIGNALS = ("sync", "event")
QUANTIZATIONS = ("none", "int8", "int4", "fp8")  # --quantize (services/model/quantize.py)
VARIANT_METADATA_KEY = "x-model-variant"  # response: who served; request: who must serve
# A request's `model` may pin a variant as MODEL:VARIANT (e.g. demo:int8), for clients that set
# no headers (OpenAI's); a router reads it from the body (services/launcher/envoy.py).
MODEL_VARIANT_SEPARATOR = ":"
DEGRADED_METADATA_KEY = "x-vlmesh-degraded"  # response: how overload degraded it; request: relayed already
DTYPES = ("auto", "float32", "bfloat16", "float16")

# The mesh's well-known defaults, each written once. Each service's config names its own
# (DEFAULT_PORT, DEFAULT_METRICS_PORT, DEFAULT_MAX_BATCH); they sit here because the gateway
# also needs its peers' ports and the llm's batch, and services never import each other.
DEFAULT_HOST = "127.0.0.1"
MESH_PORTS = {"gateway": 50051, "vision": 50052, "llm": 50053}
MESH_METRICS_PORTS = {"gateway": 9464, "vision": 9465, "llm": 9466}
# The launcher's per-run warm-up key reaches the gateway in this variable only (never argv).
WARMUP_KEY_ENV = "VLMESH_WARMUP_KEY"
LLM_MAX_BATCH = 8  # sequences the llm decodes together; the gateway's admission parallelism


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    FLAGS_TITLE = "server"

    host: str = flag(
        "--host",
        default_factory=lambda: os.environ.get("VLMESH_HOST", DEFAULT_HOST),
        help="address to bind (default %(default)s)",
    )
    port: int = flag("--port", help="TCP port; 0 picks a free one (default %(default)s)")  # each service's own
    log_level: str = flag("--log-level", default="info", choices=LOG_LEVELS, help="log verbosity (default %(default)s)")
    log_format: str = flag(
        "--log-format",
        default="json",
        choices=LOG_FORMATS,
        help="json lines with trace and request ids, or plain text (default %(default)s)",
    )
    metrics_port: int = flag(
        "--metrics-port",
        help="Prometheus /metrics port; 0 picks a free one, -1 turns it off (default %(default)s)",
    )
    grace_s: float = flag(
        "--grace-s",
        default=30.0,
        help="on SIGTERM, seconds to let in-flight requests finish (default %(default)s)",
    )
    switch_interval_ms: float = flag(
        "--switch-interval-ms",
        default=SWITCH_INTERVAL_MS,
        help="Python's GIL switch interval (Python's own default is 5 ms). Each server runs an engine "
        "or batcher thread beside its asyncio loop; a shorter interval lets the loop relay a result "
        "sooner. On the H200 it cut W1 TTFT p50 from 101 to 73 ms (docs/PERF.md) (default %(default)s)",
    )
    gc_freeze: bool = flag(
        "--gc-freeze",
        default=True,
        help="once the service is built, move every object alive into the garbage collector's permanent "
        "generation (gc.freeze), so a full collection walks only what serving allocated: with torch and "
        "a model loaded one walked some 290,000 objects and held the process for 169 ms on a 2-core "
        "host (docs/PERF.md); --no-gc-freeze leaves the collector as Python has it (default %(default)s)",
    )
    malloc_arenas: int = flag(
        "--malloc-arenas",
        default=4,
        help="glibc malloc arenas the process may make (mallopt M_ARENA_MAX, before its threads start). With "
        "glibc's own limit, 8 per core, the llm's private memory drifted by up to 1.5%% in 2 minutes of a soak "
        "while its bytes in use stayed flat: free space stranded across arenas (docs/PERF.md). 0 keeps "
        "glibc's limit; MALLOC_ARENA_MAX in the environment wins (default %(default)s)",
    )
    malloc_hold_mib: int = flag(
        "--malloc-hold-mib",
        default=256,
        help="glibc's heap held: blocks up to 32 MiB come from the heap, not mappings of their own, and up to "
        "this many MiB of its free top stay (mallopt M_MMAP_THRESHOLD, M_TRIM_THRESHOLD). With glibc's moving "
        "thresholds private memory swung by a few percent a second as each batch's tensors were mapped, freed "
        "and the heap trimmed (docs/PERF.md). 0 keeps glibc's; its MALLOC_*_THRESHOLD_ variables in the "
        "environment win (default %(default)s)",
    )
    event_loop: str = flag(
        "--event-loop",
        default="auto",
        choices=eventloop.EVENT_LOOPS,
        help="asyncio event loop: uvloop when installed (auto), or asyncio's own; uvloop makes each RPC "
        "hop cheaper (docs/PERF.md) (default %(default)s)",
    )
    port_file: str | None = flag(
        "--port-file",
        default=None,
        metavar="PATH",
        help='once serving, write the bound ports to PATH as JSON ({"port": N, "metrics_port": M}). '
        "With --port 0 this is how a launcher learns a free port without racing another process for it",
    )
    profile_host: str | None = flag(
        "--profile-host",
        default=None,
        metavar="PATH",
        help="profile this server's Python while it serves (yappi, CPU time by function and thread) and "
        "write PATH (pstats) and PATH.threads when it stops; sum up with python -m bench.host_profile. "
        "Slows the Python it counts: for finding where host time goes, not for timing",
    )

    tls_cert: str = flag(
        "--tls-cert",
        default="",
        metavar="PEM",
        help="serve TLS with this certificate (chain) and --tls-key; the vision and llm with --tls-ca also "
        "require callers' certificates (mTLS). Empty: plaintext (default %(default)r)",
    )
    tls_key: str = flag("--tls-key", default="", metavar="PEM", help="the private key of --tls-cert")
    tls_ca: str = flag(
        "--tls-ca",
        default="",
        metavar="PEM",
        help="the mesh's CA: this service's own calls to the others verify them against it and present "
        "--tls-cert; the vision and llm accept only callers whose certificate it signed (default %(default)r)",
    )

    def check(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is not a TCP port (0 picks a free one)")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port {self.metrics_port}: a TCP port, 0 for a free one, -1 for none")
        if self.grace_s < 0:
            raise ValueError(f"--grace-s {self.grace_s} must be >= 0")
        if self.malloc_arenas < 0:
            raise ValueError(f"--malloc-arenas {self.malloc_arenas} must be >= 0 (0 keeps glibc's limit)")
        if not 0 <= self.malloc_hold_mib < 2048:
            raise ValueError(f"--malloc-hold-mib {self.malloc_hold_mib} must be in [0, 2048) (0 keeps glibc's)")
        if not 0 < self.switch_interval_ms <= 100:
            raise ValueError(f"--switch-interval-ms {self.switch_interval_ms} must be in (0, 100]")
        eventloop.resolve(self.event_loop)
        host_profile.check(self.profile_host)
        tls.check_files(self.tls_cert, self.tls_key, self.tls_ca)

    def server_credentials(self, require_client: bool):
        """grpc.ServerCredentials for this port (None: plaintext); see services/common/tls.py."""
        return tls.server_credentials(self.tls_cert, self.tls_key, self.tls_ca, require_client)

    def channel_credentials(self):
        """grpc.ChannelCredentials for this service's calls to the mesh's others (None: plaintext)."""
        return tls.channel_credentials(self.tls_cert, self.tls_key, self.tls_ca)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    FLAGS_TITLE = "model"

    path: str = flag(
        "--model",
        help="local directory of a Hugging Face LLaVA checkpoint, or preset:NAME (random weights)",
    )
    device: str = flag(
        "--device", default="auto", help="cpu, cuda, cuda:N or auto: cuda when available (default %(default)s)"
    )
    dtype: str = flag(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="weights and activations; auto = bfloat16 on CUDA, float32 on CPU (default %(default)s)",
    )
    threads: int = flag("--threads", default=0, help="torch CPU threads; 0 = torch's default (default %(default)s)")
    memory_watermarks: Watermarks = flag(
        "--memory-watermarks",
        default=Watermarks(),
        parse=parse_watermarks,
        text=Watermarks.text,
        help="shares of the GPU's memory (every process on it) at which to warn, free cached memory, and "
        "refuse best-effort requests with RESOURCE_EXHAUSTED; refuse=1 never refuses. No effect on the "
        "CPU (default %(default)s)",
    )

    def check(self) -> None:
        if self.threads < 0:
            raise ValueError(f"--threads {self.threads} must be >= 0")

    def apply_threads(self) -> None:
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)


def resolve_device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this host")
    return device
