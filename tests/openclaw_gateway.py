"""The real OpenClaw for tests: openclaw 2026.9.6 and the Node it needs (>=24.16; the `node`
package of the npm registry, 24.21.0), each installed once with `npm ci` from the lock files in
tests/fixtures/openclaw/ into .cache/openclaw (or $CONTEXTRENDER_OPENCLAW_DIR). About 770 MB on
disk; the first install takes about 1.5 minutes, later runs reuse it. Without a Node and npm to run
npm with, the test skips (fails where `CI` is set), as the other Node tests do."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from tests.npm_package import require_node

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "openclaw"
PARTS = ("node", "gateway")  # in this order: openclaw's install scripts refuse a Node before 24.16


def lock_key() -> str:
    """What the install depends on: the two package.json and package-lock.json pairs."""
    text = b"".join((FIXTURES / part / name).read_bytes() for part in PARTS for name in ("package.json", "package-lock.json"))
    return hashlib.sha1(text).hexdigest()[:12]


def node_path(home: Path) -> str:
    """PATH with the installed Node 24 first."""
    return f"{home / 'node' / 'node_modules' / '.bin'}{os.pathsep}{os.environ.get('PATH', '')}"


def openclaw_home() -> Path:
    """The install folder, made on first use; it holds node/ and gateway/."""
    require_node("npm")
    home = Path(os.environ.get("CONTEXTRENDER_OPENCLAW_DIR") or ROOT / ".cache" / "openclaw")
    stamp = home / f".installed-{lock_key()}"
    if stamp.exists():
        return home
    env = dict(os.environ, PATH=node_path(home))
    for part in PARTS:
        folder = home / part
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for name in ("package.json", "package-lock.json"):
            shutil.copy(FIXTURES / part / name, folder / name)
        done = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=folder, env=env,
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"npm ci in {folder} failed:\n{done.stderr[-3000:]}"
    stamp.touch()
    return home


def openclaw_command(home: Path) -> list[str]:
    """The `openclaw` CLI, run by the installed Node."""
    return [str(home / "node" / "node_modules" / ".bin" / "node"), str(home / "gateway" / "node_modules" / "openclaw" / "openclaw.mjs")]
