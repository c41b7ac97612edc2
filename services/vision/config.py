"""Typed configuration of the vision service."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.common.config import (
    READY_SIGNALS,
    ModelConfig,
    ServerConfig,
    add_model_args,
    add_server_args,
    model_config,
    server_config,
)

DEFAULT_PORT = 50052


@dataclass(frozen=True)
class VisionConfig:
    server: ServerConfig
    model: ModelConfig
    engine: str
    max_batch: int
    arena_slots: int
    lease_ttl_s: float
    preprocess_workers: int
    ready_signal: str

    def check(self) -> None:
        self.server.check()
        problems = []
        if self.engine != "torch":
            problems.append(f"--vision-engine {self.engine!r}: only 'torch' is available")
        if self.max_batch < 1:
            problems.append(f"--max-vision-batch {self.max_batch} must be >= 1")
        if self.arena_slots < self.max_batch:
            problems.append(f"--arena-slots {self.arena_slots} must be >= --max-vision-batch {self.max_batch}")
        if self.lease_ttl_s <= 0:
            problems.append(f"--lease-ttl-s {self.lease_ttl_s} must be > 0")
        if self.ready_signal not in READY_SIGNALS:
            problems.append(f"--ready-signal {self.ready_signal!r}: use sync or event")
        if self.preprocess_workers < 1:
            problems.append(f"--preprocess-workers {self.preprocess_workers} must be >= 1")
        if problems:
            raise ValueError("; ".join(problems))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vlmesh serve vision",
        description="The vision encoder: decodes and preprocesses images, runs the ViT and projector in "
        "batches, and leases the features to the llm through a shared-memory arena.",
    )
    add_server_args(p, DEFAULT_PORT, 9465)
    add_model_args(p)
    g = p.add_argument_group("vision")
    g.add_argument("--vision-engine", default="torch", help="encoder implementation (default %(default)s)")
    g.add_argument("--max-vision-batch", type=int, default=4, help="images per ViT forward (default %(default)s)")
    g.add_argument("--arena-slots", type=int, default=64, help="feature slots in the arena (default %(default)s)")
    g.add_argument(
        "--lease-ttl-s",
        type=float,
        default=30.0,
        help="seconds before an unreleased feature slot is reclaimed (default %(default)s)",
    )
    g.add_argument("--preprocess-workers", type=int, default=2, help="threads decoding images (default %(default)s)")
    g.add_argument(
        "--ready-signal",
        default="sync",
        choices=READY_SIGNALS,
        help="CUDA hand-off: synchronise before replying, or pass an interprocess CUDA event (default %(default)s)",
    )
    return p


def parse(argv: list[str] | None = None) -> VisionConfig:
    args = build_parser().parse_args(argv)
    cfg = VisionConfig(
        server=server_config(args),
        model=model_config(args),
        engine=args.vision_engine,
        max_batch=args.max_vision_batch,
        arena_slots=args.arena_slots,
        lease_ttl_s=args.lease_ttl_s,
        preprocess_workers=args.preprocess_workers,
        ready_signal=args.ready_signal,
    )
    cfg.check()
    return cfg
