"""`contextrender serve`: the ContextRender server (`jac start`, jac-scale) on the embedded store.

The store is a folder (default $CONTEXTRENDER_STORE or .contextrender): the server's SQLite store
goes under its .jac/data, its JWT secret, generated once when $CONTEXTRENDER_JWT_SECRET is unset,
in its .jac/jwt_secret (owner-only), so tokens stay valid across restarts. The entry module
(contextrender.jac) and jac.toml are copied there at each start (jac start serves the folder
it runs in); the walkers they import come from the installed package. It listens on
$CONTEXTRENDER_HOST or 127.0.0.1 (docs/server-and-security.md). Needs the `server` extra.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import secrets
import shutil
import sys
from pathlib import Path
from typing import Any

__all__ = ["register", "run", "prepare"]

ENTRY = "contextrender.jac"
PROJECT_FILES = (ENTRY, "jac.toml")


def _secret(store: Path) -> str:
    """The kept secret of this store, made (48 random bytes, url-safe) on first use."""
    path = store / ".jac" / "jwt_secret"
    if not (path.is_file() and path.read_text().strip()):
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as f:
            f.write(secrets.token_urlsafe(48) + "\n")
    return path.read_text().strip()


def prepare(store: Path) -> dict[str, str]:
    """Lay out `store` for `jac start` and return the environment to start it with."""
    from contextrender.jaclang_setup import JAC_ROOT

    store.mkdir(parents=True, exist_ok=True)
    for name in PROJECT_FILES:
        source, target = JAC_ROOT / name, store / name
        if not (target.exists() and target.samefile(source)):
            shutil.copyfile(source, target)
    env = dict(os.environ)
    env.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    env.setdefault("CONTEXTRENDER_HOST", "127.0.0.1")
    if not env.get("CONTEXTRENDER_JWT_SECRET"):
        env["CONTEXTRENDER_JWT_SECRET"] = _secret(store)
    return env


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("jac_scale") is None:
        print('contextrender serve: error: the server needs jac-scale: pip install "contextrender[server]"', file=sys.stderr)
        return 2
    if not 0 < args.port < 65536:
        print(f"contextrender serve: error: --port must be in 1-65535 (got {args.port})", file=sys.stderr)
        return 2
    store = Path(args.store).resolve()
    env = prepare(store)
    os.chdir(store)
    command = [sys.executable, "-m", "jaclang", "start", ENTRY, "--no_client", "-p", str(args.port)]
    sys.stdout.flush()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # jac start reads nothing from a terminal
    os.execve(sys.executable, command, env)
    return 0  # not reached


def register(subparsers: Any) -> None:
    """Add `contextrender serve` to the command line."""
    parser = subparsers.add_parser("serve", help="the ContextRender server (jac start) on the embedded store",
                                   description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")), help="port (default $PORT or 8000)")
    parser.add_argument("--store", default=os.environ.get("CONTEXTRENDER_STORE", ".contextrender"),
                        help="the store folder (default $CONTEXTRENDER_STORE or .contextrender)")
    parser.set_defaults(func=run)
