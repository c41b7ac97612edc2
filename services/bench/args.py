"""`vlmesh bench`'s flags, each checked as argparse reads it (`type=`): a bad value exits 2 with
one line naming the flag and what it accepts, before anything starts."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
from pathlib import Path

from services.bench.workloads import WORKLOADS
from services.common import eventloop
from services.common.config import DTYPES, QUANTIZATIONS, READY_SIGNALS
from services.common.validation import API_KEY_ENV, CliParser, api_key, device_name, float_in, int_in, names_of, numbers
from services.llm import config as llm_config
from services.llm.config import VLLM_MISSING
from services.llm.scheduler import DEFAULT_MAX_PREFILL_TOKENS
from services.vision import config as vision_config

TARGETS = ("mesh", "mesh-http", "inprocess", "hf", "hf-static", "vllm")


def _vllm_installed(name: str) -> None:
    if name == "vllm" and importlib.util.find_spec("vllm") is None:
        raise argparse.ArgumentTypeError(f"vllm: {VLLM_MISSING}")


def build_parser(description: str) -> argparse.ArgumentParser:
    p = CliParser(prog="vlmesh bench", description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default="models/demo",
        help="checkpoint directory, or preset:llava-7b-shaped for random weights (default %(default)s)",
    )
    p.add_argument(
        "--target",
        type=names_of(TARGETS, _vllm_installed),
        default="mesh",
        help=f"comma list of {', '.join(TARGETS)}; mesh-http is the same mesh through its OpenAI-compatible "
        "HTTP door (mesh,mesh-http: one mesh, measured through each door in turn) (default %(default)s)",
    )
    p.add_argument(
        "--gateway", default=None, help="HOST:PORT of a running gateway instead of starting a mesh (default: start one)"
    )
    p.add_argument(
        "--gateway-http",
        default=None,
        metavar="URL",
        help="with --gateway: its HTTP door for mesh-http, e.g. http://127.0.0.1:8000/v1 (default: none)",
    )
    p.add_argument(
        "--api-key",
        type=api_key,
        default=os.environ.get(API_KEY_ENV) or None,
        metavar="KEY",
        help=f"sent to the mesh as `authorization: Bearer KEY` (a gateway with --tenants needs one; "
        f"default: ${API_KEY_ENV})",
    )
    p.add_argument(
        "--workload",
        type=names_of(list(WORKLOADS)),
        default="W1",
        help=f"comma list of {', '.join(WORKLOADS)} (default %(default)s)",
    )
    p.add_argument(
        "--rates",
        type=numbers(float, "a comma list of offered req/s, each > 0, e.g. 2,4,8"),
        default="2,4,8,16",
        help="offered req/s, comma list (default %(default)s)",
    )
    p.add_argument(
        "--duration", type=float_in(0.0, lo_open=True), default=20.0, help="seconds per rate (default %(default)s)"
    )
    p.add_argument(
        "--warmup",
        type=float_in(0.0),
        default=3.0,
        help="seconds left out of the latencies, less than --duration (default %(default)s)",
    )
    p.add_argument(
        "--qos-mix",
        type=numbers(
            float, "three shares >= 0, realtime,standard,best-effort, e.g. 0.2,0.6,0.2", positive=False, count=3
        ),
        default="0.2,0.6,0.2",
        help="realtime,standard,best-effort shares (default %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=int_in(0),
        default=0,
        help="seeds the arrivals, the QoS draws and the pictures: one seed, the same requests (default %(default)s)",
    )
    p.add_argument("--out", type=Path, default=None, help="output directory (default bench-results/DATE)")
    p.add_argument(
        "--compare-seeds",
        action="store_true",
        help="print the write-ups' headline P99 and throughput beside ours at their P99 (default off)",
    )
    p.add_argument(
        "--device",
        type=device_name,
        default="auto",
        help="cpu, cuda, cuda:N or auto: cuda when torch sees a GPU; for the mesh and the in-process "
        "targets (default %(default)s)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="weights and activations; auto = bfloat16 on CUDA, float32 on CPU (default %(default)s)",
    )
    p.add_argument(
        "--max-vision-batch",
        type=int_in(1),
        default=vision_config.DEFAULT_MAX_BATCH,
        help="images per ViT forward, mesh and in-process (default %(default)s)",
    )
    p.add_argument(
        "--max-llm-batch",
        type=int_in(1),
        default=llm_config.DEFAULT_MAX_BATCH,
        help="sequences decoded together, mesh and in-process (default %(default)s)",
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=int_in(1),
        default=DEFAULT_MAX_PREFILL_TOKENS,
        help="the native engine's prefill positions per step (mesh) (default %(default)s)",
    )
    p.add_argument(
        "--feature-cache-mib",
        type=float_in(0),
        default=vision_config.DEFAULT_FEATURE_CACHE_MIB,
        help="the vision's feature cache (mesh); 0 switches it off (default %(default)s)",
    )
    p.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the native engine's prefix KV reuse (mesh); --no-prefix-cache switches it off (default on)",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="start the mesh with TLS on every hop (vlmesh up --tls-throwaway-ca) and connect with TLS (mesh) "
        "(default off)",
    )
    p.add_argument(
        "--quantize",
        default="none",
        choices=QUANTIZATIONS,
        help="the native engine's decoder quantization (mesh), as vlmesh up --quantize: int8 weight-only (CPU "
        "or CUDA), int4 weight-only (CUDA, bf16), fp8 weights and prompt activations (CUDA, bf16, compute "
        "capability 8.9+) (default %(default)s)",
    )
    p.add_argument(
        "--ready-signal",
        default="sync",
        choices=READY_SIGNALS,
        help="CUDA hand-off readiness (mesh) (default %(default)s)",
    )
    p.add_argument(
        "--cuda-mps",
        action="store_true",
        help="start the mesh under an NVIDIA MPS daemon of its own (vlmesh up --cuda-mps): vision and llm "
        "share the GPU instead of time-slicing it (mesh) (default off)",
    )
    p.add_argument(
        "--event-loop",
        default="auto",
        choices=eventloop.EVENT_LOOPS,
        help="asyncio loop of this client, the in-process target and the mesh's servers (default %(default)s)",
    )
    p.add_argument(
        "--threads",
        type=int_in(0),
        default=0,
        help="torch threads per service of the mesh the bench starts; 0 = torch's default (default %(default)s)",
    )
    p.add_argument(
        "--mesh-flags",
        default="",
        metavar="FLAGS",
        help="more `vlmesh up` flags for the mesh the bench starts, as one string, e.g. "
        "'--switch-interval-ms 0.1 --kv-page-size 64'; not the ones the bench sets itself (model, ports, "
        "batch sizes, prefill budget, ...): give those to the bench (mesh) (default: none)",
    )
    p.add_argument(
        "--closed-loop",
        type=numbers(int, "a comma list of concurrencies, each >= 1, e.g. 1,4,16", empty=True),
        default="",
        help="also run closed loops at these concurrencies, e.g. 1,4,16 (default: none)",
    )
    return p


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse and check what one flag alone cannot (exit 2 with one line)."""
    args = parser.parse_args(argv)
    if args.warmup >= args.duration:
        parser.error(f"argument --warmup: {args.warmup:g} must be less than --duration {args.duration:g}")
    if args.tls and (args.gateway or set(args.target) - {"mesh"}):
        parser.error("argument --tls: only with --target mesh, the mesh it starts itself (not with --gateway)")
    if args.cuda_mps and args.gateway:
        parser.error("argument --cuda-mps: only for the mesh the bench starts itself (not with --gateway)")
    if args.mesh_flags:
        if args.gateway:
            parser.error("argument --mesh-flags: only for the mesh the bench starts itself (not with --gateway)")
        check_mesh_flags(parser, args.mesh_flags)
    if "mesh-http" in args.target and args.gateway and not args.gateway_http:
        parser.error("argument --target: mesh-http with --gateway needs --gateway-http URL (the gateway's HTTP door)")
    return args


class _Unset:
    """Any flag of the bench, unset: what `mesh_overrides` sets, without the values."""

    def __getattr__(self, name: str) -> None:
        return None


def mesh_overrides(args: argparse.Namespace, http: bool = False) -> dict:
    """What the bench sets in the mesh it starts, by `vlmesh up` dest; `http`: its HTTP door too."""
    return dict(
        metrics_ports=(0, 0, 0),
        model=args.model,
        gateway_port=0,
        vision_port=0,
        llm_port=0,
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        max_vision_batch=args.max_vision_batch,
        max_llm_batch=args.max_llm_batch,
        max_prefill_tokens=args.max_prefill_tokens,
        feature_cache_mib=args.feature_cache_mib,
        prefix_cache=args.prefix_cache,
        quantize=args.quantize,
        ready_signal=args.ready_signal,
        event_loop=args.event_loop,
        warmup_requests=4,
        log_level="warning",
        http_port=0 if http else -1,
        tls_throwaway_ca=args.tls,
        cuda_mps=args.cuda_mps,
        envoy_admin_port=0,  # with --placement replicate or --variants in --mesh-flags: Envoy's admin on a free port
    )


def check_mesh_flags(parser: argparse.ArgumentParser, text: str) -> None:
    """--mesh-flags must parse as `vlmesh up` flags with valid values, and leave alone what the bench
    sets itself (where the bench's value would win unseen): exit 2 naming the problem."""
    from services.launcher.cli import build_parser as up_parser
    from services.launcher.options import MeshOptions

    options = up_parser()._option_string_actions
    owned = set(mesh_overrides(_Unset()))
    for token in shlex.split(text):
        name = token.split("=", 1)[0]
        action = options.get(name)
        if action is not None and action.dest in owned:
            parser.error(f"argument --mesh-flags: {name} is set by the bench itself (see vlmesh bench --help)")
    try:
        MeshOptions.from_flags(shlex.split(text), model="/checked")
    except SystemExit:  # argparse has said what it does not know
        parser.error(f"argument --mesh-flags: {text!r} are not flags of vlmesh up (see vlmesh up --help)")
    except ValueError as err:
        parser.error(f"argument --mesh-flags: {err}")


def config_of(args: argparse.Namespace) -> dict:
    """The flags as results.json records them: lists as the comma text they came as, no API key."""

    def text(v):
        if isinstance(v, list | tuple):
            return ",".join(f"{x:g}" if isinstance(x, float) else str(x) for x in v)
        return str(v) if isinstance(v, Path) else v

    return {k: text(v) for k, v in vars(args).items() if k != "api_key"}
