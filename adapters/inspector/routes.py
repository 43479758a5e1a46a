"""The session inspector: a page at `/contextrender/` that shows what the model saw (docs/inspector.md).

The page (static/inspector.html, inspector.js, inspector.css: plain files, no build step, nothing
fetched from elsewhere) reads three read-only endpoints, in jac-scale's answer envelope
(`{"ok": true, "data": {"reports": [value]}}`, errors `{"ok": false, "error": {"code", "message"}}`):
`list_sessions`, `inspect_session` and `export_graph`.

- On the server (`jac start`, adapters/server/app.py) it calls the server's own `POST /walker/<name>`
  with the token of the user who logged in on the page: every figure comes from that user's
  root, and another user's session is as unknown to the page as it is to that user's calls.
- On the proxy (adapters/proxy.py) the same endpoints are served under `/contextrender/walker/`
  by the proxy's backend (its Engine, or its Client of a server). The proxy has no login, so its
  inspector answers only a loopback client that named a loopback host (`Host: 127.0.0.1:8800`,
  `localhost`, `[::1]`): a proxy bound to another interface still shows its sessions only on its
  own machine, and a web page that rebinds a DNS name to 127.0.0.1 gets 403.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse
from starlette.concurrency import run_in_threadpool

from contextrender.endpoints import ENDPOINTS
from contextrender.limits import is_loopback

__all__ = ["PREFIX", "READ_ENDPOINTS", "page", "asset", "proxy_router", "server_routes"]

PREFIX = "/contextrender"
STATIC = Path(__file__).resolve().with_name("static")
ASSETS = {"inspector.js": "text/javascript", "inspector.css": "text/css"}
# The endpoints the page reads (none of them changes what the model sees).
READ_ENDPOINTS = ("list_sessions", "inspect_session", "export_graph")
# The page's own scripts and styles only, nothing from elsewhere; the graph's SVG is inline.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def page(mode: Literal["server", "proxy"]) -> HTMLResponse:
    """The inspector page; `mode` says where its endpoints are and whether it asks for a login."""
    html = (STATIC / "inspector.html").read_text().replace("{{mode}}", mode)
    return HTMLResponse(html, headers={"content-security-policy": CSP, "cache-control": "no-store"})


def asset(name: str) -> Any:
    if name not in ASSETS:
        return JSONResponse(_error("NOT_FOUND", f"no inspector file {name!r}; the page is {PREFIX}/"), status_code=404)
    return FileResponse(STATIC / name, media_type=ASSETS[name], headers={"cache-control": "no-cache"})


def _error(code: str, message: str) -> dict:
    return {"ok": False, "type": "error", "data": None, "error": {"code": code, "message": message}}


def loopback_problem(request: Request) -> str:
    """Why the proxy's inspector refuses this request ("" when it does not)."""
    client = request.client.host if request.client else ""
    if not is_loopback(client):
        return (f"the proxy's inspector answers loopback clients only (it has no login; this client is {client or 'unknown'}): "
                "open it on the proxy's machine, or through an SSH tunnel")
    named = request.headers.get("host", "")
    hostname = named.rsplit(":", 1)[0] if not named.endswith("]") else named
    if not is_loopback(hostname):
        return f"the proxy's inspector answers requests for a loopback host only (got Host: {named!r}); open http://127.0.0.1:<port>{PREFIX}/"
    return ""


def _status(exc: Exception) -> int:
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) and 400 <= status < 600 else 500


def proxy_router(backend: Any) -> APIRouter:
    """The inspector's routes on the proxy: the page, its files, and the read endpoints answered
    by `backend` (an Engine or a Client), for loopback requests only."""
    router = APIRouter()

    def refused(request: Request) -> JSONResponse | None:
        problem = loopback_problem(request)
        return JSONResponse(_error("FORBIDDEN", problem), status_code=403) if problem else None

    async def index(request: Request) -> Any:
        return refused(request) or page("proxy")

    async def bare(request: Request) -> Any:
        return refused(request) or RedirectResponse(f"{PREFIX}/")

    async def files(request: Request, name: str) -> Any:
        return refused(request) or asset(name)

    async def endpoint(request: Request, name: str) -> Any:
        if (answer := refused(request)) is not None:
            return answer
        if name not in READ_ENDPOINTS:
            return JSONResponse(_error("NOT_FOUND", f"the inspector reads only {', '.join(READ_ENDPOINTS)} (got {name!r})"), status_code=404)
        try:
            fields = await request.json() if await request.body() else {}
        except ValueError:
            return JSONResponse(_error("INVALID_JSON", "the body must be a JSON object of the endpoint's fields"), status_code=400)
        spec = ENDPOINTS[name]
        if not isinstance(fields, dict):
            return JSONResponse(_error("INVALID_REQUEST", "the body must be a JSON object of the endpoint's fields"), status_code=400)
        unknown = sorted(set(fields) - set(spec.fields))
        if unknown:
            return JSONResponse(_error("UNKNOWN_FIELD", f"{name} has no field {', '.join(map(repr, unknown))}; its fields: "
                                                        f"{', '.join(spec.fields) or 'none'}"), status_code=400)
        method = getattr(backend, spec.method)
        try:
            value = await run_in_threadpool(lambda: method(**fields))
        except TypeError as exc:  # a required field missing (session_id)
            return JSONResponse(_error("INVALID_REQUEST", f"{name}: {exc}"), status_code=400)
        except Exception as exc:  # the engine's errors carry their status; others are 500
            status = _status(exc)
            return JSONResponse(_error(type(exc).__name__, str(exc) if status < 500 else "the engine failed; see the proxy's log"),
                                status_code=status)
        return JSONResponse({"ok": True, "type": "response", "data": {"reports": [value]}, "error": None})

    router.add_api_route(PREFIX, bare, methods=["GET"], include_in_schema=False)
    router.add_api_route(f"{PREFIX}/", index, methods=["GET"], include_in_schema=False)
    router.add_api_route(PREFIX + "/{name}", files, methods=["GET"], include_in_schema=False)
    router.add_api_route(PREFIX + "/walker/{name}", endpoint, methods=["POST"], include_in_schema=False)
    return router


def server_routes() -> list[tuple[str, Any]]:
    """(path, handler) of the inspector's GET routes on the server: the page and its files. The
    page logs in with the server's `/user/login` and calls `/walker/<name>` with that token."""

    async def index() -> HTMLResponse:
        return page("server")

    async def bare() -> RedirectResponse:
        return RedirectResponse(f"{PREFIX}/")

    async def files(name: str) -> Any:
        return asset(name)

    return [("/", front_door), (PREFIX, bare), (f"{PREFIX}/", index), (PREFIX + "/{name}", files)]


async def front_door() -> JSONResponse:
    """The server's `/`: where to go from here (the inspector, the accounts, the endpoints)."""
    return JSONResponse({"ok": True, "data": {
        "service": "ContextRender server",
        "inspector": f"{PREFIX}/",
        "accounts": "POST /user/register once, POST /user/login for a token, then Authorization: Bearer <token>",
        "endpoints": "POST /walker/<name> (health needs no login)",
        "docs": "docs/server-and-security.md in the ContextRender repository",
    }})
