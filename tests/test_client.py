"""The client's reading of responses, on canned HTTP answers (the server tests use a real one)."""

from __future__ import annotations

import httpx
import pytest

from contextrender.client import Client
from contextrender.core import RenderResult, ResultDecision
from contextrender import ContextRenderError, InvalidRequest, UnknownSession


def answering(status: int, body: dict | str) -> Client:
    def reply(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json=body) if isinstance(body, dict) else httpx.Response(status, text=body)

    return Client("http://server", token="t", transport=httpx.MockTransport(reply))


def test_errors_are_named_by_the_server_code_not_the_status():
    with pytest.raises(UnknownSession, match="no session 'x'"):
        answering(404, {"ok": False, "error": {"code": "UNKNOWN_SESSION", "message": "no session 'x'"}}).get_session("x")
    with pytest.raises(InvalidRequest, match="budget must be"):
        answering(400, {"ok": False, "error": {"code": "INVALID_REQUEST", "message": "budget must be >= 64"}}).render("x", budget=1)
    # A 404 from something that is not the ContextRender server (a wrong base URL).
    with pytest.raises(ContextRenderError) as failure:
        answering(404, "Not Found").list_sessions()
    assert failure.value.status == 404 and type(failure.value) is ContextRenderError


def test_validation_errors_name_the_field():
    detail = {"detail": [{"type": "int_parsing", "loc": ["body", "budget"], "msg": "Input should be a valid integer"}]}
    with pytest.raises(ContextRenderError, match="budget: Input should be a valid integer") as failure:
        answering(422, detail).render("x", budget=1)
    assert failure.value.status == 422


def test_a_render_report_becomes_the_engines_render_result():
    decision = {"_jac_type": "ResultDecision", "handle": "r1", "call_id": "c1", "position": 2, "tool_name": "read",
                "turn": 1, "age": 0, "tokens": 40, "status": "omitted", "reason": "budget", "a_later_field": 1}
    report = {"_jac_type": "RenderResult", "messages": [{"role": "user", "content": "hi"}], "history_tokens": 0,
              "selector": "prune", "decisions": [decision]}
    rendered = answering(200, {"ok": True, "data": {"reports": [report]}}).render("x", budget=100, explain=True)
    # The type Engine.render returns (contextrender.RenderResult), its decisions ResultDecisions.
    assert type(rendered) is RenderResult and rendered.messages == report["messages"]
    assert rendered.history_tokens == 0 and rendered.selector == "prune" and "_jac_type" not in rendered.summary()
    assert [type(d) for d in rendered.decisions] == [ResultDecision]
    assert (rendered.decisions[0].handle, rendered.decisions[0].status, rendered.decisions[0].tokens) == ("r1", "omitted", 40)


def test_request_faults_named_by_the_server_are_invalid_requests():
    too_large = answering(413, {"ok": False, "error": {"code": "BODY_TOO_LARGE", "message": "request body exceeds"}})
    with pytest.raises(InvalidRequest) as failure:
        too_large.ingest("x", [])
    assert failure.value.status == 413
    with pytest.raises(InvalidRequest, match="no field 'selectr'"):
        answering(400, {"ok": False, "error": {"code": "UNKNOWN_FIELD", "message": "render_context has no field 'selectr'"}}).health()


def test_the_server_url_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("CONTEXTRENDER_URL", "http://elsewhere:9999")
    assert str(Client().http.base_url) == "http://elsewhere:9999"
    assert str(Client("http://given:1").http.base_url) == "http://given:1"


def test_no_server_at_the_url_is_a_server_unavailable_naming_it():
    from contextrender.client import ServerUnavailable
    from contextrender.testing.loopback import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ServerUnavailable, match=f"no ContextRender server answers at {url}") as raised:
        Client(url).list_sessions()
    assert isinstance(raised.value.__cause__, httpx.ConnectError)


def test_a_server_that_never_answers_is_a_server_unavailable_after_the_timeout(monkeypatch):
    """A server that takes the connection and hangs: the client gives up after its timeout (its
    argument, else $CONTEXTRENDER_TIMEOUT) with a ServerUnavailable saying how to wait longer."""
    import asyncio
    import socket
    import time

    from contextrender.client import AsyncClient, ServerUnavailable

    held: list = []
    with socket.create_server(("127.0.0.1", 0)) as silent:
        silent.settimeout(5)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(ServerUnavailable, match="gave no answer within the client's timeout") as raised:
            Client(url, timeout=0.5).health()
        assert isinstance(raised.value.__cause__, httpx.ReadTimeout) and time.monotonic() - start < 5
        monkeypatch.setenv("CONTEXTRENDER_TIMEOUT", "0.5")
        assert Client(url).http.timeout.read == 0.5
        with pytest.raises(ServerUnavailable, match="CONTEXTRENDER_TIMEOUT"):
            asyncio.run(AsyncClient(url).health())
        held.append(silent.accept()[0])
    for connection in held:
        connection.close()


def test_the_timeout_setting_must_be_a_positive_number(monkeypatch):
    monkeypatch.setenv("CONTEXTRENDER_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="CONTEXTRENDER_TIMEOUT must be a positive number of seconds"):
        Client("http://127.0.0.1:1")
    monkeypatch.delenv("CONTEXTRENDER_TIMEOUT")
    assert Client("http://127.0.0.1:1").http.timeout.read == 120.0
