"""The tests' own layout: shared helpers come from ``tests/helpers/``, never from another test
module or from conftest.py, so each helper has one home a reader can find and a test module
can be read, run or removed on its own. Fixtures several files use live in conftest.py,
which pytest loads itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
FILES = sorted(TESTS.glob("test_*.py")) + sorted((TESTS / "helpers").glob("*.py"))


def _forbidden(name: str) -> bool:
    """Whether a dotted module name (relative dots stripped) is a test module or conftest."""
    parts = name.split(".")
    if parts[0] == "tests":
        parts = parts[1:]
    return bool(parts) and (parts[0] == "conftest" or parts[0].startswith("test_"))


def imported_test_modules(source: str) -> list[str]:
    """The test modules and conftests that ``source`` imports (at any depth), as written."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if _forbidden(a.name)]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            written = "." * node.level + module
            if module and _forbidden(module):
                found.append(written)
            elif module in ("", "tests"):  # from . import test_x / from tests import conftest
                found += [f"{written}{'.' if module else ''}{a.name}" for a in node.names if _forbidden(a.name)]
    return found


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(TESTS)))
def test_no_test_imports_another_test_module_or_conftest(path):
    bad = imported_test_modules(path.read_text())
    assert not bad, f"{path.name} imports {bad}: move the shared helper to tests/helpers/ (a fixture to conftest.py)"


@pytest.mark.parametrize(
    "source",
    [
        "from tests.test_x import y",
        "from .test_x import y",
        "import tests.test_x",
        "from .conftest import y",
        "from tests.conftest import y",
        "import conftest",
        "from conftest import y",
        "from . import conftest",
        "from tests import test_x",
        "def f():\n    from tests.test_x import y",
    ],
)
def test_the_check_sees_each_form(source):
    assert imported_test_modules(source)


def test_the_check_lets_helpers_through():
    assert not imported_test_modules(
        "from tests.helpers.project import run_kedro\nfrom .helpers import models\n"
        "import tests.helpers.rewards\nfrom qerl_pipeline.rl import step"
    )
