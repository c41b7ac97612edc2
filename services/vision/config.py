"""Typed configuration of the vision service."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import MESH_METRICS_PORTS, MESH_PORTS, READY_SIGNALS, ModelConfig, ServerConfig
from services.common.flags import flag, nested, parse_config

DEFAULT_PORT = MESH_PORTS["vision"]
DEFAULT_METRICS_PORT = MESH_METRICS_PORTS["vision"]
DEFAULT_MAX_BATCH = 4
DEFAULT_FEATURE_CACHE_MIB = 512


@dataclass(frozen=True, kw_only=True)
class VisionConfig:
    FLAGS_TITLE = "vision"
    PROG = "vlmesh serve vision"
    DESCRIPTION = (
        "The vision encoder: decodes and preprocesses images, runs the ViT and projector in "
        "batches, and leases the features to the llm through a shared-memory arena."
    )

    server: ServerConfig = nested(ServerConfig, port=DEFAULT_PORT, metrics_port=DEFAULT_METRICS_PORT)
    model: ModelConfig = nested(ModelConfig)
    engine: str = flag(
        "--vision-engine", default="torch", choices=("torch",), help="encoder implementation (default %(default)s)"
    )
    max_batch: int = flag(
        "--max-vision-batch", default=DEFAULT_MAX_BATCH, help="images per ViT forward (default %(default)s)"
    )
    graphs: bool = flag(
        "--vision-graphs",
        default=True,
        help="on CUDA, capture the ViT and projector in a CUDA graph per batch size (1, 2, 4, ... "
        "--max-vision-batch) before ready; --no-vision-graphs runs them eagerly (default %(default)s)",
    )
    gpu_resize: bool = flag(
        "--gpu-resize",
        default=True,
        help="on CUDA, resize pictures on the GPU with Pillow's own fixed-point arithmetic (the same "
        "pixels, none of the preprocessing threads' milliseconds); --no-gpu-resize resizes them with "
        "Pillow on those threads (default %(default)s)",
    )
    arena_slots: int = flag(
        "--arena-slots",
        default=64,
        help="pictures of the model's largest size the feature arena holds at once; its pages are "
        "shared by size, so it holds more smaller ones (default %(default)s)",
    )
    lease_ttl_s: float = flag(
        "--lease-ttl-s",
        default=30.0,
        help="seconds before the arena pages of unreleased features are reclaimed (default %(default)s)",
    )
    feature_cache_mib: float = flag(
        "--feature-cache-mib",
        default=DEFAULT_FEATURE_CACHE_MIB,
        help="arena memory (MiB, beside --arena-slots) that keeps the features of images seen before, "
        "keyed by their bytes; a repeated image skips preprocessing and the ViT. 0 switches the cache "
        "off (default %(default)s)",
    )
    preprocess_workers: int = flag(
        "--preprocess-workers", default=2, help="threads decoding images (default %(default)s)"
    )
    ready_signal: str = flag(
        "--ready-signal",
        default="sync",
        choices=READY_SIGNALS,
        help="CUDA hand-off: the vision synchronises before replying, or passes an interprocess CUDA event "
        "the llm's stream waits on (default %(default)s)",
    )

    def check(self) -> None:
        self.server.check()
        self.model.check()
        problems = []
        if self.engine != "torch":
            problems.append(f"--vision-engine {self.engine!r}: only 'torch' is available")
        if self.max_batch < 1:
            problems.append(f"--max-vision-batch {self.max_batch} must be >= 1")
        if self.arena_slots < self.max_batch:
            problems.append(f"--arena-slots {self.arena_slots} must be >= --max-vision-batch {self.max_batch}")
        if self.feature_cache_mib < 0:
            problems.append(f"--feature-cache-mib {self.feature_cache_mib} must be >= 0")
        if self.lease_ttl_s <= 0:
            problems.append(f"--lease-ttl-s {self.lease_ttl_s} must be > 0")
        if self.ready_signal not in READY_SIGNALS:
            problems.append(f"--ready-signal {self.ready_signal!r}: use sync or event")
        if self.preprocess_workers < 1:
            problems.append(f"--preprocess-workers {self.preprocess_workers} must be >= 1")
        if problems:
            raise ValueError("; ".join(problems))


def parse(argv: list[str] | None = None) -> VisionConfig:
    return parse_config(VisionConfig, argv)
