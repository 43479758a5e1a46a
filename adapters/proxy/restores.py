"""Restore rounds, their I/O, for every protocol: the request goes upstream with the restore tool
offered, the proxy answers the model's restore calls from the store and asks again (up to the
proxy's `restore_rounds`), and the agent gets the one answer that is its own, whole or streamed
(docs/protocols.md). How an answer is read, and the turns of a round, are the protocol's
`Rounds`: `restore_loop.py` (chat completions), `anthropic_restore.py` (Messages),
`responses_restore.py` (Responses)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from contextrender.core import get_tokenizer
from contextrender.proxy.interfaces import Backend, RestoreProtocol, field
from contextrender.proxy.rounds import add_usage
from contextrender.tools import tool_error
from contextrender.proxy.relay import Pending, cut_message, raw, streaming
from contextrender.proxy.sessions import Sessions
from contextrender.proxy.upstream import Upstream, error, unless_gone

__all__ = ["RESTORE_ROUNDS_HEADER", "RESTORE_USAGE_HEADER", "Restores", "RequestRounds", "encoded_body", "first_body"]

log = logging.getLogger("contextrender.proxy")

# Response headers: the restore rounds taken before the response started, and their usage.
RESTORE_ROUNDS_HEADER = "x-contextrender-restore-rounds"
RESTORE_USAGE_HEADER = "x-contextrender-restore-usage"

OnAnswer = Callable[..., BackgroundTask | None]


class RequestRounds:
    """The restore rounds of one agent request: the messages they add upstream, their usage as the
    upstream reported it (for the headers), and every call's usage as the session records it, with
    the proxy's estimate of the inputs of the calls after the first."""

    def __init__(self, estimate: int, encoding: str, first: bytes | None = None) -> None:
        self.count = 0
        # The first upstream call's body, encoded where the request was rendered (`first_body`):
        # the rendered body is encoded once, not once for its nesting check and again to send it.
        self.first = first
        self.messages: list[dict] = []
        self.usage: dict[str, int] = {}
        self.reported: dict[str, int] = {}
        self.estimate = estimate
        self.extra_estimate = 0
        self.encoding = encoding

    def called(self, protocol: RestoreProtocol) -> None:
        """One more upstream call: after the first, its input is the first's plus the rounds
        (counted in the engine's normal form)."""
        if self.messages:
            self.extra_estimate += self.estimate + get_tokenizer(self.encoding).history_tokens(protocol.normal(self.messages))

    def answered(self, usage: dict) -> None:
        """A call's usage as the session records it (summed over the request's calls)."""
        for (key, value) in usage.items():
            self.reported[key] = self.reported.get(key, 0) + value

    def headers(self) -> list[tuple[str, str]]:
        out = [(RESTORE_ROUNDS_HEADER, str(self.count))]
        if self.usage:
            out.append((RESTORE_USAGE_HEADER, json.dumps(self.usage, separators=(",", ":"))))
        return out


def first_body(body: dict, protocol: RestoreProtocol, kept: dict | None = None) -> bytes:
    """The body of a request's first upstream call: the rendered `body` with the restore tool
    offered and no rounds yet (RecursionError when it is nested too deeply to encode); `kept` as
    `encoded_body`'s."""
    return encoded_body(protocol.payload(body, True, []), kept)


def _encoded(payload: dict) -> bytes:
    return json.dumps(payload, ensure_ascii=False).encode()


# json.dumps(value, ensure_ascii=False) without a new encoder made at each call.
_ENCODE = json.JSONEncoder(ensure_ascii=False).encode


def encoded_body(payload: dict, kept: dict | None) -> bytes:
    """`payload` as `json.dumps(payload, ensure_ascii=False).encode()` writes it, its top-level
    lists item by item: an item that is the very object a session's last body held (`kept`: id ->
    (the item, its text), the last call's, replaced here by this body's) takes the text it was
    encoded to then. Exact because the proxy never changes a message it sent or was given, nor
    anything in a body it parsed (interfaces.sent_unchanged; tests/test_proxy_bodies.py test_5),
    and an in-process engine hands it the index's own messages: on the peer bench about half of a
    chat body's history items are the last body's objects, and the body is encoded in 0.30 ms
    against 0.38 (docs/performance.md, issue 30's fifth round). Without `kept`, json.dumps."""
    if kept is None:
        return _encoded(payload)
    items: dict[int, tuple[Any, str]] = {}
    fields = []
    for (key, value) in payload.items():
        if type(value) is list:
            texts = []
            for item in value:
                known = kept.get(id(item))
                text = known[1] if known is not None and known[0] is item else _ENCODE(item)
                items[id(item)] = (item, text)
                texts.append(text)
            text = "[" + ", ".join(texts) + "]"
        else:
            text = _ENCODE(value)
        fields.append(_ENCODE(key) + ": " + text)
    kept.clear()
    kept.update(items)
    return ("{" + ", ".join(fields) + "}").encode()


class Restores:
    """Forwards requests that offer the restore tool, and answers their rounds."""

    def __init__(self, upstream: Upstream, sessions: Sessions, backend: Backend, limit: int) -> None:
        self.upstream = upstream
        self.sessions = sessions
        self.backend = backend
        self.limit = limit
        self.metrics: Any = None  # the proxy's ProxyMetrics (restores counted by outcome)

    async def forward(
        self, request: Request, body: dict, session_id: str, on_answer: OnAnswer,
        headers: Sequence[tuple[str, str]], rounds: RequestRounds, protocol: RestoreProtocol,
    ) -> Response:
        """Forward `body` with the restore tool offered, answer the restore rounds the model asks
        for, and return the one answer that is the agent's. Until the response starts, a client
        that leaves cancels the upstream call."""
        # The proxy reads every answer (and may withhold frames): it asks for it uncompressed.
        sent = self.upstream.request_headers(request, identity=True)
        url = self.upstream.url(request.url.path, request.url.query)
        whole = self._stream if body.get("stream") else self._whole
        return await self.upstream.watched(
            request, lambda gone: whole(url, sent, body, session_id, on_answer, list(headers), rounds, protocol, gone),
            f"client left during a restore round of session {session_id}",
        )

    def count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.of(self.metrics.restores, outcome).inc()

    @staticmethod
    def _request(url: httpx.URL, sent: list, body: dict, offered: bool, rounds: RequestRounds, protocol: RestoreProtocol) -> httpx.Request:
        rounds.called(protocol)
        (content, rounds.first) = (rounds.first, None)
        if content is None or not offered or rounds.messages:
            content = _encoded(protocol.payload(body, offered, rounds.messages))
        return httpx.Request("POST", url, headers=sent, content=content)

    async def _answer_round(self, session_id: str, calls: Any, rounds: RequestRounds, protocol: RestoreProtocol) -> None:
        """Answer each restore call from the store (a tool error when it cannot be: the model goes
        on without it) and add the round to the next upstream request. A call with a `query`
        gets the best matching handles, one line each (a search writes nothing)."""
        contents: list[tuple[Any, bool]] = []
        state = self.sessions.session(session_id)
        async with state.lock:  # a restore writes its edge: one writer per session
            for call in calls.restore_calls:
                handle = ""
                try:
                    (kind, handle) = protocol.ask(call)
                    if kind == "query":
                        found = await run_in_threadpool(self.backend.search_results, session_id, handle)
                        contents.append((field(found, "text"), False))
                        self.count("searched")
                        continue
                    restored = await run_in_threadpool(self.backend.restore, session_id, handle)
                    contents.append((field(restored, "message").get("content"), False))
                    self.count("restored")
                except Exception as exc:  # noqa: BLE001 - the model gets the error as the tool's answer
                    log.info("session %s: restore of %r refused: %s", session_id, handle, exc)
                    contents.append((tool_error(handle, str(exc)), True))
                    self.count("refused")
        rounds.messages.extend(protocol.round_turns(calls, contents))
        rounds.count += 1

    async def _whole(
        self, url: httpx.URL, sent: list, body: dict, session_id: str, on_answer: OnAnswer,
        headers: list, rounds: RequestRounds, protocol: RestoreProtocol, gone: asyncio.Future,
    ) -> Response:
        fmt = protocol.fmt
        while True:
            offered = rounds.count < self.limit
            try:
                response = await unless_gone(gone, self.upstream.send(self._request(url, sent, body, offered, rounds, protocol)))
            except httpx.HTTPError as exc:
                return self.upstream.failed(exc, fmt, headers + rounds.headers())
            answer = response.content  # decoded: the agent gets it without content-encoding
            out_headers = self.upstream.response_headers(response, decoded=True)
            (message, usage) = fmt.answer(answer) if response.status_code == 200 else (None, {})
            rounds.answered(usage)
            calls = protocol.split(answer) if message else None
            if calls is not None and offered and calls.restore_first:
                await self._answer_round(session_id, calls, rounds, protocol)
                with contextlib.suppress(ValueError, AttributeError):
                    add_usage(rounds.usage, json.loads(answer).get("usage"))
                continue
            if calls is not None and calls.restore_calls:
                answer = protocol.strip(answer) or answer
                message = fmt.answer(answer)[0]
            task = on_answer(message, rounds.reported, rounds.extra_estimate) if response.status_code == 200 else None
            plain = Response(answer, status_code=response.status_code, background=task)
            plain.raw_headers = raw(out_headers + headers + rounds.headers()) + [(b"content-length", str(len(answer)).encode())]
            return plain

    async def _stream(
        self, url: httpx.URL, sent: list, body: dict, session_id: str, on_answer: OnAnswer,
        headers: list, rounds: RequestRounds, protocol: RestoreProtocol, gone: asyncio.Future,
    ) -> Response:
        fmt = protocol.fmt
        seen = fmt.reader()  # what the agent received, rebuilt: the answer the session stores
        pending = Pending()
        upstream = self.upstream
        carry: dict = {}  # what the agent was sent already, shared by the answers of the request
        recorded = False

        def record(reader: Any) -> None:
            # As the relay does (relay.py): the answer is recorded once the protocol's final event
            # is read, before it is relayed, so an agent that closes the connection at that event
            # while the upstream's body has not ended does not lose it. Only the agent's answer
            # reaches `seen`: a restore round's frames are held back.
            nonlocal recorded
            if not recorded:
                recorded = True
                rounds.answered(protocol.session_usage(reader.usage))
                pending.add(on_answer(seen.answer(), rounds.reported, rounds.extra_estimate))

        def relayed(frame: bytes, reader: Any) -> bytes:
            seen.feed(frame)
            if seen.done:
                record(reader)
            return frame

        async def run() -> AsyncIterator[Any]:
            # Yields the response's start (status, headers) once, right before its first bytes,
            # or instead of it the whole error response.
            started = False
            while True:
                offered = rounds.count < self.limit
                try:
                    response = await upstream.send(self._request(url, sent, body, offered, rounds, protocol), stream=True)
                except httpx.HTTPError as exc:
                    if not started:
                        yield upstream.failed(exc, fmt, headers + rounds.headers())
                    else:
                        yield fmt.stream_error(f"upstream {upstream.base} failed during a restore round: {exc}")
                    return
                out_headers = upstream.response_headers(response, decoded=True)
                reader = protocol.stream(offered, carry)
                # Whether this round's stream reached its final event ([DONE], message_stop, response.completed).
                ending = fmt.reader()
                try:
                    if response.status_code != 200:
                        failed = await response.aread()
                        if not started:
                            yield (response.status_code, out_headers)
                            yield failed
                        else:
                            yield fmt.stream_error(f"upstream answered {response.status_code} during a restore round: "
                                                        f"{failed[:500].decode('utf-8', 'replace')}")
                        return
                    async for chunk in response.aiter_bytes():
                        ending.feed(chunk)
                        for frame in reader.feed(chunk):
                            if not started:
                                started = True
                                yield (200, out_headers)
                            yield relayed(frame, reader)
                    ending.feed(b"\n\n")
                    if not ending.done:
                        # The body ended before the protocol's final event: a cut answer (or round)
                        # is a failure, and the round reader's closing frames are not sent.
                        message = cut_message(upstream.base, None)
                        log.warning("%s", message)
                        yield (error(fmt, 502, f"ContextRender proxy: {message}", "upstream_error") if not started
                               else fmt.stream_error(message))
                        return
                    for frame in reader.close():
                        if not started:
                            started = True
                            yield (200, out_headers)
                        yield relayed(frame, reader)
                except httpx.HTTPError as exc:  # the upstream's answer ended early, or it fell silent
                    if ending.done:
                        pass  # cut after its final event: the answer is whole
                    elif not started:
                        yield upstream.failed(exc, fmt, cut=True)
                        return
                    else:
                        message = cut_message(upstream.base, exc)
                        log.warning("%s", message)
                        yield fmt.stream_error(message)
                        return
                finally:
                    await response.aclose()
                if recorded:  # the agent's answer, recorded at its final event
                    return
                if reader.restore_round:
                    rounds.answered(protocol.session_usage(reader.usage))
                    await self._answer_round(session_id, reader.answer(), rounds, protocol)
                    add_usage(rounds.usage, reader.usage)
                    continue
                if not started:
                    yield (200, out_headers)
                seen.feed(b"\n\n")  # a final event the body ended without its blank line
                if seen.done:
                    record(reader)
                return

        stream = run()
        start = await unless_gone(gone, stream.__anext__())
        if isinstance(start, Response):
            return start
        (status, out_headers) = start
        return streaming(stream, status, out_headers + headers + rounds.headers(), pending)
