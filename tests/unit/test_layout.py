"""The shape of the tree: test modules share code only through tests/helpers.py; no module grows several ideas."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import ROOT

HELPERS = "tests.helpers"
# A module holds one idea, named after what it holds (docs/DESIGN.md): that is a review rule, and
# cohesion, not a line count, decides a split. This loose cap only catches a module that has
# plainly grown several ideas.
MAX_SERVICE_LINES = 500


def module_name(path: Path, root: Path) -> str:
    """`tests/unit/llm/test_engine.py` -> `tests.unit.llm.test_engine` (a package's `__init__` -> the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import in `source`, top-level or nested, relative ones resolved.

    `from pkg import name` yields `pkg.name` when `pkg` is a package of the tree (`tests`), so that
    `from tests import conftest` counts as importing `tests.conftest`. Calls of `importlib.import_module`
    and `__import__` with a literal name count too.
    """
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from ..x import y` in tests/unit/llm/ is tests.unit.x
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            if node.module is None or base == "tests":  # `from . import m`, `from tests import m`
                found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, base))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def is_test_module(name: str) -> bool:
    """Whether importing `name` reaches into another test module (anything under `tests` but the helpers)."""
    if name == HELPERS or name.startswith(HELPERS + "."):
        return False
    return name == "tests" or name.startswith("tests.")


def cross_imports(root: Path) -> list[tuple[str, int, str]]:
    """(file, line, module) for every import of a test module by a file under root/tests."""
    bad = []
    for path in sorted((root / "tests").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        imports = imported_modules(path.read_text(), module_name(path, root), path.name == "__init__.py")
        bad += [(rel, line, name) for line, name in sorted(imports) if is_test_module(name)]
    return bad


def oversized(root: Path, limit: int) -> list[tuple[str, int]]:
    """(file, lines) for every root/services/**/*.py longer than `limit` lines, longest first."""
    sizes = [
        (p.relative_to(root).as_posix(), len(p.read_text().splitlines())) for p in (root / "services").rglob("*.py")
    ]
    return sorted(((f, n) for f, n in sizes if n > limit), key=lambda fn: -fn[1])


def test_test_modules_import_only_the_helpers():
    bad = cross_imports(ROOT)
    assert not bad, "test modules import other test modules; move what they share to tests/helpers.py:\n" + "\n".join(
        f"  {f}:{line}: {m}" for f, line, m in bad
    )


def test_service_modules_stay_small():
    big = oversized(ROOT, MAX_SERVICE_LINES)
    assert not big, f"services modules over {MAX_SERVICE_LINES} lines: does each still hold one idea?\n" + "\n".join(
        f"  {f}: {n} lines" for f, n in big
    )


def test_the_import_check_catches_every_form(tmp_path):
    """The checker itself: each way of reaching another test module is caught, the helpers are not."""
    pkg = tmp_path / "tests" / "unit" / "llm"
    pkg.mkdir(parents=True)
    # Spelled `@` so that grepping the tree for imports of tests.* does not find these lines.
    bad = (
        "import importlib\n"
        "from @.helpers import image_bytes\n"
        "from @ import helpers\n"
        "from @.unit.gateway.test_tenants import make\n"
        "import @.conftest\n"
        "from @ import conftest\n"
        "from . import test_other\n"
        "from ..common.test_logs import record\n"
        "def f():\n"
        "    from @.integration.test_oracle import CASES\n"
        "    importlib.import_module('@.unit.llm.test_other')\n"
    )
    fine = "import os\nfrom @.helpers import ROOT\nfrom @ import helpers\nfrom ... import helpers\n"
    (pkg / "test_bad.py").write_text(bad.replace("@", "tests"))
    (pkg / "test_fine.py").write_text(fine.replace("@", "tests"))
    (tmp_path / "tests" / "test_fine_too.py").write_text("from . import helpers\nfrom .helpers import ROOT\n")
    assert [(line, m) for _, line, m in cross_imports(tmp_path)] == [
        (4, "tests.unit.gateway.test_tenants"),
        (5, "tests.conftest"),
        (6, "tests.conftest"),
        (7, "tests.unit.llm.test_other"),
        (8, "tests.unit.common.test_logs"),
        (10, "tests.integration.test_oracle"),
        (11, "tests.unit.llm.test_other"),
    ]


def test_the_size_check_catches_a_long_module(tmp_path):
    (tmp_path / "services" / "x").mkdir(parents=True)
    (tmp_path / "services" / "x" / "short.py").write_text("a = 1\n" * 300)
    (tmp_path / "services" / "x" / "long.py").write_text("a = 1\n" * 301)
    assert oversized(tmp_path, 300) == [("services/x/long.py", 301)]
