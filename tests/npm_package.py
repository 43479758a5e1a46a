"""The Node integrations' npm packages for tests: `npm ci` from the committed package-lock.json
(from the npm registry, once, into the package's node_modules). Without Node the tests skip on a
developer's machine and fail where `CI` is set (a CI machine without Node would otherwise test no
plugin at all; scripts/setup.sh installs it with apt where it can)."""

from __future__ import annotations

import hashlib
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


def locked_install(home: Path, parts: dict[str, Path], *, npm_args: tuple[str, ...] = (), env: dict | None = None) -> Path:
    """A program's own npm install under `home`, made once: `npm ci` in `home`/<part> from the
    package.json and package-lock.json of each `parts` folder, in order (a part "" is `home` itself).
    A stamp named by the lock files' hash marks a finished install, so a changed lock installs anew."""
    files = [folder / name for folder in parts.values() for name in ("package.json", "package-lock.json")]
    stamp = home / f".installed-{hashlib.sha1(b''.join(f.read_bytes() for f in files)).hexdigest()[:12]}"
    if stamp.exists():
        return home
    require_node("npm")
    for part, fixtures in parts.items():
        folder = home / part
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for name in ("package.json", "package-lock.json"):
            shutil.copy(fixtures / name, folder / name)
        done = subprocess.run(["npm", "ci", "--no-audit", "--no-fund", *npm_args], cwd=folder, env=env,
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"npm ci in {folder} failed:\n{done.stderr[-3000:]}"
    stamp.touch()
    return home


def run_module(script: str, payload: Any, cwd: Path | None = None) -> Any:
    """Run `script` as an ES module under Node with `payload` as JSON on stdin; what it prints, parsed."""
    done = subprocess.run(["node", "--input-type=module", "-e", script], input=json.dumps(payload),
                          capture_output=True, text=True, timeout=30, cwd=cwd)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)
