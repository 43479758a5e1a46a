"""scripts/architecture.py: the project's modules import each other without a loop, no source file
is over 400 lines, and the render path the picture draws names modules that exist; docs/layout.md
names every source file, and only files that exist."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_import_loop_no_long_file_and_the_render_path_exists():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "architecture.py"), "--check", "--max-lines"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "no import loop, no forbidden import" in done.stdout


def test_a_loop_is_found(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import architecture
    finally:
        sys.path.pop(0)
    assert architecture.find_loop({"a/x": {"a/y"}, "a/y": {"a/z"}, "a/z": {"a/x"}}) == ["a/x", "a/y", "a/z", "a/x"]
    assert architecture.find_loop({"a/x": {"a/y"}, "a/y": set()}) == []


def load_script():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import architecture
    finally:
        sys.path.pop(0)
    return architecture


def test_graph_may_not_import_engine_or_walkers():
    architecture = load_script()
    graph = {"graph/context": {"engine/measure", "graph/content"}, "graph/content": set(),
             "walkers/ingest": {"graph/context", "engine/index"}, "engine/measure": set(), "engine/index": {"graph/context"}}
    assert architecture.forbidden_imports(graph) == [("graph/context", "engine/measure")]
    # What the project's graph/ imports today.
    found = architecture.imports(architecture.modules())
    assert found["graph/context"] == {"graph/content"} and found["graph/content"] == set()


def test_a_subpackage_module_is_found_and_its_imports_too(tmp_path, monkeypatch):
    architecture = load_script()
    (tmp_path / "adapters" / "proxy").mkdir(parents=True)
    (tmp_path / "adapters" / "proxy" / "__init__.py").write_text("from contextrender.proxy.app import create_app\n")
    (tmp_path / "adapters" / "proxy" / "app.py").write_text("from contextrender import core\n")
    (tmp_path / "adapters" / "core.py").write_text("")
    (tmp_path / "contextrender.jac").write_text("")
    monkeypatch.setattr(architecture, "ROOT", tmp_path)
    found = architecture.imports(architecture.modules())
    assert found["adapters/proxy"] == {"adapters/proxy/app"} and found["adapters/proxy/app"] == {"adapters/core"}


def test_long_source_files_are_named_and_tests_are_not(tmp_path):
    architecture = load_script()
    (tmp_path / "engine").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "engine" / "long.jac").write_text("x\n" * 401)
    (tmp_path / "engine" / "short.py").write_text("x\n" * 400)
    (tmp_path / "tests" / "test_long.py").write_text("x\n" * 900)
    assert architecture.long_files(tmp_path) == [("engine/long.jac", 401)]


def test_the_layout_page_names_every_source_file():
    """docs/layout.md names each tracked source file: by its path, by a folder row (`dir/`), by a
    pattern row (`tests/test_integrations_*.py`), or, for `impl/x.impl.jac`, by its declaration `x.jac`."""
    import fnmatch
    import re

    layout = (ROOT / "docs" / "layout.md").read_text()
    named = set(re.findall(r"^\| `([^`]+)` \|", layout, re.M))
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    sources = [f for f in files if f.endswith((".py", ".jac", ".mjs", ".js", ".sh")) and "node_modules" not in f]

    def found(path: str) -> bool:
        declaration = re.sub(r"impl/(\w+)(\.\w+)?\.impl\.jac$", r"\1.jac", path)
        return any(
            name == path or name == declaration or (name.endswith("/") and path.startswith(name)) or fnmatch.fnmatch(path, name)
            for name in named
        )

    assert [f for f in sources if not found(f)] == []
    assert [name for name in named if "*" not in name and not (ROOT / name).exists()] == []
