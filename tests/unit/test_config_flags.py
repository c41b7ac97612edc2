"""docs/CONFIGURATION.md's flag table is the one the configs make (scripts/flag_table.py)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from services.launcher.cli import build_parser
from services.llm.config import LlmConfig
from tests.helpers import ROOT

DOC = ROOT / "docs" / "CONFIGURATION.md"


@pytest.fixture(scope="module")
def flag_table():
    spec = importlib.util.spec_from_file_location("flag_table", ROOT / "scripts" / "flag_table.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("flag_table", module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def default_host(monkeypatch):
    monkeypatch.delenv("VLMESH_HOST", raising=False)  # --host's default reads it


def test_the_documented_table_is_the_generated_one(flag_table):
    documented = flag_table.doc_table(DOC.read_text())
    assert documented == flag_table.table(), flag_table.STALE


def test_every_flag_of_up_and_serve_has_a_row(flag_table):
    flags = {row[0].strip("`").split()[0] for row in flag_table.rows()}
    up = {o for a in build_parser()._actions for o in a.option_strings[:1] if o.startswith("--") and o != "--help"}
    assert up <= flags
    from services.common.flags import flag_specs

    assert {s.name for s in flag_specs(LlmConfig).values()} <= flags


def test_a_changed_default_makes_the_documented_table_stale(flag_table, monkeypatch):
    from services.common import flags

    real = flags.flag_defaults
    changed = lambda cls: {**real(cls), "default_max_tokens": 999} if cls is LlmConfig else real(cls)  # noqa: E731
    monkeypatch.setattr(flags, "flag_defaults", changed)
    table = flag_table.table()
    assert "| `--default-max-tokens` | llm, up | `999` |" in table
    assert flag_table.doc_table(DOC.read_text()) != table


def test_the_rows_say_where_and_what(flag_table):
    rows = {row[0]: row for row in flag_table.rows()}
    assert rows["`--model`"][1:3] == ("vision, llm, up", "(required)")
    assert rows["`--llm-engine`"][1] == "llm, up" and "one of `native`, `vllm`" in rows["`--llm-engine`"][3]
    assert rows["`--port`"][2] == "gateway `50051`, vision `50052`, llm `50053`"
    assert rows["`--default-max-tokens`"][1:3] == ("llm, up", "`256`")
    assert rows["`--gateway-port`"][1] == "up"
