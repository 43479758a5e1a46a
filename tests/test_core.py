"""adapters/core.py: the Python layer's one door into the Jac modules (for adapters/ and evaluation/)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from contextrender_adapters import core

REPO = Path(__file__).resolve().parent.parent
PYTHON_LAYER = ("adapters", "evaluation")
JAC_PACKAGES = {"graph", "walkers", "engine"}


def imported_modules(path: Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
    return modules


def test_only_core_imports_jac_modules():
    leaks = {
        str(path.relative_to(REPO)): sorted(m for m in imported_modules(path) if m.split(".")[0] in JAC_PACKAGES)
        for folder in PYTHON_LAYER
        for path in sorted((REPO / folder).glob("*.py"))
        if path.name != "core.py"
    }
    assert {path: names for path, names in leaks.items() if names} == {}


def test_every_listed_name_resolves():
    for name in core.__all__:
        assert getattr(core, name) is not None, name


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'render'"):
        core.render  # noqa: B018


def test_a_name_loads_only_its_own_module():
    # content_text is graph/measure.jac: the walkers stay unloaded (the CLI starts without them).
    code = (
        "import sys; from contextrender_adapters.core import content_text; "
        "print(sorted(m for m in sys.modules if m.startswith('walkers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
