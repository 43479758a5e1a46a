"""The real OpenClaw for tests: openclaw 2026.9.6 and the Node it needs (>=24.16; the `node`
package of the npm registry, 24.21.0), each installed once with `npm ci` from the lock files in
tests/fixtures/openclaw/ into .cache/openclaw (or $CONTEXTRENDER_OPENCLAW_DIR). About 770 MB on
disk; the first install takes about 1.5 minutes, later runs reuse it. Without a Node and npm to run
npm with, the test skips (fails where `CI` is set), as the other Node tests do."""

from __future__ import annotations

import os
from pathlib import Path

from tests.npm_package import locked_install

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "openclaw"
PARTS = ("node", "gateway")  # in this order: openclaw's install scripts refuse a Node before 24.16


def node_path(home: Path) -> str:
    """PATH with the installed Node 24 first."""
    return f"{home / 'node' / 'node_modules' / '.bin'}{os.pathsep}{os.environ.get('PATH', '')}"


def openclaw_home() -> Path:
    """The install folder, made on first use; it holds node/ and gateway/."""
    home = Path(os.environ.get("CONTEXTRENDER_OPENCLAW_DIR") or ROOT / ".cache" / "openclaw")
    return locked_install(home, {part: FIXTURES / part for part in PARTS}, env=dict(os.environ, PATH=node_path(home)))


def openclaw_command(home: Path) -> list[str]:
    """The `openclaw` CLI, run by the installed Node."""
    return [str(home / "node" / "node_modules" / ".bin" / "node"), str(home / "gateway" / "node_modules" / "openclaw" / "openclaw.mjs")]
