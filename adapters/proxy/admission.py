"""What a request must be before the proxy reads it (ASGI middleware, outside the routes): from a
page of an allowed origin, if from a page at all, and with a body of bounded size that arrives in
bounded time.

- Origin: a browser names the page that sends a request in `Origin` (on every cross-origin POST,
  `text/plain` "simple" ones included). The proxy has no login and spends the agent's upstream
  key, so a request with an `Origin` is served only when that origin is on the loopback
  (`http://127.0.0.1:<port>`, `localhost`, `[::1]`) or in the allowed list (`allowed_origins`,
  `--allow-origin`, CONTEXTRENDER_ALLOWED_ORIGINS, comma-separated); anything else (another
  site, `null` from a sandboxed page or a file) gets 403 and nothing is forwarded. Agents and
  SDKs send no `Origin`.
- Body: at most `max_body` bytes (default CONTEXTRENDER_MAX_BODY_MB, the server's 32 MB): a
  declared Content-Length over it is refused at once with 413, a body that grows past it as soon
  as it does (the connection is then closed); a body that stalls gets 408 (CONTEXTRENDER_BODY_TIMEOUT,
  `limits.read_body`). The app then reads the body from memory.

Refusals are in the protocol's own error shape (the format of the path).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

from contextrender.limits import BodyRefused, body_timeout, is_loopback, max_body_bytes, read_body, replaying

__all__ = ["Admission", "allowed_origins_setting", "origin_problem"]

log = logging.getLogger("contextrender.proxy")

def allowed_origins_setting() -> list[str]:
    """CONTEXTRENDER_ALLOWED_ORIGINS: origins (scheme://host[:port]) allowed beside the loopback."""
    return [o.strip() for o in os.environ.get("CONTEXTRENDER_ALLOWED_ORIGINS", "").split(",") if o.strip()]


def _normal(origin: str) -> str:
    return origin.strip().rstrip("/").lower()


def _loopback_origin(origin: str) -> bool:
    try:
        parts = urlsplit(origin)
        host = (parts.hostname or "").lower()
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not host:
        return False
    return is_loopback(host)


def origin_problem(origin: str | None, allowed: Iterable[str]) -> str:
    """Why a request with this `Origin` header is refused ("" when it is not)."""
    if origin is None:
        return ""
    if _loopback_origin(origin) or _normal(origin) in {_normal(o) for o in allowed}:
        return ""
    return (f"ContextRender proxy: requests from web pages are served only from the loopback or an allowed origin "
            f"(got Origin: {origin[:200]!r}); start the proxy with --allow-origin {origin[:200]} if that page may use it")


class Admission:
    """ASGI middleware: the Origin rule, then the body read whole within its limits and handed to
    the app from memory. `fmt_of(path)` gives the format whose error shape a refusal takes."""

    def __init__(self, app: Any, fmt_of: Any, allowed_origins: Iterable[str] = (), max_body: int | None = None,
                 timeout: float | None = None) -> None:
        self.app = app
        self.fmt_of = fmt_of
        self.allowed = [_normal(o) for o in allowed_origins]
        self.limit = max_body_bytes() if max_body is None else max_body
        self.timeout = body_timeout() if timeout is None else timeout

    async def refuse(self, scope: dict, send: Any, status: int, message: str, close: bool = False) -> None:
        kind = {403: "permission_error", 408: "request_timeout", 413: "request_too_large"}.get(status, "invalid_request_error")
        body = json.dumps(self.fmt_of(scope["path"]).error(status, message, kind), ensure_ascii=False).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers + ([(b"connection", b"close")] if close else [])})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        origin = dict(scope.get("headers") or []).get(b"origin")
        problem = origin_problem(origin.decode("latin-1") if origin is not None else None, self.allowed)
        if problem:
            log.warning("refused %s %s from Origin %r", scope.get("method"), scope["path"], origin.decode("latin-1")[:200])
            await self.refuse(scope, send, 403, problem)
            return
        try:
            body = await read_body(scope, receive, self.limit, self.timeout,
                                   "the proxy reads at most CONTEXTRENDER_MAX_BODY_MB (or --max-body-mb) per request")
        except BodyRefused as refused:
            log.warning("refused %s %s: %s", scope.get("method"), scope["path"], refused.message)
            await self.refuse(scope, send, refused.status, f"ContextRender proxy: {refused.message}", refused.close)
            return
        if body is None:
            return  # the client left before its body was complete: nobody reads an answer
        await self.app(scope, replaying({"type": "http.request", "body": body, "more_body": False}, receive), send)
