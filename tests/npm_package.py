"""The Node integrations' npm packages for tests: `npm ci` from the committed package-lock.json
(from the npm registry, once, into the package's node_modules). Without Node the tests skip on a
developer's machine and fail where `CI` is set (a CI machine without Node would otherwise test no
plugin at all; scripts/setup.sh installs it with apt where it can)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def require_node(*tools: str) -> None:
    """Skip (fail with `CI` set) unless `node` and the other `tools` are on PATH."""
    missing = [t for t in ("node", *tools) if shutil.which(t) is None]
    if not missing:
        return
    why = f"needs {' and '.join(missing)} (scripts/setup.sh installs Node.js and npm with apt where it can)"
    if os.environ.get("CI"):
        pytest.fail(f"CI is set and this test {why}")
    pytest.skip(why)


def installed(folder: str, marker: str) -> Path:
    """integrations/<folder>, with its dependencies installed (`marker`: a package it needs)."""
    require_node("npm")
    package = ROOT / "integrations" / folder
    if not (package / "node_modules" / marker / "package.json").exists():
        done = subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--ignore-scripts"], cwd=package,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"npm ci in {package} failed:\n{done.stderr[-3000:]}"
    return package


def run_module(script: str, payload: Any, cwd: Path | None = None) -> Any:
    """Run `script` as an ES module under Node with `payload` as JSON on stdin; what it prints, parsed."""
    done = subprocess.run(["node", "--input-type=module", "-e", script], input=json.dumps(payload),
                          capture_output=True, text=True, timeout=30, cwd=cwd)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)
