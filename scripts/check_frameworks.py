"""Checks that the package installs beside each agent framework the integrations support: builds
the wheel once, then asks pip to resolve it together with each framework (`pip install --dry-run
--ignore-installed --report`, against the package index; nothing is installed). Both the core (the
in-process engine and the client) and the core with the proxy's extra must resolve; the server's
extra (jac-scale) is not required to (jac-scale 0.2.31 pins pyjwt < 2.11, Hermes 0.19.0 pins
2.13.0: docs/install.md).

    .venv/bin/python scripts/check_frameworks.py [--wheel dist/contextrender-0.1.0-py3-none-any.whl]

Prints one line per pair with the versions pip chose, and exits 1 if any pair does not resolve.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The frameworks docs/integrations.md supports, at the releases its recipes were tested with;
# openai-agents unpinned: the newest release that resolves beside the core is what users get.
FRAMEWORKS = ("hermes-agent==0.19.0", "langchain==1.5.0", "openai-agents")
EXTRAS = ("", "[proxy]")
SHOWN = ("openai", "litellm", "pydantic", "httpx", "fastapi", "starlette", "pyjwt")
TIMEOUT_S = 300


def build_wheel(out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out), str(ROOT)], check=True)
    return next(out.glob("contextrender-*.whl"))


def resolve(requirements: list[str], report: Path, shown: tuple[str, ...]) -> tuple[bool, str]:
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--report", str(report), *requirements]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False, f"no answer from pip within {TIMEOUT_S} s"
    if result.returncode != 0:
        problem = [line for line in result.stderr.splitlines() if "Location 'file:" not in line]
        return False, "\n".join(problem[-12:])
    versions = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in json.loads(report.read_text())["install"]}
    return True, ", ".join(f"{name} {versions[name]}" for name in shown if name in versions)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", type=Path, help="a built wheel (default: build one into a temporary folder)")
    args = parser.parse_args()
    failed = 0
    with tempfile.TemporaryDirectory() as scratch:
        wheel = args.wheel.resolve() if args.wheel else build_wheel(Path(scratch))
        for framework in FRAMEWORKS:
            for extra in EXTRAS:
                ok, detail = resolve([f"contextrender{extra} @ {wheel.as_uri()}", framework], Path(scratch) / "report.json",
                                     (framework.split("=")[0], *SHOWN))
                failed += not ok
                print(f"{'ok  ' if ok else 'FAIL'} contextrender{extra or ''} + {framework}: {detail}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
