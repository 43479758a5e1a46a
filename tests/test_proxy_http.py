"""The proxy's HTTP side made lighter (docs/performance.md, "The proxy's CPU per request, the HTTP
side again"): conversation requests served without FastAPI's route machinery, upstream calls made
through the client's transport, upstream URLs parsed once; each with what must not change."""

from __future__ import annotations

import asyncio
import base64
import logging
from types import SimpleNamespace

import httpx

from contextrender.proxy import create_app
from contextrender.proxy.app import Conversations
from contextrender.proxy.upstream import Upstream
from contextrender.testing.fake_upstream import LoopbackServer

BODY = {"model": "fake-model", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]}


class KeepAll:
    """A backend that renders the history as it is and stores nothing."""

    def render(self, session_id, messages, *, budget, selector="", **params):
        return SimpleNamespace(messages=messages, full_history_tokens=10, history_tokens=10, kept=0, omitted=0,
                               folded_messages=0, compacted=0, mode="stable")

    def ingest(self, session_id, messages, **options):
        return SimpleNamespace(events=len(messages))

    def get_session(self, session_id):
        return {"events": 0, "config": {}}

    def create_session(self, session_id, *, name=""):
        return {}

    def configure(self, session_id, **params):
        return {}


def test_a_conversation_request_is_served_without_fastapis_route_machinery(upstream):
    async def refused(scope, receive, send):
        raise AssertionError("FastAPI's route ran for a conversation request")

    app = create_app(KeepAll(), upstream.base_url, 600)
    routes = [r for r in app.routes if getattr(r, "path", "") == "/v1/chat/completions"]
    assert routes
    for route in routes:
        route.app = refused
    upstream.enqueue("Hello.")
    with LoopbackServer(app) as server:
        answer = httpx.post(f"{server.url}/v1/chat/completions", json=BODY, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "Hello."
    assert answer.headers["x-contextrender-status"] == "managed"


def test_other_requests_and_requests_under_a_root_path_go_on_to_the_routes():
    seen = []

    async def routes(scope, receive, send):
        seen.append((scope["method"], scope["path"]))

    dispatch = Conversations(routes, proxy=None)
    for (method, root) in (("GET", ""), ("POST", "/under"), ("PUT", "")):
        scope = {"type": "http", "method": method, "path": "/v1/chat/completions", "root_path": root, "headers": []}
        asyncio.run(dispatch(scope, None, None))
    asyncio.run(dispatch({"type": "http", "method": "POST", "path": "/v1/models", "root_path": "", "headers": []}, None, None))
    assert seen == [("GET", "/v1/chat/completions"), ("POST", "/v1/chat/completions"), ("PUT", "/v1/chat/completions"),
                    ("POST", "/v1/models")]


def test_upstream_calls_go_through_the_transport_with_httpxs_log_line(upstream, monkeypatch, caplog):
    async def refused(*args, **kwargs):
        raise AssertionError("AsyncClient.send was called")

    monkeypatch.setattr(httpx.AsyncClient, "send", refused)
    upstream.enqueue("Hello.")
    with caplog.at_level(logging.INFO, logger="httpx"), LoopbackServer(create_app(KeepAll(), upstream.base_url, 600)) as server:
        answer = httpx.post(f"{server.url}/v1/chat/completions", json=BODY, timeout=30)
        other = httpx.get(f"{server.url}/v1/models", timeout=30)
    assert answer.status_code == 200, answer.text
    assert other.status_code == 200, other.text
    lines = [r.getMessage() for r in caplog.records if r.name == "httpx" and "HTTP Request: POST" in r.getMessage()]
    assert any(f"{upstream.base_url}/chat/completions" in line and '"HTTP/1.1 200 OK"' in line for line in lines), lines


def test_an_upstream_url_with_a_password_still_sends_basic_auth(upstream):
    upstream.enqueue("Hello.")
    base = upstream.base_url.replace("http://", "http://agent:secret@")
    with LoopbackServer(create_app(KeepAll(), base, 600)) as server:
        answer = httpx.post(f"{server.url}/v1/chat/completions", json=BODY, timeout=30)
    assert answer.status_code == 200, answer.text
    sent = upstream.requests[-1].headers
    assert sent.get("authorization") == "Basic " + base64.b64encode(b"agent:secret").decode()


def test_upstream_urls_are_parsed_once_per_path_and_a_query_is_kept():
    upstream = Upstream("http://127.0.0.1:9/v1/", 30)
    first = upstream.url("/v1/chat/completions", "")
    assert first is upstream.url("/v1/chat/completions", "")
    assert str(first) == "http://127.0.0.1:9/v1/chat/completions"
    assert str(upstream.url("/v1/models", "limit=2")) == "http://127.0.0.1:9/v1/models?limit=2"
    assert str(upstream.url("/other", "")) == "http://127.0.0.1:9/v1/other"
