"""Checks that the package installs beside each agent framework the integrations support: builds
the wheel once, then asks pip to resolve each integration's extra (`contextrender[hermes]`,
`[langchain]`, `[openai-agents]`: the framework at the release its recipe was tested with), alone
and with the proxy's extra, and the core beside the newest openai-agents (`pip install --dry-run
--ignore-installed --report`, against the package index; nothing is installed). The server's extra
(jac-scale) is not required to go beside them (jac-scale 0.2.31 pins pyjwt < 2.11, Hermes 0.19.0
pins 2.13.0: docs/install.md).

    .venv/bin/python scripts/check_frameworks.py [--wheel dist/contextrender-0.1.0-py3-none-any.whl]

Prints one line per check with the versions pip chose, and exits 1 if any does not resolve.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (extras, a framework beside them, the framework's name shown). The integrations' extras pin the
# frameworks docs/integrations.md supports; openai-agents unpinned beside the core: the newest
# release is what a user gets who installs it beside the core without the extra.
CHECKS = [
    *((f"{framework}{proxy}", "", name) for framework, name in
      (("hermes", "hermes-agent"), ("langchain", "langchain"), ("openai-agents", "openai-agents"))
      for proxy in ("", ",proxy")),
    *((extra, "openai-agents", "openai-agents") for extra in ("", "proxy")),
]
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
    if shown[0] not in versions:  # pip only warns about an extra the wheel does not declare
        return False, f"{shown[0]} is not in what pip chose (is the extra in the wheel's metadata?)"
    return True, ", ".join(f"{name} {versions[name]}" for name in shown if name in versions)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", type=Path, help="a built wheel (default: build one into a temporary folder)")
    args = parser.parse_args()
    failed = 0
    with tempfile.TemporaryDirectory() as scratch:
        wheel = args.wheel.resolve() if args.wheel else build_wheel(Path(scratch))
        for extras, beside, name in CHECKS:
            package = f"contextrender[{extras}]" if extras else "contextrender"
            ok, detail = resolve([f"{package} @ {wheel.as_uri()}", *([beside] if beside else [])], Path(scratch) / "report.json",
                                 (name, *SHOWN))
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {package}{f' + {beside}' if beside else ''}: {detail}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
