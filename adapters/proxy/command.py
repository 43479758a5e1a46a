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
from contextrender.proxy.defaults import DEFAULT_PORT, DEFAULT_RESTORE_ROUNDS, DEFAULT_SELECTOR, DEFAULT_UPSTREAM_TIMEOUT

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
    from contextrender import core
    from contextrender.local import Engine

    engine = Engine(args.store)
    core.serve_short_waits()  # agents side by side: Python's young threshold (engine/courtesy.jac)
    return engine


def _refuse(message: str) -> int:
    """A setting the proxy cannot start with: the message on stderr, exit status 2 (as argparse)."""
    print(f"contextrender proxy: error: {message}", file=sys.stderr)
    return 2


# The handler jaclang's `logging.basicConfig` adds when it is imported (every logger at INFO).
_JACLANG_FORMAT = "%(levelname)s - %(message)s"


def _logging(level: str) -> None:
    """The proxy's own lines (one per request at info) at `level`; other libraries' (httpx's line
    per upstream call, jaclang's, litellm's, uvicorn's) at warning, unless `level` is debug. Set
    before jaclang is imported, whose INFO set-up then finds logging configured (its handler, when
    an earlier import added it, is replaced)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if handler.formatter is not None and handler.formatter._fmt == _JACLANG_FORMAT:
            root.removeHandler(handler)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # where nothing else configured it
    root.setLevel(logging.DEBUG if level == "debug" else logging.WARNING)
    logging.getLogger("contextrender").setLevel(level.upper())


def _say(line: str) -> None:
    """A start line, at any --log-level."""
    print(f"contextrender proxy: {line}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from contextrender.start_checks import Refused, check_store, check_url, claim_port

    # What needs nothing but the standard library first: each refusal within a second.
    try:
        check_url(args.upstream, "--upstream", "https://api.openai.com/v1")
        if args.server:
            check_url(args.server, "--server", "http://127.0.0.1:8000")
        if args.restore_rounds < 0:
            raise Refused(f"--restore-rounds must be >= 0 (got {args.restore_rounds})")
        if args.upstream_timeout is not None and not args.upstream_timeout > 0:
            raise Refused(f"--upstream-timeout must be a positive number of seconds (got {args.upstream_timeout:g})")
        if not args.server:
            check_store(args.store)
        # Bound now, listening once the proxy is ready: until then a connection is refused.
        listener = claim_port(args.host, args.port)
    except Refused as bad:
        return _refuse(str(bad))
    url = f"http://{args.host}:{args.port}"
    _logging(args.log_level)

    import uvicorn

    from contextrender.core import InvalidRequest, check_budget, render_settings
    from contextrender.proxy.app import create_app

    # Checked before serving, by the engine's own rules: once serving, a bad budget or selector
    # would fail every request open (forwarded unmanaged).
    for (flag, check) in (("--budget", lambda: check_budget(args.budget)),
                          ("--selector", lambda: render_settings({"selector": args.selector}))):
        try:
            check()
        except InvalidRequest as bad:
            listener.close()
            return _refuse(f"{flag}: {bad}")

    _say(f"starting on {url}: loading the engine, then listening")
    try:
        backend = _backend(args)
    except ValueError as bad:  # a malformed client setting ($CONTEXTRENDER_TIMEOUT)
        listener.close()
        return _refuse(str(bad))
    from contextrender.limits import uvicorn_settings

    try:  # the limits' settings (contextrender/limits.py), a malformed one named
        served = uvicorn_settings()
        app = create_app(backend, args.upstream, args.budget, args.selector, args.fail_closed, args.upstream_timeout,
                         args.restore_rounds, inspect=not args.no_inspector, allowed_origins=args.allow_origin or None,
                         max_body=int(args.max_body_mb * 1024 * 1024) if args.max_body_mb else None)
    except ValueError as bad:
        listener.close()
        return _refuse(str(bad))
    where = f"server {args.server}" if args.server else f"store {os.path.abspath(args.store)}"

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:  # listening: what follows is true now
                _say(f"ready on {url}/v1 -> {args.upstream} (budget {args.budget}, selector {args.selector}, "
                    f"restore rounds {args.restore_rounds}, {where})")
                if not args.no_inspector:
                    _say(f"session inspector: http://127.0.0.1:{args.port}/contextrender/ (loopback only)")
                _say(f"readiness: {url}/contextrender/ready; stop with Ctrl-C")

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="debug" if args.log_level == "debug" else "warning",
                            **served)
    Server(config).run(sockets=[listener])
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
    parser.add_argument("--port", type=int, default=int(os.environ.get("CONTEXTRENDER_PROXY_PORT", DEFAULT_PORT)),
                        help=f"port to listen on (default $CONTEXTRENDER_PROXY_PORT or {DEFAULT_PORT})")
    parser.add_argument("--host", default="127.0.0.1",
                        help="interface to listen on (default 127.0.0.1, this machine only; the inspector answers loopback clients only)")
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
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                        help="info (default): one line per request (session, protocol, history tokens before and after, "
                             "mode, ms); warning: problems only; debug: also other libraries' lines")
    parser.set_defaults(func=run)
