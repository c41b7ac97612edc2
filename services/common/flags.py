"""Config fields that are their own command-line flags.

A config is a frozen dataclass; each field that is a flag is declared once, with `flag(...)`:
its name, default and help, and its type from the field's annotation. Three generic helpers
then serve every config: `add_flags` (to an argparse parser, all or some of them), `from_args`
(parsed flags -> config) and `to_argv` (config -> the argv of a child process). A field made
with `nested(...)` holds another config whose flags join this one's (`server`, `model`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import MISSING, dataclass, field
from typing import Any

from services.common.validation import CliParser

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
    return hint if hint in (int, float, bool) else str


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
        if e.type is bool:  # --name / --no-name
            kwargs["action"] = argparse.BooleanOptionalAction
        elif e.type is not str:
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
            if isinstance(value, bool):
                argv.append(spec.name if value else "--no-" + spec.name.removeprefix("--"))
            else:
                argv += [spec.name, spec.format(value)]
    return argv


def parse_config(cls: type, argv: list[str] | None = None) -> Any:
    """`vlmesh serve NAME`'s flags -> a checked config; the parser's prog and description are the
    class's PROG and DESCRIPTION. ValueError (from `check()`) names the flag at fault."""
    parser = CliParser(prog=cls.PROG, description=cls.DESCRIPTION)  # a bad flag: one line, exit 2
    add_flags(parser, cls)
    cfg = from_args(cls, parser.parse_args(argv))
    cfg.check()
    return cfg
