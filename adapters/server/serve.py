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
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["banner", "register", "run", "prepare"]

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


# jac start's own start lines that are not true or not useful here: its banner (ours replaces it,
# printed once the port answers), the admin and scheduler features ContextRender leaves off, the
# routes it registers and then does not serve (adapters/server/app.py). --verbose shows them.
_NOT_SHOWN = re.compile(
    r"Admin portal is disabled|endpoints? registered: /admin|JAC DEV SERVER|➜|Server ready|"
    r"Webhook API keys are stored in memory|No emailer provider|scheduler subsystem|Scheduler subsystem|"
    r"APScheduler not installed|No static scheduled tasks", re.IGNORECASE)
_MOVED = re.compile(r"Port (\d+) is in use, using port (\d+) instead")
PROGRESS_EVERY = 10.0  # seconds between the start's progress lines


def _say(line: str) -> None:
    print(f"contextrender serve: {line}", file=sys.stderr, flush=True)


def banner(url: str, store: Path) -> list[str]:
    """What the start prints once the port answers: where, how to log in, the inspector, how to stop."""
    register = '{"identities": [{"type": "username", "value": "alice"}], "credential": {"type": "password", "password": "a-long-password"}}'
    login = '{"identity": {"type": "username", "value": "alice"}, "credential": {"type": "password", "password": "a-long-password"}}'
    return [
        f"ready on {url}/ (store {store}, SQLite under .jac/data)",
        f"  register once: curl -X POST {url}/user/register -H 'Content-Type: application/json' -d '{register}'",
        f"  log in:        curl -X POST {url}/user/login -H 'Content-Type: application/json' -d '{login}'",
        "                 (its data.token goes in Authorization: Bearer <token>; endpoints: docs/server-and-security.md)",
        f"  inspector:     {url}/contextrender/",
        "  stop:          Ctrl-C (or kill the process)",
    ]


def _answers(url: str) -> bool:
    """Whether the server answers its health walker (open without a login)."""
    request = urllib.request.Request(f"{url}/walker/health", data=b"{}", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status == 200
    except (OSError, ValueError):
        return False


def _relay(child: subprocess.Popen, verbose: bool, moved: list[str]) -> None:
    """Copies the child's output to ours (without the lines _NOT_SHOWN names, unless verbose),
    noting a port it moved to."""
    for line in child.stdout:
        if (found := _MOVED.search(line)) is not None:
            moved.append(found.group(1))
            continue
        if verbose or not (_NOT_SHOWN.search(line) or not line.strip()):
            sys.stderr.write(line)
            sys.stderr.flush()


def run(args: argparse.Namespace) -> int:
    from contextrender.start_checks import Refused, check_store, port_is_free
    from contextrender.testing.loopback import stop_process

    if importlib.util.find_spec("jac_scale") is None:
        print('contextrender serve: error: the server needs jac-scale: pip install "contextrender[server]"', file=sys.stderr)
        return 2
    host = os.environ.get("CONTEXTRENDER_HOST") or "127.0.0.1"
    try:
        store = check_store(args.store)
        port_is_free(host, args.port)
    except Refused as bad:
        print(f"contextrender serve: error: {bad}", file=sys.stderr)
        return 2
    env = prepare(store)
    command = [sys.executable, "-m", "jaclang", "start", ENTRY, "--no_client", "-p", str(args.port)]
    # The URL that answers: a server on every interface answers on loopback too.
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{args.port}"
    _say(f"starting jac start on {url} (store {store}); the first start from a checkout compiles the Jac modules, "
         "once (a minute or more; a wheel carries them compiled)")
    started = time.monotonic()
    child = subprocess.Popen(command, cwd=store, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1)
    moved: list[str] = []
    relay = threading.Thread(target=_relay, args=(child, args.verbose, moved), daemon=True)
    relay.start()
    # A stop (SIGTERM, or Ctrl-C where only this process got it) goes to the server, which drains.
    signal.signal(signal.SIGTERM, lambda *_: child.terminate())
    try:
        next_progress = started + PROGRESS_EVERY
        while True:
            if moved:  # (what answers on the port then is another server)
                stop_process(child)
                _say(f"error: port {args.port} on {host} was taken while the server started: choose another with "
                     "--port N (or $PORT), or stop what listens there")
                return 2
            if child.poll() is not None:
                relay.join(timeout=5)
                _say(f"error: jac start exited with status {child.returncode} before it answered (its lines are above; "
                     "--verbose shows every one)")
                return child.returncode or 1
            if _answers(url):
                relay.join(timeout=0.2)  # a line about a moved port, if the child wrote one
                if not moved:
                    break
                continue
            if time.monotonic() >= next_progress:
                _say(f"starting: loading the Jac modules and the models, {time.monotonic() - started:.0f} s")
                next_progress += PROGRESS_EVERY
            time.sleep(0.5)
        for line in banner(url, store):
            _say(line)
        return child.wait()
    except KeyboardInterrupt:
        _say("stopping")
        stop_process(child)
        return 0


def register(subparsers: Any) -> None:
    """Add `contextrender serve` to the command line."""
    parser = subparsers.add_parser("serve", help="the ContextRender server (jac start) on the embedded store",
                                   description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")), help="port (default $PORT or 8000)")
    parser.add_argument("--store", default=os.environ.get("CONTEXTRENDER_STORE", ".contextrender"),
                        help="the store folder (default $CONTEXTRENDER_STORE or .contextrender)")
    parser.add_argument("--verbose", action="store_true",
                        help="show every start line of jac start (its banner, the admin and scheduler features left off)")
    parser.set_defaults(func=run)
