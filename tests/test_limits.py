"""adapters/limits.py: the header read timeout blames slow clients, not a stalled server."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
from contextrender.limits import uvicorn_settings
from contextrender.testing.loopback import LoopbackServer


async def _app(scope, receive, send):
    """`/block` holds the event loop (as a synchronous store wait in a handler would); others answer."""
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] == "/block":
        time.sleep(4)
    if scope["path"] == "/tail":
        # The whole body (its length declared), then the end of the response a moment later: the
        # client has its answer and sends its next request before the response is complete.
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok", "more_body": True})
        await asyncio.sleep(0.5)
        await send({"type": "http.response.body", "body": b""})
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(3)  # a call that waits (for the store's lock) longer than the header timeout
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})
    if scope["path"] == "/after":
        time.sleep(4)  # work after the answer (a commit), holding the loop


def test_a_request_sent_while_the_server_was_stalled_is_served(monkeypatch):
    """A keep-alive client sends its next request at once, while another request holds the event
    loop past the header timeout: when the loop runs again, the request is read before the timeout
    is reckoned, so the client gets its answer, not a 408 for headers it sent in time."""
    monkeypatch.setenv("CONTEXTRENDER_HEADER_TIMEOUT", "2")
    with LoopbackServer(_app, **uvicorn_settings()) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.get("/ok").status_code == 200
        blocker = threading.Thread(target=lambda: httpx.get(f"{server.url}/block", timeout=30))
        blocker.start()
        time.sleep(0.5)  # the loop is held now
        answer = client.get("/ok")
        blocker.join()
        assert answer.status_code == 200, answer.text


def test_the_next_request_of_a_connection_whose_handler_held_the_loop_is_served(monkeypatch):
    monkeypatch.setenv("CONTEXTRENDER_HEADER_TIMEOUT", "2")
    with LoopbackServer(_app, **uvicorn_settings()) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.get("/after").status_code == 200
        answer = client.get("/ok")
        assert answer.status_code == 200, answer.text


def test_a_request_that_came_before_the_previous_response_ended_is_not_timed_out(monkeypatch):
    """The previous response's end came after the next request had arrived (queued by uvicorn, then
    started by that end): the header timer armed for "the next request" timed the running one out
    with a 408 in the middle of its call (the suite's lock-holding server test, about 1 run in 3)."""
    monkeypatch.setenv("CONTEXTRENDER_HEADER_TIMEOUT", "2")
    with LoopbackServer(_app, **uvicorn_settings()) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.get("/tail").text == "ok"
        answer = client.get("/slow")
        assert answer.status_code == 200, answer.text


def test_a_client_that_sends_no_request_still_times_out(monkeypatch):
    import socket

    monkeypatch.setenv("CONTEXTRENDER_HEADER_TIMEOUT", "1")
    with LoopbackServer(_app, **uvicorn_settings()) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n")  # and never the end of its headers
            started = time.monotonic()
            answer = sock.recv(4096)
            assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - started < 5


def _parts(*messages, pause: float = 0.0):
    """An ASGI `receive` answering `messages` in turn, each after `pause` seconds."""
    queue = list(messages)

    async def receive():
        await asyncio.sleep(pause)
        return queue.pop(0)

    return receive


def _read(receive, limit=1000, timeout=5.0, headers=()):
    from contextrender.limits import read_body

    return asyncio.run(read_body({"headers": list(headers)}, receive, limit, timeout, "send less"))


def test_read_body_joins_the_parts_and_keeps_a_whole_body_as_it_came():
    one = b'{"model": "m"}' * 10
    assert _read(_parts({"type": "http.request", "body": one})) is one  # not copied
    parts = [{"type": "http.request", "body": b"ab", "more_body": True}, {"type": "http.request", "more_body": True},
             {"type": "http.request", "body": b"cd"}]
    assert _read(_parts(*parts)) == b"abcd"
    assert _read(_parts({"type": "http.request", "body": b"ab", "more_body": True}, {"type": "http.disconnect"})) is None


def test_read_body_refuses_a_body_too_large_declared_or_sent():
    from contextrender.limits import BodyRefused

    for (receive, headers) in ((_parts(), [(b"content-length", b"1001")]),
                               (_parts(*[{"type": "http.request", "body": b"x" * 400, "more_body": True}] * 3), [])):
        try:
            _read(receive, headers=headers)
        except BodyRefused as refused:
            assert (refused.status, refused.close) == (413, True) and "send less" in refused.message
        else:
            raise AssertionError("not refused")


def test_read_body_times_out_a_pause_and_a_body_that_takes_too_long_in_all():
    from contextrender.limits import BodyRefused

    more = {"type": "http.request", "body": b"x", "more_body": True}
    for (receive, timeout) in ((_parts(more, more, pause=0.3), 0.1),  # the first part later than the timeout
                               (_parts(*[more] * 40, pause=0.05), 0.1)):  # each part in time, all past ten times it
        started = time.monotonic()
        try:
            _read(receive, timeout=timeout)
        except BodyRefused as refused:
            assert refused.status == 408 and refused.close and "CONTEXTRENDER_BODY_TIMEOUT" in refused.message
        else:
            raise AssertionError("not timed out")
        assert time.monotonic() - started < 10 * timeout + 0.5
