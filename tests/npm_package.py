"""The Node integrations' npm packages for tests: `npm ci` from the committed package-lock.json
(from the npm registry, once, into the package's node_modules), skipped when Node is missing
(scripts/setup.sh installs it with apt where it can)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def installed(folder: str, marker: str) -> Path:
    """integrations/<folder>, with its dependencies installed (`marker`: a package it needs)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("needs Node and npm (scripts/setup.sh installs them with apt where it can)")
    package = ROOT / "integrations" / folder
    if not (package / "node_modules" / marker / "package.json").exists():
        done = subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--ignore-scripts"], cwd=package,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"npm ci in {package} failed:\n{done.stderr[-3000:]}"
    return package
