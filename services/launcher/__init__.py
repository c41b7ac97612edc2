"""`vlmesh up`: ports, the supervisor of the three processes, and the command line."""

from services.launcher.cli import build_parser, options_from_args, up
from services.launcher.options import MeshOptions
from services.launcher.ports import MeshError, PortBusy, check_ports, free_port
from services.launcher.supervisor import Child, Mesh, health_status
from services.launcher.warmup import warmup_images

__all__ = [
    "Child",
    "Mesh",
    "MeshError",
    "MeshOptions",
    "PortBusy",
    "build_parser",
    "check_ports",
    "free_port",
    "health_status",
    "options_from_args",
    "up",
    "warmup_images",
]
