"""Logging set-up shared by the services and the CLI."""

from __future__ import annotations

import logging
import sys

LOG_LEVELS = ("debug", "info", "warning", "error")


def setup_logging(level: str, service: str) -> None:
    """Log to stderr with the service name in every line."""
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s",
        force=True,
    )
    # grpc and transformers are chatty at INFO about things a user can't act on.
    logging.getLogger("transformers").setLevel(logging.WARNING)
