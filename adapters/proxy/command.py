"""`contextrender proxy`: the command line that starts the proxy, on the engine in-process or on
a running server."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import Any

# Only the defaults at import: the command line is built before any command runs, and the web
# stack (FastAPI, the format layers) loads in `run`.
from contextrender.proxy.defaults import DEFAULT_RESTORE_ROUNDS, DEFAULT_SELECTOR, DEFAULT_UPSTREAM_TIMEOUT

__all__ = ["register", "run"]

log = logging.getLogger("contextrender.proxy")


def _backend(args: argparse.Namespace) -> Any:
    if args.server:
        from contextrender.client import Client

        client = Client(args.server, token=args.token or None)
        if not args.token:
            username = os.environ.get("CONTEXTRENDER_USERNAME")
            password = os.environ.get("CONTEXTRENDER_PASSWORD")
            if not (username and password):
                raise SystemExit(
                    "contextrender proxy --server needs a token: pass --token (or set CONTEXTRENDER_TOKEN), "
                    "or set CONTEXTRENDER_USERNAME and CONTEXTRENDER_PASSWORD to log in"
                )
            client.login(username, password)
        return client
    from contextrender.local import Engine

    return Engine(args.store)


def _refuse(message: str) -> int:
    """A setting the proxy cannot start with: the message on stderr, exit status 2 (as argparse)."""
    print(f"contextrender proxy: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from contextrender.core import InvalidRequest, check_budget, render_settings
    from contextrender.proxy.app import create_app

    # Checked before serving, by the engine's own rules: once serving, a bad budget or selector
    # would fail every request open (forwarded unmanaged).
    try:
        check_budget(args.budget)
        render_settings({"selector": args.selector})
    except InvalidRequest as bad:
        return _refuse(f"{bad} (--budget / --selector)")
    if args.restore_rounds < 0:
        return _refuse(f"--restore-rounds must be >= 0 (got {args.restore_rounds})")

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        backend = _backend(args)
    except ValueError as bad:  # a malformed client setting ($CONTEXTRENDER_TIMEOUT)
        return _refuse(str(bad))
    from contextrender.limits import uvicorn_settings

    try:  # the limits' settings (contextrender/limits.py), a malformed one named
        served = uvicorn_settings()
        app = create_app(backend, args.upstream, args.budget, args.selector, args.fail_closed, args.upstream_timeout,
                         args.restore_rounds, inspect=not args.no_inspector, allowed_origins=args.allow_origin or None,
                         max_body=int(args.max_body_mb * 1024 * 1024) if args.max_body_mb else None)
    except ValueError as bad:
        return _refuse(str(bad))
    where = f"server {args.server}" if args.server else f"store {os.path.abspath(args.store)}"
    log.info("proxy on http://%s:%d -> %s (budget %d, selector %s, restore rounds %d, %s)", args.host, args.port,
             args.upstream, args.budget, args.selector, args.restore_rounds, where)
    if not args.no_inspector:
        log.info("session inspector: http://127.0.0.1:%d/contextrender/ (loopback only)", args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", **served)
    return 0


def register(subparsers: Any) -> None:
    """Add `contextrender proxy` to the command line."""
    parser = subparsers.add_parser(
        "proxy",
        help="OpenAI-compatible proxy that renders each request's history within a token budget",
        # The package's summary: its docstring's first paragraph.
        description=importlib.import_module(__package__).__doc__.split("\n\n")[0],
    )
    parser.add_argument("--upstream", required=True, help="upstream base URL, as an OpenAI client takes it (e.g. https://api.openai.com/v1)")
    parser.add_argument("--budget", type=int, required=True, help="history budget B in tokens (system prompt and current user message are outside B)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--selector", default=DEFAULT_SELECTOR, help="renderer selector (default: contextrender; also full, cr-recency, ...)")
    parser.add_argument("--server", default="", help="URL of a running `jac start` ContextRender server (default: the engine in-process)")
    parser.add_argument("--token", default=os.environ.get("CONTEXTRENDER_TOKEN", ""), help="with --server: bearer token (default $CONTEXTRENDER_TOKEN)")
    parser.add_argument("--store", default=os.environ.get("CONTEXTRENDER_STORE", ".contextrender"), help="without --server: the graph store (default $CONTEXTRENDER_STORE or .contextrender)")
    parser.add_argument("--fail-closed", action="store_true", help="answer engine failures with an error instead of forwarding the original request")
    parser.add_argument("--upstream-timeout", type=float, default=None,
                        help=f"seconds the upstream may send nothing before a 504 (default $CONTEXTRENDER_UPSTREAM_TIMEOUT or {DEFAULT_UPSTREAM_TIMEOUT:g})")
    parser.add_argument("--restore-rounds", type=int, default=DEFAULT_RESTORE_ROUNDS,
                        help=f"restore rounds per request (every protocol): the model may take back omitted results with the "
                             f"tool contextrender_restore, answered by the proxy (default {DEFAULT_RESTORE_ROUNDS}; 0: never offered)")
    parser.add_argument("--no-inspector", action="store_true",
                        help="do not serve the session inspector page at /contextrender/ (served to loopback clients only)")
    parser.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                        help="a web origin (scheme://host[:port]) whose pages may call the proxy, beside the loopback "
                             "(repeatable; default $CONTEXTRENDER_ALLOWED_ORIGINS; any other Origin gets 403)")
    parser.add_argument("--max-body-mb", type=float, default=None,
                        help="the largest request body, in MB (default $CONTEXTRENDER_MAX_BODY_MB or 32; larger gets 413)")
    parser.set_defaults(func=run)
