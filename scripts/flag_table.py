"""The flag table of docs/CONFIGURATION.md, generated from the configs that declare each flag.

Each service's config (services/{gateway,vision,llm}/config.py) declares its flags once, with
their defaults and help (services/common/flags.py); `vlmesh up` takes some of them
(services/launcher/cli.py PASSED_ON) and adds its own. This prints the table those declarations
make, one row per flag (a flag whose meaning differs between services gets a row for each), so
that docs/CONFIGURATION.md says what `vlmesh up --help` and `vlmesh serve NAME --help` say.
tests/unit/test_config_flags.py fails when the table there differs.

    python scripts/flag_table.py            # print the table
    python scripts/flag_table.py --write    # replace it in docs/CONFIGURATION.md, between the markers
    python scripts/flag_table.py --check    # exit 1 if docs/CONFIGURATION.md's table differs
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import MISSING
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "CONFIGURATION.md"
BEGIN, END = "<!-- flags:begin -->", "<!-- flags:end -->"
STALE = "docs/CONFIGURATION.md's flag table is stale: run python scripts/flag_table.py --write"
SERVICES = ("gateway", "vision", "llm")
# The note on the default that ends a help text: "(default %(default)s)", "(default: the write-ups',
# %(default)s)", "(default: 8, 6 and 3 times the llm's batch)"; _VALUE stands in for %(default)s.
_VALUE = "\x00"
_DEFAULT_NOTE = re.compile(r"\s*\(default\b:?\s*([^()]*)\)\s*$")


def _configs() -> dict[str, type]:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from services.gateway.config import GatewayConfig
    from services.llm.config import LlmConfig
    from services.vision.config import VisionConfig

    return {"gateway": GatewayConfig, "vision": VisionConfig, "llm": LlmConfig}


def _default_text(spec, value: Any) -> str:
    if value is MISSING:
        return "(required)"
    if value is None:
        return "unset"
    return spec.format(value) if spec.parse else str(value)


def _split_help(help_text: str, default: str) -> tuple[str, str]:
    """(meaning, default cell): the help without the note on the default that ends it, and the
    default as code, or the note's own words when it says more than the value."""
    text = help_text.replace("%(default)s", _VALUE)  # argparse's placeholder has parentheses of its own
    found = _DEFAULT_NOTE.search(text)
    if found is None:
        return help_text.replace("%(default)s", default), _code(default)
    meaning = text[: found.start()].strip().replace(_VALUE, default)
    note = found.group(1).strip()
    if note == _VALUE:
        return meaning, _code(default)
    return meaning, note.replace(_VALUE, default)


def _code(text: str) -> str:
    return f"`{text}`" if text and text not in ("(required)", "unset") else text or "empty"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("%%", "%").replace("|", "\\|")  # argparse's escaped percent


def rows() -> list[tuple[str, str, str, str]]:
    """(flag, where, default, meaning) for every flag of the three services and of `vlmesh up`."""
    from services.common.config import ModelConfig, ServerConfig
    from services.common.flags import flag_defaults, flag_specs
    from services.launcher.cli import PASSED_ON, build_parser

    configs = _configs()
    # Model flags first, then each service's own, then the flags every server has.
    shared = list(flag_specs(ServerConfig))
    order: list[str] = list(flag_specs(ModelConfig))
    for name in SERVICES:
        order += [d for d in flag_specs(configs[name]) if d not in order and d not in shared]
    order += shared

    # By flag: groups of services where the flag means the same thing (same help).
    table: list[tuple[str, str, str, str]] = []
    for dest in order:
        groups: dict[str, list[tuple[str, str]]] = {}  # help -> [(service, default)]
        spec_of = {}
        for name in SERVICES:
            specs = flag_specs(configs[name])
            if dest in specs:
                spec = specs[dest]
                spec_of[spec.help] = spec
                value = flag_defaults(configs[name]).get(dest, MISSING)
                groups.setdefault(spec.help, []).append((name, _default_text(spec, value)))
        for help_text, members in groups.items():
            spec = spec_of[help_text]
            where = [name for name, _ in members]
            if all(dest in PASSED_ON[name] for name in where):
                where.append("up")
            defaults = {d for _, d in members}
            if len(defaults) == 1:
                meaning, default = _split_help(help_text, defaults.pop())
            else:
                meaning, _ = _split_help(help_text, "")
                default = ", ".join(f"{name} {_code(d)}" for name, d in members)
            table.append((_flag_cell(spec), ", ".join(where), default, _meaning(meaning, spec)))

    # `vlmesh up`'s own flags: MeshOptions' and those its parser adds by hand (ports).
    known = {s.name for c in configs.values() for s in flag_specs(c).values()}
    for action in build_parser()._actions:
        name = next((o for o in action.option_strings if o.startswith("--")), None)
        if name is None or name in known or name == "--help":
            continue
        default = "(required)" if action.required else _default_text(_Plain(), action.default)
        meaning, default = _split_help(action.help or "", default)
        table.append((_flag_cell(_Plain(name, action.metavar)), "up", default, _meaning(meaning, action)))
    return table


class _Plain:
    """An argparse action's flag, shaped like a Flag for the helpers above."""

    parse = None

    def __init__(self, name: str = "", metavar: str | None = None) -> None:
        self.name, self.metavar = name, metavar

    def format(self, value: Any) -> str:
        return str(value)


def _flag_cell(spec) -> str:
    return f"`{spec.name} {spec.metavar}`" if spec.metavar else f"`{spec.name}`"


def _meaning(text: str, spec) -> str:
    choices = getattr(spec, "choices", None)
    if choices:
        text = f"{text.rstrip('.')}; one of {', '.join(f'`{c}`' for c in choices)}"
    return text


def table() -> str:
    lines = ["| flag | where | default | meaning |", "| --- | --- | --- | --- |"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows()]
    return "\n".join(lines) + "\n"


def doc_table(text: str) -> str:
    """The document's table: what lies between the markers."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip("\n") + "\n"


def with_table(text: str, new: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + new + text[end:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="The flag table of docs/CONFIGURATION.md, from the configs.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="replace the table in docs/CONFIGURATION.md")
    mode.add_argument("--check", action="store_true", help="exit 1 if docs/CONFIGURATION.md's table differs")
    args = p.parse_args(argv)
    new = table()
    if args.write:
        DOC.write_text(with_table(DOC.read_text(), new))
    elif args.check:
        if doc_table(DOC.read_text()) != new:
            print(STALE, file=sys.stderr)
            return 1
    else:
        print(new, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
