"""`vlmesh bench --help` gives every flag's default, and docs/BENCH.md's "vlmesh bench" names every target."""

from __future__ import annotations

import argparse

import pytest

from services.bench.args import TARGETS, build_parser, parse_args
from tests.helpers import ROOT


def test_every_flag_has_help_that_gives_its_default():
    parser = build_parser("bench")
    missing = [
        action.option_strings[-1]
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction) and "default" not in (action.help or "")
    ]
    assert missing == []
    text = " ".join(parser.format_help().split())  # argparse wraps lines
    for flag, default in (("--seed", 0), ("--device", "auto"), ("--dtype", "auto"), ("--max-llm-batch", 8)):
        action = parser._option_string_actions[flag]
        assert action.default == default and action.help % {"default": default} in text, flag


def test_a_device_name_torch_would_not_take_is_refused_before_anything_starts(capsys):
    parser = build_parser("bench")
    assert parse_args(parser, ["--device", "cuda:1"]).device == "cuda:1"
    with pytest.raises(SystemExit) as exit_:
        parse_args(parser, ["--device", "gpu"])
    assert exit_.value.code == 2
    assert "argument --device: 'gpu': use cpu, cuda, cuda:N or auto" in capsys.readouterr().err


def test_the_bench_doc_names_every_target():
    doc = (ROOT / "docs" / "BENCH.md").read_text()
    section = doc[doc.index("## vlmesh bench") :]
    section = section[: section.index("\n## ")]
    assert [t for t in TARGETS if f"`{t}`" not in section] == []
