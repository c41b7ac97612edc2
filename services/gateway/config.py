"""Typed configuration of the gateway."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.common.config import ServerConfig, add_server_args, server_config
from services.gateway.admission import AdmissionConfig, add_admission_args, admission_config

DEFAULT_PORT = 50051


@dataclass(frozen=True)
class GatewayConfig:
    server: ServerConfig
    vision_target: str
    llm_target: str
    max_images: int
    tenants: str | None
    admission: AdmissionConfig

    def check(self) -> None:
        self.server.check()
        self.admission.check()
        for flag, target in (("--vision-target", self.vision_target), ("--llm-target", self.llm_target)):
            if ":" not in target:
                raise ValueError(f"{flag} {target!r} must be HOST:PORT (or unix:PATH)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vlmesh serve gateway",
        description="The public API (vlmesh.v1.Gateway): validates requests and the qos-level, calls "
        "vision.Encode, then streams llm.Generate back to the client.",
    )
    add_server_args(p, DEFAULT_PORT, 9464)
    g = p.add_argument_group("gateway")
    g.add_argument("--vision-target", default="127.0.0.1:50052", help="vision service HOST:PORT (default %(default)s)")
    g.add_argument("--llm-target", default="127.0.0.1:50053", help="llm service HOST:PORT (default %(default)s)")
    g.add_argument("--max-images", type=int, default=1, help="images per request (default %(default)s)")
    g.add_argument(
        "--tenants",
        default=None,
        metavar="FILE",
        help="JSON file of tenants (API keys, max qos-level, rate limits); auth is off without it",
    )
    add_admission_args(p)
    p.add_argument(
        "--admission-parallelism",
        type=int,
        default=8,
        help="requests the mesh serves at once, for the admission estimate: the llm's --max-llm-batch "
        "(default %(default)s; vlmesh up passes it on)",
    )
    return p


def parse(argv: list[str] | None = None) -> GatewayConfig:
    args = build_parser().parse_args(argv)
    cfg = GatewayConfig(
        server=server_config(args),
        vision_target=args.vision_target,
        llm_target=args.llm_target,
        max_images=args.max_images,
        tenants=args.tenants,
        admission=admission_config(args, args.admission_parallelism),
    )
    cfg.check()
    return cfg
