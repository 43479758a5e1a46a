"""adapters/core.py: the Python layer's one door into the Jac modules (for adapters/ and
evaluation/); and the layer's imports form no loop."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from contextrender import core

REPO = Path(__file__).resolve().parent.parent
PYTHON_LAYER = ("adapters", "evaluation")
JAC_PACKAGES = {"graph", "walkers", "engine"}
# Each folder of the Python layer by the package name it is installed as (pyproject.toml).
PACKAGES = {"contextrender": "adapters", "contextrender_eval": "evaluation"}


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at its top or inside a function (`from package import
    module` counts as importing the module too), but for what only a type checker imports (the
    body of `if TYPE_CHECKING:`)."""
    modules: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    for guarded in [n for n in ast.walk(tree) if isinstance(n, ast.If) and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING"]:
        guarded.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def layer_modules() -> dict[str, Path]:
    """Each module of the layer by its dotted name (a subpackage's __init__ named as the package)."""
    modules = {}
    for (package, folder) in PACKAGES.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = [package, *path.relative_to(REPO / folder).with_suffix("").parts]
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def test_only_core_imports_jac_modules():
    leaks = {
        str(path.relative_to(REPO)): sorted(m for m in imported_modules(path) if m.split(".")[0] in JAC_PACKAGES)
        for folder in PYTHON_LAYER
        for path in sorted((REPO / folder).rglob("*.py"))
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
        "import sys; from contextrender.core import content_text; "
        "print(sorted(m for m in sys.modules if m.startswith('walkers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_python_layer_imports_in_no_loop():
    # Lazy imports count: a loop broken only by importing inside a function is still a loop. A
    # package's __init__ is left out as a target: every submodule's import runs it first anyway.
    modules = layer_modules()
    graph = {
        name: sorted(m for m in imported_modules(path) if m in modules and m not in PACKAGES and m != name)
        for (name, path) in modules.items()
    }
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = "open"
        path.append(name)
        for target in graph[name]:
            if state.get(target) == "open":
                pytest.fail("import loop: " + " -> ".join(path[path.index(target):] + [target]))
            if target not in state:
                visit(target)
        path.pop()
        state[name] = "done"

    for name in graph:
        if name not in state:
            visit(name)
    # The check sees the imports it should: the proxy's command line reaches the engine.
    assert "contextrender.local" in graph["contextrender.proxy.command"]


@pytest.mark.parametrize("first", ["contextrender.proxy", "contextrender_eval.sweep_report"])
def test_every_module_imports_in_a_fresh_interpreter(first):
    # `first` imported first: a loop would surface as a partially initialised module.
    names = [first] + [m for m in layer_modules() if m != first]
    code = "import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]"
    done = subprocess.run([sys.executable, "-c", code, *names], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
