"""The Makefile's torch install can be steered from the command line: a machine whose pip sees only
PyPI takes the CPU build from PyTorch's index (README, first section)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on PATH")


def make(*args: str) -> str:
    out = subprocess.run(["make", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_torch_spec_and_pip_flags_reach_the_torch_install(tmp_path):
    # -n prints the recipe without running it; a fresh VENV makes the venv's recipe due.
    recipe = make("-n", "venv", f"VENV={tmp_path / 'venv'}", "TORCH_SPEC=torch==9.9.9", f"PIP_TORCH_FLAGS={CPU_INDEX}")
    torch_lines = [line for line in recipe.splitlines() if "torch==9.9.9" in line]
    assert len(torch_lines) == 1, recipe
    assert f'{CPU_INDEX} "torch==9.9.9"' in torch_lines[0]
    assert CPU_INDEX not in recipe.replace(torch_lines[0], "")  # the index is torch's alone


def test_make_help_names_the_variables():
    text = make("help")
    assert "TORCH_SPEC" in text and "PIP_TORCH_FLAGS" in text and CPU_INDEX in text
