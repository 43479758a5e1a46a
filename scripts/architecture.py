"""The project's parts and the path of one render, drawn from the code: every import between the
project's own Jac and Python modules, grouped by folder, with the passes of one `render_context`
call numbered on top. Also the checks of the layout's rules: no two modules import each other in a
loop, graph/ imports nothing from engine/ or walkers/, and no source file is over MAX_LINES lines.

    python scripts/architecture.py docs/architecture.dot && dot -Tpng docs/architecture.dot -o docs/architecture.png
    python scripts/architecture.py --check      # exit 1 and name the loop or the forbidden import
    python scripts/architecture.py --check --max-lines   # also exit 1 for a source file over MAX_LINES
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("graph", "engine", "walkers", "adapters", "evaluation")
# How the Python packages are imported (pyproject's package-dir).
PACKAGES = {"contextrender": "adapters", "contextrender_eval": "evaluation"}

# Folders a folder's modules must not import (graph/ is the store of record: the archetypes).
FORBIDDEN = {"graph": ("engine", "walkers")}
# The longest a source file may be (tests aside); `--check` names longer ones, `--max-lines` fails.
MAX_LINES = 400
# What counts as source for MAX_LINES: the project's own code, not tests, generated files or the
# caches in .cache (the venvs and stores benchmarks and tests install there).
SOURCE_SUFFIXES = (".py", ".jac", ".js", ".sh")
NOT_SOURCE = ("tests", ".venv", ".venv-mongo", ".venv-hermes", ".cache", "node_modules", "__pycache__", "__jac_gen__", ".jac", "build")

_JAC_IMPORT = re.compile(r"^\s*import\s+from\s+([\w.]+)\s*\{", re.M)
_JAC_PLAIN = re.compile(r"^\s*import\s+([\w.]+)\s*;", re.M)
_TYPE_CHECKING = re.compile(r"^if TYPE_CHECKING:\n(?:[ \t]+.*\n|\n)+", re.M)
_PY_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import\s+\(?([\w, ]+)|import\s+([\w.]+))", re.M)

# The path of one render (POST /walker/render_context), in order: (from, to, what happens).
RENDER_PATH = (
    ("adapters/client", "walkers/render", "1 POST /walker/render_context (or Engine.render in-process)"),
    ("walkers/render", "walkers/session", "2 locate the caller's Session"),
    ("walkers/render", "walkers/ingest", "3 spawn Ingest on the Session: new events join the chain"),
    ("walkers/ingest", "engine/messages", "4 check the messages, match echoes"),
    ("walkers/ingest", "engine/index", "5 TrackReuse walks the new events: TFA, Reuses edges"),
    ("walkers/render", "engine/stability", "6 spawn Render: append to the previous request, or re-render"),
    ("engine/stability", "engine/selector", "7 re-render: the selector chooses"),
    ("engine/selector", "engine/plan", "8 on the render plan: layout, prose share, fold, candidates"),
    ("engine/plan", "engine/score", "9 U, q_t, greedy by R"),
    ("engine/plan", "engine/notices", "10 assemble: stubs, fold marker, condensed prose"),
)


def modules() -> dict[str, Path]:
    """Module name (folder/stem, folder/package/stem for a subpackage's modules, folder/package
    for its __init__; the entry module's stem) -> its declaration file."""
    found = {"contextrender": ROOT / "contextrender.jac"}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".jac", ".py") or path.name.endswith(".impl.jac"):
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            if "impl" in parts or "__pycache__" in parts or "__jac_gen__" in parts:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if len(parts) > 1:
                found["/".join(parts)] = path
    return found


def sources(name: str, path: Path) -> list[Path]:
    """A Jac module's declaration file and its impl annex."""
    annex = path.parent / "impl" / f"{path.stem}.impl.jac"
    return [path] + ([annex] if path.suffix == ".jac" and annex.exists() else [])


def imports(known: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (Jac `import from a.b {..}`, Python imports)."""
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        targets: set[str] = set()
        for source in sources(name, path):
            text = source.read_text()
            dotted = _JAC_IMPORT.findall(text) + _JAC_PLAIN.findall(text)
            if source.suffix == ".py":
                # Imports only a type checker runs (`if TYPE_CHECKING:` blocks) are no arrows.
                text = _TYPE_CHECKING.sub("", text)
                # `from package import module` imports the module too.
                dotted = [m for a, names, b in _PY_IMPORT.findall(text)
                          for m in ([a] + [f"{a}.{n.strip()}" for n in names.split(",") if n.strip()] if a else [b])]
            for module in dotted:
                parts = module.split(".")
                parts[0] = PACKAGES.get(parts[0], parts[0])
                # The longest prefix that is a module: `a.b.c` may be module c of package b, or
                # the name c of module b.
                for size in range(len(parts), 0, -1):
                    candidate = "/".join(parts[:size])
                    if candidate in known:
                        if candidate != name:
                            targets.add(candidate)
                        break
        graph[name] = targets
    return graph


def find_loop(graph: dict[str, set[str]]) -> list[str]:
    """One import loop (its modules in order, the first repeated at the end), or []."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state:
                loop = visit(target)
                if loop:
                    return loop
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            loop = visit(node)
            if loop:
                return loop
    return []


def forbidden_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The imports FORBIDDEN rules out, as (module, what it imports)."""
    return sorted((source, target) for (source, targets) in graph.items() for target in targets
                  if target.split("/")[0] in FORBIDDEN.get(source.split("/")[0], ()))


def long_files(root: Path = ROOT, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    """Source files over `limit` lines, as (path, lines), longest first."""
    found = []
    for path in root.rglob("*"):
        relative = path.relative_to(root)
        if path.suffix in SOURCE_SUFFIXES and path.is_file() and not any(p in NOT_SOURCE for p in relative.parts[:-1]):
            lines = len(path.read_text(errors="replace").splitlines())
            if lines > limit:
                found.append((relative.as_posix(), lines))
    return sorted(found, key=lambda item: -item[1])


def dot(graph: dict[str, set[str]]) -> str:
    lines = [
        "digraph contextrender {",
        '  rankdir=LR; compound=true; node [shape=box, style="rounded,filled", fillcolor=white, fontname=Helvetica, fontsize=10];',
        '  edge [color="#999999", arrowsize=0.6]; fontname=Helvetica; labelloc=t;',
        '  label="ContextRender: modules (grey arrows: imports) and the path of one render (red, numbered)";',
    ]
    titles = {"graph": "graph/: archetypes", "engine": "engine/: arrays, rules, texts", "walkers": "walkers/: endpoints and passes",
              "adapters": "adapters/: the Python edge", "evaluation": "evaluation/: replay harness"}
    for folder in FOLDERS:
        members = sorted(n for n in graph if n.startswith(folder + "/"))
        if members:
            lines.append(f'  subgraph "cluster_{folder}" {{ label="{titles[folder]}"; style=rounded; color="#bbbbbb";')
            lines += [f'    "{n}" [label="{"/".join(n.split("/")[1:])}"];' for n in members]
            lines.append("  }")
    lines.append('  "contextrender" [label="contextrender.jac\\n(jac start)", fillcolor="#eef5ff"];')
    for source in sorted(graph):
        for target in sorted(graph[source]):
            lines.append(f'  "{source}" -> "{target}";')
    for source, target, label in RENDER_PATH:
        lines.append(f'  "{source}" -> "{target}" [color="#cc2222", fontcolor="#cc2222", fontsize=9, penwidth=1.6, label="{label}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", type=Path, help="write the DOT file here")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the imports form a loop or graph/ imports engine/ or walkers/")
    parser.add_argument("--max-lines", action="store_true",
                        help=f"with --check: exit 1 too if a source file (tests aside) is over {MAX_LINES} lines")
    args = parser.parse_args()
    known = modules()
    graph = imports(known)
    missing = [(s, t) for s, t, _ in RENDER_PATH if s not in known or t not in known]
    if missing:
        print(f"the render path names modules that do not exist: {missing}", file=sys.stderr)
        return 1
    loop = find_loop(graph)
    if loop:
        print("import loop: " + " -> ".join(loop), file=sys.stderr)
        return 1
    forbidden = forbidden_imports(graph)
    if forbidden:
        print("forbidden imports: " + ", ".join(f"{s} -> {t}" for s, t in forbidden), file=sys.stderr)
        return 1
    if args.check:
        long = long_files()
        if long:
            print(f"over {MAX_LINES} lines: " + ", ".join(f"{p} ({n})" for p, n in long),
                  file=sys.stderr if args.max_lines else sys.stdout)
            if args.max_lines:
                return 1
    if args.out:
        args.out.write_text(dot(graph))
        print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports, no loop: {args.out}")
    elif args.check:
        print(f"{len(graph)} modules, no import loop, no forbidden import")
    return 0


if __name__ == "__main__":
    sys.exit(main())
