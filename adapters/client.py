"""A typed client for the ContextRender server (`jac start contextrender.jac`).

The same methods as the in-process `Engine`, one per endpoint (adapters/endpoints.py); errors
are the same classes (`InvalidRequest`, `UnknownSession`, `HistoryConflict`, else
`ContextRenderError` with the HTTP status as `.status`), with the server's message.

    client = Client("http://127.0.0.1:8000")
    client.login("alice", "secret123")           # or Client(url, token=...)
    rendered = client.render("run-42", messages, budget=6000)
    rendered.messages, rendered.summary()

`AsyncClient` has the same calls as coroutines.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from contextrender import core
from contextrender.core import ContextRenderError, HistoryConflict, InvalidRequest, UnknownResult, UnknownSession
from contextrender.endpoints import ENDPOINTS, EndpointMethods
from contextrender.settings import positive_number

DEFAULT_URL = "http://127.0.0.1:8000"
# The server names its errors (adapters/server/app.py); a bare status, such as a 404 from a wrong URL,
# is only a ContextRenderError. `.status` keeps the HTTP status (a body too large is 413).
ERRORS_BY_CODE = {
    "INVALID_REQUEST": InvalidRequest,
    "UNKNOWN_FIELD": InvalidRequest,
    "BODY_TOO_LARGE": InvalidRequest,
    "UNKNOWN_SESSION": UnknownSession,
    "UNKNOWN_RESULT": UnknownResult,
    "HISTORY_CONFLICT": HistoryConflict,
}


# httpx logs every request at INFO ("HTTP Request: POST ..."): a program that logs at INFO (the
# proxy with --server does) would log each call to the server. Left to WARNING unless the program
# set httpx's level itself.
if logging.getLogger("httpx").level == logging.NOTSET:
    logging.getLogger("httpx").setLevel(logging.WARNING)


# Seconds a request may wait for each step (connect, send, each read of the answer), unless the
# client is given `timeout` or $CONTEXTRENDER_TIMEOUT is set: a first ingestion of thousands of
# events can take tens of seconds.
DEFAULT_TIMEOUT = 120.0


class ServerUnavailable(ConnectionError):
    """No ContextRender server answers at the client's URL: refused, unresolvable, or no answer
    within the client's timeout (a server that took the connection and hangs). The original httpx
    error is its `__cause__`."""


def _unavailable(url: Any, error: Exception) -> ServerUnavailable:
    where = f"{url.scheme}://{url.netloc.decode()}"
    if isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout)):
        return ServerUnavailable(
            f"no ContextRender server answers at {where} ({type(error).__name__}: {error}); "
            "start one with `contextrender serve`, or give the client its URL (Client(url) or $CONTEXTRENDER_URL)"
        )
    return ServerUnavailable(
        f"the ContextRender server at {where} took the request and gave no answer within the client's timeout "
        f"({type(error).__name__}); give it longer with Client(timeout=...) or $CONTEXTRENDER_TIMEOUT (seconds)"
    )


_UNANSWERED = (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout)


def _timeout(timeout: float | None) -> float:
    """`timeout`, else $CONTEXTRENDER_TIMEOUT, else DEFAULT_TIMEOUT."""
    if timeout is not None:
        return timeout
    return positive_number("CONTEXTRENDER_TIMEOUT", DEFAULT_TIMEOUT, unit="seconds")


class _Reaching(httpx.BaseTransport):
    """The client's transport: a connection that cannot be made is a ServerUnavailable."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner = inner

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return self.inner.handle_request(request)
        except _UNANSWERED as error:
            raise _unavailable(request.url, error) from error

    def close(self) -> None:
        self.inner.close()


class _AsyncReaching(httpx.AsyncBaseTransport):
    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await self.inner.handle_async_request(request)
        except _UNANSWERED as error:
            raise _unavailable(request.url, error) from error

    async def aclose(self) -> None:
        await self.inner.aclose()


def _base_url(base_url: str | None) -> str:
    return base_url or os.environ.get("CONTEXTRENDER_URL") or DEFAULT_URL


def _error(response: httpx.Response) -> ContextRenderError:
    try:
        body = response.json()
    except ValueError:
        body = {}
    code = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        code = body["error"].get("code")
        message = body["error"].get("message") or response.reason_phrase
    elif isinstance(body, dict) and "detail" in body:
        # FastAPI's request validation (wrong JSON types, malformed JSON).
        details = body["detail"] if isinstance(body["detail"], list) else [body["detail"]]
        message = "; ".join(
            f"{'.'.join(str(p) for p in d.get('loc', [])[1:]) or 'body'}: {d.get('msg')}" if isinstance(d, dict) else str(d)
            for d in details
        )
    else:
        message = response.text[:500] or response.reason_phrase
    error = ERRORS_BY_CODE.get(code, ContextRenderError)(f"HTTP {response.status_code}: {message}")
    error.status = response.status_code
    return error


def _checked(response: httpx.Response) -> httpx.Response:
    if response.status_code >= 400:
        raise _error(response)
    return response


def _report(response: httpx.Response) -> Any:
    """The walker's one report from a jac-scale response envelope."""
    reports = (_checked(response).json().get("data") or {}).get("reports") or []
    return reports[0] if reports else None


def _token(response: httpx.Response) -> str:
    return _checked(response).json()["data"]["token"]


def _credentials(username: str, password: str) -> dict:
    return {"identity": {"type": "username", "value": username}, "credential": {"type": "password", "password": password}}


def _account(username: str, password: str) -> dict:
    return {"identities": [{"type": "username", "value": username}], "credential": {"type": "password", "password": password}}


def _built(cls: type, report: dict) -> Any:
    """An instance of the engine's dataclass `cls` from a report's fields (jac-scale's own keys,
    such as `_jac_type`, and any field this version does not know are left out)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{name: value for (name, value) in report.items() if name in names})


def _typed(name: str) -> Callable[[dict], Any]:
    """How to read a report that the Engine returns as the engine type `name` (adapters/core.py)."""
    return lambda report: _built(getattr(core, name), report)


def _render_result(report: dict) -> Any:
    """A render as the Engine returns it: the engine's RenderResult, its decisions ResultDecisions."""
    result = _built(core.RenderResult, {**report, "decisions": []})
    result.decisions = [_built(core.ResultDecision, d) for d in report.get("decisions") or []]
    return result


def _reading(walker: str) -> Callable[[Any], Any]:
    """How to read an endpoint's report: as the type `Engine` returns (a RenderResult, a list of
    them, a Restoration, an IngestSummary, a RenderConfig); other values stay as sent."""
    returns = ENDPOINTS[walker].returns
    if returns == "render":
        return _render_result
    if returns == "renders":
        return lambda reports: [_render_result(r) for r in reports or []]
    types = {"restoration": "Restoration", "ingest": "IngestSummary", "config": "RenderConfig"}
    if returns in types:
        return _typed(types[returns])
    return lambda report: report


class _Connection(EndpointMethods):
    """What both clients hold: the HTTP client, the token, and the login to renew it with.
    `_call` (from `EndpointMethods`) is synchronous in `Client`, a coroutine in `AsyncClient`."""

    def __init__(self, http: Any, token: str | None) -> None:
        self.http = http
        self.token = token
        # (username, password) after a login, to renew a refused token once.
        self._password: tuple[str, str] | None = None

    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def _may_log_in_again(self, response: httpx.Response) -> bool:
        """A refused token (expired: jac-scale's last 7 days) is renewed once when the client
        logged in with a password."""
        return response.status_code == 401 and self._password is not None


class Client(_Connection):
    """Synchronous client; thread-safe (httpx.Client is)."""

    def __init__(self, base_url: str | None = None, *, token: str | None = None, timeout: float | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        """`base_url` defaults to $CONTEXTRENDER_URL, else http://127.0.0.1:8000; `timeout` (seconds for
        each step of a request) to $CONTEXTRENDER_TIMEOUT, else DEFAULT_TIMEOUT."""
        super().__init__(httpx.Client(base_url=_base_url(base_url), timeout=_timeout(timeout),
                                      transport=_Reaching(transport or httpx.HTTPTransport())), token)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def register(self, username: str, password: str) -> str:
        """Create an account and log in with it; returns the token."""
        _checked(self.http.post("/user/register", json=_account(username, password)))
        return self.login(username, password)

    def login(self, username: str, password: str) -> str:
        """Log in; later calls send the token. Returns it."""
        self.token = _token(self.http.post("/user/login", json=_credentials(username, password)))
        self._password = (username, password)
        return self.token

    def _call(self, walker: str, **fields: Any) -> Any:
        response = self.http.post(f"/walker/{walker}", json=fields, headers=self._headers())
        if self._may_log_in_again(response):
            self.login(*self._password)
            response = self.http.post(f"/walker/{walker}", json=fields, headers=self._headers())
        return _reading(walker)(_report(response))


class AsyncClient(_Connection):
    """The same client for asyncio code; every endpoint method is a coroutine."""

    def __init__(self, base_url: str | None = None, *, token: str | None = None, timeout: float | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        super().__init__(httpx.AsyncClient(base_url=_base_url(base_url), timeout=_timeout(timeout),
                                           transport=_AsyncReaching(transport or httpx.AsyncHTTPTransport())), token)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def register(self, username: str, password: str) -> str:
        _checked(await self.http.post("/user/register", json=_account(username, password)))
        return await self.login(username, password)

    async def login(self, username: str, password: str) -> str:
        self.token = _token(await self.http.post("/user/login", json=_credentials(username, password)))
        self._password = (username, password)
        return self.token

    async def _call(self, walker: str, **fields: Any) -> Any:
        response = await self.http.post(f"/walker/{walker}", json=fields, headers=self._headers())
        if self._may_log_in_again(response):
            await self.login(*self._password)
            response = await self.http.post(f"/walker/{walker}", json=fields, headers=self._headers())
        return _reading(walker)(_report(response))
