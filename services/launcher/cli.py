"""`vlmesh up`: start vision, llm and gateway as separate processes, check them, warm up.

Order: vision and llm start together (both load weights), then the gateway. Each must
report SERVING on the standard health service before the next step. Warm-up requests
then go through the whole mesh, and one line `gateway ready on HOST:PORT` says the
mesh can serve. While it serves, a child that dies or stalls is restarted on the ports it
had (--restarts, --restart-window-s); past that limit, or with --restarts 0, the launcher
names the child, stops the others and exits non-zero. A child that dies before the mesh is
ready stops it the same way. SIGINT/SIGTERM, at any stage (loading weights, warming up,
serving), stop every child started so far and exit 0; the children also die with the
launcher if it is killed.
A fixed port that is taken fails before anything starts (exit 2); port 0 picks a free one.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from services.common.flags import add_flags, from_args
from services.common.validation import CliParser
from services.gateway import config as gateway_config
from services.gateway.config import GatewayConfig
from services.launcher import placement
from services.launcher.options import MeshOptions
from services.launcher.ports import MeshError, PortBusy, check_ports
from services.launcher.process import Stopped, signals_ignored, stop_on_signals
from services.launcher.routing import Variant, parse_variants
from services.launcher.supervisor import Mesh
from services.launcher.variants import VariantMesh, envoy_binary
from services.launcher.warmup import warmup_images
from services.llm import config as llm_config
from services.llm.config import LlmConfig
from services.vision import config as vision_config
from services.vision.config import VisionConfig

SERVICES = ("gateway", "vision", "llm")
# The service flags `vlmesh up` takes and passes on, by dest; each is declared once, in its
# service's config (services/*/config.py), with its default and help.
SERVER_FLAGS = (  # to all three
    *("host", "log_level", "log_format", "event_loop", "grace_s", "switch_interval_ms", "gc_freeze"),
    *("malloc_arenas", "malloc_hold_mib"),
    *("tls_cert", "tls_key", "tls_ca"),
)
MODEL_FLAGS = ("model", "device", "dtype", "threads", "memory_watermarks")  # to vision and llm
VISION_FLAGS = (
    "vision_engine",
    "max_vision_batch",
    "vision_graphs",
    "gpu_resize",
    "ready_signal",
    "arena_slots",
    "feature_cache_mib",
    "lease_ttl_s",
    "preprocess_workers",
)
LLM_FLAGS = (
    "llm_engine",
    "variant",
    "max_llm_batch",
    "default_max_tokens",
    "vllm_kv_cache_gib",
    "max_prefill_tokens",
    "kv_page_size",
    "kv_cache_gib",
    "gpu_memory_utilization",
    "prefix_cache",
    "quantize",
    "prefill",
    "skinny_gemv",
    "enforce_eager",
    "step_trace",
)
GATEWAY_FLAGS = (
    "tenants",
    "access_log",
    "max_images",
    "skip_cached_encode",
    "image_key_cache",
    "max_in_flight",
    "degrade_target",
    "degrade_variant",
    "stage_budgets_ms",
    "class_budget_scale",
    "http_port",
    "http_image_urls",
    "http_image_url_max_mib",
    "http_image_url_timeout_s",
)
PASSED_ON = {
    "gateway": SERVER_FLAGS + GATEWAY_FLAGS,
    "vision": SERVER_FLAGS + MODEL_FLAGS + VISION_FLAGS,
    "llm": SERVER_FLAGS + MODEL_FLAGS + LLM_FLAGS,
}
CONFIGS = {"gateway": GatewayConfig, "vision": VisionConfig, "llm": LlmConfig}
DEFAULT_PORTS = {
    "gateway": gateway_config.DEFAULT_PORT,
    "vision": vision_config.DEFAULT_PORT,
    "llm": llm_config.DEFAULT_PORT,
}
DEFAULT_METRICS_PORTS = (
    gateway_config.DEFAULT_METRICS_PORT,
    vision_config.DEFAULT_METRICS_PORT,
    llm_config.DEFAULT_METRICS_PORT,
)
# Set from the others or by the launcher itself: never taken from `vlmesh up`'s flags.
NOT_FLAGS = ("extra_env",)


def metrics_ports(text: str) -> tuple[int, int, int]:
    """--metrics-ports G,V,L -> three ints."""
    try:
        ports = tuple(int(x) for x in text.split(","))
    except ValueError:
        ports = ()
    if len(ports) != 3 or not all(-1 <= p <= 65535 for p in ports):
        raise argparse.ArgumentTypeError(f"{text!r}: expected three ports, gateway,vision,llm (0 = free, -1 = off)")
    return ports  # type: ignore[return-value]


def glue_negative_values(argv: Sequence[str]) -> list[str]:
    """`--metrics-ports -1,-1,-1` -> `--metrics-ports=-1,-1,-1`: argparse takes a separate value that
    starts with '-' (and is not one plain number) for an option and refuses it."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] == "--metrics-ports" and arg.startswith("-") and arg[1:2].isdigit():
            out[-1] = f"--metrics-ports={arg}"
        else:
            out.append(arg)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="vlmesh up", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, VisionConfig, only=MODEL_FLAGS, group=p.add_argument_group("model (vision and llm, each)"))
    mesh = p.add_argument_group("mesh (vlmesh up's own)")
    mesh.add_argument(
        "--gateway-port",
        type=int,
        default=DEFAULT_PORTS["gateway"],
        help="public port; 0 picks a free one (default %(default)s)",
    )
    for name in ("vision", "llm"):
        mesh.add_argument(
            f"--{name}-port", type=int, default=DEFAULT_PORTS[name], help="0 picks a free one (default %(default)s)"
        )
    mesh.add_argument(
        "--metrics-ports",
        type=metrics_ports,
        default=",".join(map(str, DEFAULT_METRICS_PORTS)),
        help="Prometheus /metrics ports of gateway,vision,llm; 0 = free, -1 = off (default %(default)s)",
    )
    add_flags(p, MeshOptions, group=mesh)
    add_flags(p, GatewayConfig, only=SERVER_FLAGS, group=p.add_argument_group("servers (all three)"))
    add_flags(p, VisionConfig, only=VISION_FLAGS)
    add_flags(p, LlmConfig, only=LLM_FLAGS)
    add_flags(p, GatewayConfig, only=GATEWAY_FLAGS)
    return p


def options_from_args(values: argparse.Namespace | Mapping[str, Any], **given: Any) -> MeshOptions:
    """`vlmesh up`'s parsed flags -> each service's config, checked (ValueError names the flag)."""
    if isinstance(values, argparse.Namespace):
        values = vars(values)

    metrics = values["metrics_ports"]
    metrics = metrics_ports(metrics) if isinstance(metrics, str) else metrics

    def config(name: str, **more: Any):
        ports = {"port": values[f"{name}_port"], "metrics_port": metrics[SERVICES.index(name)]}
        cfg = from_args(CONFIGS[name], {**values, **ports, **more})
        cfg.check()
        return cfg

    # The llm's first: the gateway's --admission-parallelism is the llm's --max-llm-batch, so a bad
    # batch must be reported under the flag the user typed.
    vision, llm = config("vision"), config("llm")
    gateway = config("gateway", admission_parallelism=llm.max_batch)  # admission sizes its queues by the batch
    options = from_args(MeshOptions, values, gateway=gateway, vision=vision, llm=llm, **given)
    options.check()
    return options


def options_from_flags(argv: Sequence[str] = (), **flags: Any) -> MeshOptions:
    """See MeshOptions.from_flags."""
    given = {k: flags.pop(k) for k in NOT_FLAGS if k in flags}
    model = ["--model", str(flags.pop("model"))] if "model" in flags else []
    args = vars(build_parser().parse_args(glue_negative_values([*model, *argv])))
    if unknown := set(flags) - set(args):
        raise TypeError(f"vlmesh up has no flags {sorted(unknown)}")
    return options_from_args({**args, **flags}, **given)


def up(argv: list[str] | None = None) -> int:
    with stop_on_signals():  # first: a SIGTERM at any later point stops what has started
        mesh: Mesh | VariantMesh | None = None
        ready = False
        try:
            options = _checked_options(sys.argv[1:] if argv is None else argv)
            mesh = mesh_for(options)
            if isinstance(mesh, VariantMesh):
                mesh.start(_say)
                http = f"; OpenAI-compatible HTTP on {mesh.http_url()}" if mesh.http_listen else ""
                what = f"variants {options.variants}" if options.variants else f"{len(mesh.meshes)} workers"
                print(f"gateway ready on {mesh.target()} (envoy, {what}){http}", flush=True)
            else:
                mesh.start(_say)
                http = f"; OpenAI-compatible HTTP on {mesh.http_url()}" if mesh.http_port else ""
                print(f"gateway ready on {mesh.target('gateway')}{http}", flush=True)
                if options.tls_throwaway_ca:
                    _say(f"TLS on every hop; clients verify the gateway with {mesh.opts.gateway.server.tls_ca}")
            ready = True
            mesh.wait(_say)
            _say("stopping")
            return 0
        except PortBusy as err:
            _say(f"error: {err}")
            return 2
        except MeshError as err:
            _say(f"error: {err}")
            return 1
        except Stopped as stop:
            _say(f"{stop}{'' if ready else ' before the mesh was ready'}; stopping")
            return 0
        finally:
            if mesh is not None:
                with signals_ignored():
                    mesh.stop()


def mesh_for(options: MeshOptions) -> Mesh | VariantMesh:
    """What `vlmesh up` runs for these options: workers behind Envoy (--variants, --placement
    replicate), or one worker (on one device, or --placement split over two)."""
    if options.variants or options.placement == "replicate":
        return behind_envoy(options)
    return Mesh(placement.split(options) if options.placement == "split" else options)


def behind_envoy(options: MeshOptions) -> VariantMesh:
    """The workers Envoy fronts: one per variant (--variants), or one per GPU of the one variant
    the options name (--placement replicate: `full`, or the --quantize kind)."""
    if options.variants:
        return VariantMesh(options, parse_variants(options.variants), options.envoy_admin_port)
    quantize = options.llm.native.quantize
    own = Variant("full" if quantize == "none" else quantize, 100)
    return VariantMesh(options, [own], options.envoy_admin_port, placement.replica_devices(options))


def _say(msg: str) -> None:
    print(f"vlmesh up: {msg}", file=sys.stderr, flush=True)


def quantize_kinds(options: MeshOptions) -> list[str]:
    """The --quantize kind of every llm the options start: each variant's, or the one --quantize."""
    variants = parse_variants(options.variants) if options.variants else []
    return [v.quantize for v in variants] or [options.llm.native.quantize]


def check_fp8_device(options: MeshOptions, p: argparse.ArgumentParser) -> None:
    """fp8 (the llm's or a variant's) on a host whose llm runs on the CPU is refused here, before any
    child starts; a GPU older than compute capability 8.9 is refused by the llm at load, naming it."""
    if "fp8" not in quantize_kinds(options):
        return
    from services.common.config import resolve_device

    try:
        device = resolve_device(options.llm.model.device)
    except ValueError as err:
        p.error(str(err))
    if device.type != "cuda":
        which = f"--variants {options.variants}" if options.variants else "--quantize fp8"
        p.error(f"{which}: fp8 needs a CUDA GPU of compute capability 8.9+ (Ada, Hopper); the llm runs on the CPU here")


def _checked_options(argv: Sequence[str]) -> MeshOptions:
    """Parse and check everything that can fail before a child starts (argparse exits 2 on a bad
    flag; PortBusy for a taken port)."""
    p = build_parser()
    args = p.parse_args(glue_negative_values(argv))
    from services.model.presets import resolve_model

    try:
        options = options_from_args(args)  # a bad flag value fails here, not in a child
    except ValueError as err:
        p.error(str(err))
    if options.tls_throwaway_ca and options.gateway.server.tls_cert:
        p.error("--tls-throwaway-ca makes its own certificate: not with --tls-cert")
    if options.vision_mps_percent and not options.cuda_mps:
        p.error(f"--vision-mps-percent {options.vision_mps_percent}: only with --cuda-mps (it limits an MPS client)")
    if options.cuda_mps and options.llm.model.device == "cpu":
        p.error("--cuda-mps: not with --device cpu (MPS shares a GPU)")
    if options.variants:
        if options.cuda_mps:
            p.error("--cuda-mps: not with --variants yet (one daemon per GPU, shared by every worker)")
        try:
            parse_variants(options.variants)
            envoy_binary()
        except (ValueError, MeshError) as err:
            p.error(f"--variants: {err}")
    check_fp8_device(options, p)
    if options.placement == "replicate":
        if options.cuda_mps:
            p.error("--cuda-mps: not with --placement replicate yet (one daemon per GPU)")
        try:
            envoy_binary()
        except MeshError as err:
            p.error(f"--placement replicate: {err}")
    try:
        warmup_images(args.warmup_images)  # fail before starting anything
    except MeshError as err:
        p.error(str(err))
    # A second mesh on the same ports fails here, before a preset's weights are made or loaded.
    # (Behind Envoy only its port is fixed: each worker takes free ports.)
    servers = {name: cfg.server for name, cfg in options.configs().items()}
    behind = options.variants or options.placement == "replicate"
    check_ports({"gateway": servers["gateway"]} if behind else servers, options.gateway.http.port)
    args.model = resolve_model(args.model)  # preset:NAME -> its directory, made once before the children start
    if not (Path(args.model) / "config.json").is_file():
        p.error(f"--model {args.model}: not a checkpoint directory (no config.json)")
    from services.common.errors import InvalidArgument
    from services.model.checkpoint import preflight
    from services.model.stored_fp8 import check_quantize

    try:
        spec = preflight(args.model)  # a bad checkpoint is one line here, not three children failing to start
        for kind in quantize_kinds(options):
            check_quantize(spec, kind)
    except InvalidArgument as err:
        p.error(f"--model: {err.message}")
    return options_from_args(args)
