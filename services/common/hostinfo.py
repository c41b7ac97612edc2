"""Identity of this host, so that producer and consumer can tell whether they share one."""

from __future__ import annotations

import functools
import socket
from pathlib import Path


@functools.cache
def host_id() -> str:
    """Hostname plus boot id: two processes with the same value share memory namespaces.

    Containers of one Kubernetes pod share the hostname; the boot id tells apart
    hosts that reuse a name.
    """
    boot = Path("/proc/sys/kernel/random/boot_id")
    boot_id = boot.read_text().strip()[:8] if boot.exists() else "noboot"
    return f"{socket.gethostname()}/{boot_id}"
