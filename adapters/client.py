"""A typed client for the ContextRender server (`jac start contextrender.jac`).

Same method names as the in-process `Engine`; errors are the same classes (`InvalidRequest` 400,
`UnknownSession` 404, `HistoryConflict` 409, else `ContextRenderError` with the HTTP status), with
the server's message.

    client = Client("http://127.0.0.1:8000")
    client.login("alice", "secret123")           # or Client(url, token=...)
    rendered = client.render("run-42", messages, budget=6000)
    rendered.messages, rendered.summary()
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import httpx

from contextrender_adapters.engine import ContextRenderError, HistoryConflict, InvalidRequest, UnknownSession

DEFAULT_URL = os.environ.get("CONTEXTRENDER_URL", "http://127.0.0.1:8000")
ERRORS_BY_STATUS = {400: InvalidRequest, 404: UnknownSession, 409: HistoryConflict}


@dataclass
class Rendered:
    """A render as the server reported it: the messages for the model call, the per-result
    decisions when asked for, and every summary figure (also readable as attributes)."""

    messages: list[dict]
    decisions: list[dict] = field(default_factory=list)
    info: dict = field(default_factory=dict)

    @classmethod
    def from_report(cls, report: dict) -> Rendered:
        info = {k: v for (k, v) in report.items() if k not in ("messages", "decisions") and not k.startswith("_jac")}
        return cls(messages=report.get("messages") or [], decisions=report.get("decisions") or [], info=info)

    def summary(self) -> dict:
        return dict(self.info)

    def __getattr__(self, name: str) -> Any:
        info = self.__dict__.get("info", {})
        if name in info:
            return info[name]
        raise AttributeError(name)


def _error(response: httpx.Response) -> ContextRenderError:
    try:
        body = response.json()
    except ValueError:
        body = {}
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
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
    error = ERRORS_BY_STATUS.get(response.status_code, ContextRenderError)(f"HTTP {response.status_code}: {message}")
    error.status = response.status_code
    return error


def _report(response: httpx.Response) -> Any:
    """The walker's one report from a jac-scale response envelope."""
    if response.status_code >= 400:
        raise _error(response)
    data = response.json().get("data") or {}
    reports = data.get("reports") or []
    return reports[0] if reports else None


def _credentials(username: str, password: str) -> dict:
    return {"identity": {"type": "username", "value": username}, "credential": {"type": "password", "password": password}}


def _render_body(session_id: str, messages: list[dict] | None, budget: int, selector: str, explain: bool, params: dict) -> dict:
    return {
        "session_id": session_id,
        "messages": messages or [],
        "budget": budget,
        "selector": selector,
        "params": params,
        "include_decisions": explain,
    }


class Client:
    """Synchronous client. Thread-safe (httpx.Client is)."""

    def __init__(self, base_url: str = DEFAULT_URL, *, token: str | None = None, timeout: float = 120.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.http = httpx.Client(base_url=base_url, timeout=timeout, transport=transport)
        self.token = token

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    # ---------------------------------------------------------------- accounts

    def register(self, username: str, password: str) -> str:
        """Create an account and log in with it; returns the token."""
        body = {"identities": [{"type": "username", "value": username}], "credential": {"type": "password", "password": password}}
        response = self.http.post("/user/register", json=body)
        if response.status_code >= 400:
            raise _error(response)
        return self.login(username, password)

    def login(self, username: str, password: str) -> str:
        """Log in; later calls use the token. Returns it."""
        response = self.http.post("/user/login", json=_credentials(username, password))
        if response.status_code >= 400:
            raise _error(response)
        self.token = response.json()["data"]["token"]
        return self.token

    # ---------------------------------------------------------------- endpoints

    def call(self, walker: str, body: dict) -> Any:
        """POST /walker/<walker> with `body`; returns its report."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return _report(self.http.post(f"/walker/{walker}", json=body, headers=headers))

    def ingest(self, session_id: str, messages: list[dict], *, append: bool = False) -> dict:
        return self.call("ingest_events", {"session_id": session_id, "messages": messages, "append": append})

    def render(self, session_id: str, messages: list[dict] | None = None, *, budget: int, selector: str = "",
               explain: bool = False, **params: Any) -> Rendered:
        """Ingest what is new in `messages`, then render the history within `budget` tokens."""
        return Rendered.from_report(self.call("render_context", _render_body(session_id, messages, budget, selector, explain, params)))

    def explain(self, session_id: str) -> Rendered:
        return Rendered.from_report(self.call("explain_render", {"session_id": session_id}))

    def configure(self, session_id: str, **params: Any) -> dict:
        return self.call("configure_session", {"session_id": session_id, "params": params})

    def get_session(self, session_id: str, *, include_messages: bool = False) -> dict:
        return self.call("get_session", {"session_id": session_id, "include_messages": include_messages})

    def list_sessions(self) -> list[dict]:
        return self.call("list_sessions", {})

    def delete_session(self, session_id: str) -> dict:
        return self.call("delete_session", {"session_id": session_id})

    def export_graph(self, session_id: str, *, format: str = "json", limit: int = 2000) -> dict:
        return self.call("export_graph", {"session_id": session_id, "format": format, "limit": limit})

    def health(self) -> dict:
        return self.call("health", {})


class AsyncClient:
    """The same client for asyncio code (an agent loop, the proxy)."""

    def __init__(self, base_url: str = DEFAULT_URL, *, token: str | None = None, timeout: float = 120.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.http = httpx.AsyncClient(base_url=base_url, timeout=timeout, transport=transport)
        self.token = token

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    async def login(self, username: str, password: str) -> str:
        response = await self.http.post("/user/login", json=_credentials(username, password))
        if response.status_code >= 400:
            raise _error(response)
        self.token = response.json()["data"]["token"]
        return self.token

    async def call(self, walker: str, body: dict) -> Any:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return _report(await self.http.post(f"/walker/{walker}", json=body, headers=headers))

    async def ingest(self, session_id: str, messages: list[dict], *, append: bool = False) -> dict:
        return await self.call("ingest_events", {"session_id": session_id, "messages": messages, "append": append})

    async def render(self, session_id: str, messages: list[dict] | None = None, *, budget: int, selector: str = "",
                     explain: bool = False, **params: Any) -> Rendered:
        return Rendered.from_report(await self.call("render_context", _render_body(session_id, messages, budget, selector, explain, params)))

    async def explain(self, session_id: str) -> Rendered:
        return Rendered.from_report(await self.call("explain_render", {"session_id": session_id}))
