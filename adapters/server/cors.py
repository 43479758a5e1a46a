"""The server's CORS: off unless CONTEXTRENDER_CORS_ORIGINS names the origins whose pages may call
it (comma-separated, scheme://host[:port]). jac-scale installs Starlette's CORS middleware with
every origin allowed and credentials on, which answers any page's preflight with its own origin
reflected; ContextRender replaces it. With no origins set, no CORS header is sent: a page on
another origin can neither read an answer nor send a request with a token (its preflight fails).
With origins set, only those get the headers, without credentials (the API takes bearer tokens,
never cookies), for the methods and headers the API uses."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["cors_origins", "settle_cors"]


def cors_origins() -> list[str]:
    origins = [o.strip().rstrip("/") for o in os.environ.get("CONTEXTRENDER_CORS_ORIGINS", "").split(",") if o.strip()]
    if "*" in origins:
        raise SystemExit("ContextRender refuses to start: CONTEXTRENDER_CORS_ORIGINS may not be '*'; "
                         "name the origins (scheme://host[:port]) whose pages may call the server")
    return origins


def settle_cors(user_middleware: list) -> None:
    """Replace jac-scale's CORS middleware in an app's `user_middleware` by ContextRender's (or none)."""
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware

    origins = cors_origins()
    at = [i for (i, m) in enumerate(user_middleware) if getattr(m, "cls", None) is CORSMiddleware]
    for i in reversed(at):
        del user_middleware[i]
    if origins:
        user_middleware.insert(at[0] if at else 0, Middleware(
            CORSMiddleware, allow_origins=origins, allow_credentials=False,
            allow_methods=["GET", "POST", "PUT", "DELETE", "OPTIONS"], allow_headers=["authorization", "content-type"],
            expose_headers=[], max_age=600,
        ))
