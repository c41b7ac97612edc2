"""Typed configs whose fields are their own command-line flags, the flags every server shares,
and the checks that make bad values fail at start-up.

A config is a frozen dataclass; each field that is a flag is declared once, with `flag(...)`:
its name, default and help, and its type from the field's annotation. Three generic helpers
then serve every config: `add_flags` (to an argparse parser, all or some of them), `from_args`
(parsed flags -> config) and `to_argv` (config -> the argv of a child process). A field made
with `nested(...)` holds another config whose flags join this one's (`server`, `model`).
Validation stays in each config's `check()`. This module imports no torch: the launcher
imports every service's config.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import MISSING, dataclass, field
from typing import Any

from services.common import eventloop
from services.common.logs import LOG_FORMATS, LOG_LEVELS

# Python's GIL switch interval for processes that run an engine or batcher thread beside an
# asyncio loop (Python's default, 5 ms, delays every result the loop relays; docs/PERF.md).
SWITCH_INTERVAL_MS = 0.5
# How a CUDA hand-off's reader knows the slot is written (services/common/cuda_arena.py).
READY_SIGNALS = ("sync", "event")
DTYPES = ("auto", "float32", "bfloat16", "float16")

# The mesh's well-known defaults, each written once. Each service's config names its own
# (DEFAULT_PORT, DEFAULT_METRICS_PORT, DEFAULT_MAX_BATCH); they sit here because the gateway
# also needs its peers' ports and the llm's batch, and services never import each other.
DEFAULT_HOST = "127.0.0.1"
MESH_PORTS = {"gateway": 50051, "vision": 50052, "llm": 50053}
MESH_METRICS_PORTS = {"gateway": 9464, "vision": 9465, "llm": 9466}
LLM_MAX_BATCH = 8  # sequences the llm decodes together; the gateway's admission parallelism

_FLAG, _NESTED = "vlmesh.flag", "vlmesh.nested"


@dataclass(frozen=True)
class Flag:
    """How one config field appears on a command line."""

    name: str  # "--max-llm-batch"
    help: str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    # For a structured value (a dict): text -> value, raising ValueError that names the flag,
    # and value -> text. Parsed after argparse, so the message reaches the user unchanged.
    parse: Callable[[str], Any] | None = None
    text: Callable[[Any], str] | None = None

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")

    def format(self, value: Any) -> str:
        return self.text(value) if self.text else str(value)


def flag(
    name: str,
    *,
    help: str,
    default: Any = MISSING,
    default_factory: Callable[[], Any] | Any = MISSING,
    choices: Iterable[str] | None = None,
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
    text: Callable[[Any], str] | None = None,
) -> Any:
    """A dataclass field that is also the flag `name`; no default makes the flag required."""
    spec = Flag(name, help, tuple(choices) if choices else None, metavar, parse, text)
    return field(default=default, default_factory=default_factory, metadata={_FLAG: spec})


def nested(cls: type, **defaults: Any) -> Any:
    """A field holding a `cls` config whose flags join the outer config's.

    `defaults` replace some of its flags' defaults for this use (a service's own port).
    """
    complete = all(
        f.name in defaults or f.default is not MISSING or f.default_factory is not MISSING
        for f in dataclasses.fields(cls)
    )
    factory = functools.partial(cls, **defaults) if complete else MISSING
    return field(default_factory=factory, metadata={_NESTED: defaults})


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _argparse_type(hint: Any) -> type:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = members[0] if len(members) == 1 else str
    return hint if hint in (int, float) else str


@dataclass(frozen=True)
class _Entry:
    spec: Flag
    type: type
    default: Any  # MISSING: required
    title: str  # the argument group of the config that declares it


def _entries(cls: type, defaults: Mapping[str, Any] | None = None) -> Iterator[_Entry]:
    defaults = defaults or {}
    for f in dataclasses.fields(cls):
        if _NESTED in f.metadata:
            yield from _entries(_hints(cls)[f.name], f.metadata[_NESTED])
        elif _FLAG in f.metadata:
            spec: Flag = f.metadata[_FLAG]
            if f.name in defaults:
                default = defaults[f.name]
            elif f.default_factory is not MISSING:
                default = f.default_factory()
            else:
                default = f.default
            kind = str if spec.parse else _argparse_type(_hints(cls)[f.name])
            yield _Entry(spec, kind, default, getattr(cls, "FLAGS_TITLE", cls.__name__))


def flag_specs(cls: type) -> dict[str, Flag]:
    """Every flag of `cls` and of the configs it nests, by dest (`max_llm_batch`)."""
    return {e.spec.dest: e.spec for e in _entries(cls)}


def flag_defaults(cls: type) -> dict[str, Any]:
    """Each flag's default for `cls` (a nested config's with this use's overrides), by dest."""
    return {e.spec.dest: e.default for e in _entries(cls) if e.default is not MISSING}


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    only: Iterable[str] | None = None,
    group: argparse._ArgumentGroup | None = None,
) -> None:
    """Add the flags of `cls` (those whose dest is in `only`, when given) to `parser`.

    Each config's flags go under its own group (its FLAGS_TITLE), or all under `group`.
    """
    wanted = None if only is None else set(only)
    entries = [e for e in _entries(cls) if wanted is None or e.spec.dest in wanted]
    if wanted is not None and (unknown := wanted - {e.spec.dest for e in entries}):
        raise KeyError(f"{cls.__name__} has no flags {sorted(unknown)}")
    groups: dict[str, Any] = {}
    for e in entries:
        if group is None and e.title not in groups:
            groups[e.title] = parser.add_argument_group(e.title)
        target = group or groups[e.title]
        kwargs: dict[str, Any] = {"help": e.spec.help}
        if e.type is not str:
            kwargs["type"] = e.type
        if e.default is MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = None if e.default is None else e.spec.format(e.default) if e.spec.parse else e.default
        if e.spec.choices:
            kwargs["choices"] = e.spec.choices
        if e.spec.metavar:
            kwargs["metavar"] = e.spec.metavar
        target.add_argument(e.spec.name, **kwargs)


def from_args(cls: type, values: argparse.Namespace | Mapping[str, Any], **given: Any) -> Any:
    """Build `cls` from parsed flags (a Namespace, or a mapping by dest).

    A flag missing from `values` takes its declared default; `given` sets fields directly.
    A structured flag's text is parsed here (ValueError names the flag). No check().
    """
    if isinstance(values, argparse.Namespace):
        values = vars(values)
    return _build(cls, values, {}, given)


def _build(cls: type, values: Mapping[str, Any], defaults: Mapping[str, Any], given: Mapping[str, Any]) -> Any:
    kwargs: dict[str, Any] = dict(given)
    for f in dataclasses.fields(cls):
        if f.name in kwargs:
            continue
        if _NESTED in f.metadata:
            kwargs[f.name] = _build(_hints(cls)[f.name], values, f.metadata[_NESTED], {})
        elif _FLAG in f.metadata:
            spec: Flag = f.metadata[_FLAG]
            if spec.dest in values:
                value = values[spec.dest]
                kwargs[f.name] = spec.parse(value) if spec.parse and isinstance(value, str) else value
            elif f.name in defaults:
                kwargs[f.name] = defaults[f.name]
    return cls(**kwargs)


def to_argv(cfg: Any) -> list[str]:
    """The flags that make a process parse this very config (a None value: the flag left out)."""
    argv: list[str] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if _NESTED in f.metadata:
            argv += to_argv(value)
        elif _FLAG in f.metadata and value is not None:
            spec: Flag = f.metadata[_FLAG]
            argv += [spec.name, spec.format(value)]
    return argv


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

    def check(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is not a TCP port (0 picks a free one)")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port {self.metrics_port}: a TCP port, 0 for a free one, -1 for none")
        if self.grace_s < 0:
            raise ValueError(f"--grace-s {self.grace_s} must be >= 0")
        if not 0 < self.switch_interval_ms <= 100:
            raise ValueError(f"--switch-interval-ms {self.switch_interval_ms} must be in (0, 100]")
        eventloop.resolve(self.event_loop)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    FLAGS_TITLE = "model"

    path: str = flag(
        "--model",
        help="local directory of a Hugging Face LLaVA checkpoint, or preset:NAME (random weights)",
    )
    device: str = flag("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda when available)")
    dtype: str = flag(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="weights and activations; auto = bfloat16 on CUDA, float32 on CPU",
    )
    threads: int = flag("--threads", default=0, help="torch CPU threads; 0 = torch's default")

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
