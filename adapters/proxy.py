"""The proxy: it renders the history of every conversation request within the budget before
forwarding it upstream, and passes everything else through unchanged.

    contextrender proxy --upstream https://api.openai.com/v1 --budget 6000 --port 8800

Requests to `/v1/<path>` go to `<upstream>/<path>` (the upstream is a base URL as an OpenAI or
Anthropic client takes it, `/v1` included); other paths are appended to the upstream URL as they are.

Three protocols are managed, each by a format layer that converts its request to the engine's
message normal form (OpenAI chat-completions messages) and the rendered history back:
`POST /v1/chat/completions` (here), `POST /v1/messages` (Anthropic, `anthropic.py`) and
`POST /v1/responses` (OpenAI Responses, `responses.py`). For each, the proxy
1. names the session: the `X-ContextRender-Session` header, else a hash of the conversation's
   stable prefix (`derive_session`);
2. asks the backend (the in-process `Engine`, or a `Client` of a running server) to ingest the
   conversation and render it within the budget (`X-ContextRender-Budget` and
   `X-ContextRender-Selector` override the proxy's for one request), and forwards the request
   rebuilt around the rendered history; every other field, and every header but ContextRender's
   own, is forwarded as is;
3. returns the upstream's answer unchanged (status, headers and body bytes, streamed chunk by chunk
   when the upstream streams) with the render's summary in `X-ContextRender-*` headers;
4. ingests the answer into the session once it is complete, with the usage the upstream reported.

For chat completions, when the render omitted or compacted a result, the forwarded request also
offers the tool `contextrender_restore`: the proxy answers the model's restore calls itself from
the store and asks the upstream again, up to `restore_rounds` times, so the agent gets one
ordinary answer (`restore_loop.py` says how an answer is read; README, "Restores").

If the backend fails, the proxy logs it once per session and forwards the original request
(fail-open), unless it was created with `fail_closed=True`: then it answers with the error (the
engine's 4xx status, or 502). Every chat-completions answer says which happened in the header
`X-ContextRender-Status`: `managed`, or `unmanaged; reason=<why>`.

The upstream must answer within `upstream_timeout` seconds of silence (504 otherwise); a
non-streamed answer cut short is a 502; when the client leaves, the upstream call is cancelled.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hashlib
import json
import logging
import os
import re
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from contextrender_adapters import anthropic, core, responses, restore_loop
from contextrender_adapters.core import (
    InvalidRequest, UnknownSession, cache_bytes_setting, content_text, get_tokenizer, normal_form, same_event,
)
from contextrender_adapters.formats import openai_usage
from contextrender_adapters.streams import Decoder, StreamAnswer, body_answer

__all__ = ["Backend", "create_app", "derive_session", "register", "SESSION_HEADER", "STATUS_HEADER"]

log = logging.getLogger("contextrender.proxy")

SESSION_HEADER = "x-contextrender-session"
STATUS_HEADER = "x-contextrender-status"
# Seconds the upstream may stay silent (before its headers, or between two chunks) before a 504.
DEFAULT_UPSTREAM_TIMEOUT = 600.0
BUDGET_HEADER = "x-contextrender-budget"
SELECTOR_HEADER = "x-contextrender-selector"
# Why a conversation request was forwarded without a render (absent when it was rendered).
UNMANAGED_HEADER = "x-contextrender-unmanaged"
# ContextRender's own request headers: read by the proxy, never forwarded.
_OWN_HEADERS = "x-contextrender-"
_DIGITS = re.compile(r"\d+")
# Engine errors that are the request's fault (malformed messages, a rewrite refused, too large).
_REQUEST_FAULTS = {400, 409, 413, 422}
DEFAULT_SELECTOR = "contextrender"
# Restore rounds one agent request may take (each is one more upstream call).
DEFAULT_RESTORE_ROUNDS = 3
# Response headers: the restore rounds taken before the response started, and their usage.
RESTORE_ROUNDS_HEADER = "x-contextrender-restore-rounds"
RESTORE_USAGE_HEADER = "x-contextrender-restore-usage"
# The stored answers the proxy remembers, least recently used sessions forgotten first: this
# share of CONTEXTRENDER_INDEX_CACHE_MB (the engine's indexes hold the rest; answers are small).
STATE_SHARE = 16
# A session's state without its answers (lock, counters, its table entry).
STATE_BYTES = 600
# Hop-by-hop headers (RFC 9110 7.6.1) and the ones the HTTP layer recomputes.
_REQUEST_SKIP = {
    "host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
    "upgrade", "proxy-authorization", "proxy-connection",
}
_RESPONSE_SKIP = {"content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}


class Backend(Protocol):
    """What the proxy needs from the engine: `Engine` and `Client` both have it."""

    def render(self, session_id: str, messages: list[dict], *, budget: int, selector: str = "", **params: Any) -> Any: ...

    def ingest(self, session_id: str, messages: list[dict], *, append: bool = False, usage: dict | None = None) -> Any: ...

    def get_session(self, session_id: str) -> dict: ...

    def configure(self, session_id: str, **params: Any) -> Any: ...

    def restore(self, session_id: str, handle: str) -> Any: ...


class Exchange(Protocol):
    """One conversation request of a protocol, parsed by its format layer."""

    # The conversation in the engine's normal form (chat-completions messages), system first.
    messages: list[dict]
    model: str
    # The request's tool definitions (counted in the input estimate), or None.
    tools: Any
    # Why the request cannot be managed ("" when it can): forwarded as is, with a warning.
    unmanaged: str

    def build(self, rendered: list[dict], prepared: list[dict], previous: Any) -> tuple[dict, Any]:
        """The request body to forward, around the `rendered` history (`prepared` is the message
        list the engine was given, position for position `messages`), and what to remember
        for the session's next request (`previous` is what the last one remembered)."""
        ...


class StreamReader(Protocol):
    """Reads a streamed answer as it is relayed."""

    done: bool
    usage: dict

    def feed(self, data: bytes) -> None: ...

    def answer(self) -> dict | None:
        """The answer in normal form (None when it cannot be rebuilt)."""
        ...


class Format(Protocol):
    """A protocol's format layer."""

    def parse(self, body: dict) -> Exchange | None:
        """None: not a conversation this layer reads (forwarded as is; the upstream judges it)."""
        ...

    def answer(self, body: bytes) -> tuple[dict | None, dict]:
        """A whole (non-streamed) answer: the message in normal form, and the usage reported."""
        ...

    def reader(self) -> StreamReader: ...

    def error(self, status: int, message: str, kind: str) -> dict:
        """An error body in the protocol's shape."""
        ...


# ---------------------------------------------------------------- sessions


def derive_session(messages: list[dict]) -> str:
    """The session of a conversation that names none: a hash of its stable prefix, the leading
    system/developer messages (with every number blanked: agents put dates and times there) and
    the first user message. Every later call of the same run sends the same prefix, so it maps to
    the same session; two runs that start identically share one (send `X-ContextRender-Session`
    to keep them apart)."""
    prefix: list[list[str]] = []
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        if role in ("system", "developer"):
            prefix.append([role, _DIGITS.sub("#", content_text(message.get("content")))])
            continue
        if role == "user":
            prefix.append([role, content_text(message.get("content"))])
        break
    digest = hashlib.sha256(json.dumps(prefix, ensure_ascii=False).encode()).hexdigest()
    return f"proxy-{digest[:24]}"


# ---------------------------------------------------------------- chat completions, the format layer


class _ChatStream(StreamAnswer):
    """streams.StreamAnswer with what the format layers give: the answer in normal form and the
    usage of the last chunk (sent with `stream_options.include_usage`)."""

    @property
    def usage(self) -> dict:
        return _chat_usage(self.reported_usage)

    def answer(self) -> dict | None:
        answer = super().answer()
        return normal_form(answer) if answer else None


def _chat_usage(usage: Any) -> dict:
    return openai_usage(usage, "prompt_tokens", "completion_tokens")


class _ChatExchange:
    def __init__(self, body: dict) -> None:
        self.body = body
        self.messages: list[dict] = body["messages"]
        self.model = str(body.get("model") or "")
        self.tools = body.get("tools")
        self.unmanaged = ""

    def build(self, rendered: list[dict], prepared: list[dict], previous: Any) -> tuple[dict, Any]:
        return dict(self.body, messages=rendered), None


class _Chat:
    """The chat-completions format layer: its messages are the engine's normal form already."""

    def parse(self, body: dict) -> _ChatExchange | None:
        return _ChatExchange(body) if isinstance(body.get("messages"), list) else None

    def answer(self, body: bytes) -> tuple[dict | None, dict]:
        message = body_answer(body)
        try:
            usage = _chat_usage(json.loads(body).get("usage"))
        except (ValueError, AttributeError):
            usage = {}
        return (normal_form(message) if message else None), usage

    def reader(self) -> _ChatStream:
        return _ChatStream()

    def error(self, status: int, message: str, kind: str) -> dict:
        return {"error": {"message": message, "type": kind, "code": status}}


# ---------------------------------------------------------------- the proxy


def _raw(headers: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(k.encode("latin-1"), v.encode("latin-1")) for (k, v) in headers]


def _stream_error(message: str) -> bytes:
    """An error event inside a stream that has started (its status is sent): SDKs raise it."""
    return b"data: " + json.dumps({"error": {"message": f"ContextRender proxy: {message}", "type": "upstream_error"}}).encode() + b"\n\n"


def _field(report: Any, name: str) -> Any:
    """A field of an engine report: an object in-process, a dict from the server's client."""
    return report[name] if isinstance(report, dict) else getattr(report, name)


class _Rounds:
    """The restore rounds of one agent request: the messages they add upstream, their usage as the
    upstream reported it (for the headers), and every call's usage as the session records it, with
    the proxy's estimate of the inputs of the calls after the first."""

    def __init__(self, estimate: int, encoding: str) -> None:
        self.count = 0
        self.messages: list[dict] = []
        self.usage: dict[str, int] = {}
        self.reported: dict[str, int] = {}
        self.estimate = estimate
        self.extra_estimate = 0
        self.encoding = encoding

    def called(self) -> None:
        """One more upstream call: after the first, its input is the first's plus the rounds."""
        if self.messages:
            self.extra_estimate += self.estimate + get_tokenizer(self.encoding).history_tokens(self.messages)

    def answered(self, usage: dict) -> None:
        """A call's usage as the session records it (summed over the request's calls)."""
        for (key, value) in usage.items():
            self.reported[key] = self.reported.get(key, 0) + value

    def headers(self) -> list[tuple[str, str]]:
        out = [(RESTORE_ROUNDS_HEADER, str(self.count))]
        if self.usage:
            out.append((RESTORE_USAGE_HEADER, json.dumps(self.usage, separators=(",", ":"))))
        return out


def model_encoding(model: str) -> str:
    """The token encoding for a model family: Claude models get the `claude` estimate (o200k
    scaled, see engine.measure.SCALED_ENCODINGS), GPT-4 and GPT-3.5 cl100k, others o200k."""
    name = model.lower().rsplit("/", 1)[-1]
    if "claude" in name:
        return "claude"
    if name == "gpt-4" or name.startswith(("gpt-4-", "gpt-3.5")):
        return "cl100k_base"
    return core.DEFAULT_ENCODING


def _summary_headers(session_id: str, result: Any) -> list[tuple[str, str]]:
    return [
        ("x-contextrender-session", session_id),
        ("x-contextrender-history-tokens", str(result.history_tokens)),
        ("x-contextrender-kept", str(result.kept)),
        ("x-contextrender-omitted", str(result.omitted)),
        ("x-contextrender-folded", str(result.folded_messages)),
    ]


class _SessionState:
    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.turn = 0
        self.answers: dict[int, dict] = {}
        # Bytes it holds (estimated: its answers as JSON, plus STATE_BYTES).
        self.size = STATE_BYTES
        # The encoding this process has checked the session counts with (None: not yet).
        self.encoding: str | None = None
        # What the format layer remembered of the last forwarded request (prompt cache placement).
        self.previous: Any = None
        # Token counts of the last system prompt and tool list seen (the input estimate).
        self.counted: dict[str, tuple[str, int]] = {}
        self.warned = False
        # Whether its last request went upstream unmanaged (warned once until it is managed again).
        self.unmanaged = False


def _answer_bytes(message: dict) -> int:
    return 2 * len(json.dumps(message, ensure_ascii=False)) + STATE_BYTES


def _error(fmt: Any, status: int, message: str, kind: str) -> JSONResponse:
    """An error in the protocol's own shape."""
    return JSONResponse(fmt.error(status, message, kind), status_code=status)


class _ClientGone(Exception):
    """The client disconnected while the proxy waited for the upstream."""


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (its body is read: `receive` then waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(gone: asyncio.Future, work: Any) -> Any:
    """`work`'s result, or _ClientGone (with `work` cancelled: httpx closes its connection) if the
    client leaves first."""
    task = asyncio.ensure_future(work)
    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise _ClientGone


async def _read_all(response: httpx.Response) -> bytes:
    return b"".join([chunk async for chunk in response.aiter_raw()])


_CHAT = _Chat()


class _Proxy:
    def __init__(
        self, backend: Backend, upstream: str, budget: int, selector: str, fail_closed: bool,
        client: httpx.AsyncClient | None = None, upstream_timeout: float = DEFAULT_UPSTREAM_TIMEOUT,
        restore_rounds: int = DEFAULT_RESTORE_ROUNDS,
    ) -> None:
        self.backend = backend
        self.restore_rounds = restore_rounds
        self.upstream = upstream.rstrip("/")
        self.budget = budget
        self.selector = selector or DEFAULT_SELECTOR
        self.fail_closed = fail_closed
        self.client = client
        self.upstream_timeout = upstream_timeout
        # Per session, least recently used first: its lock, its request count, and the answers
        # the proxy stored, by their position in the message list; within `max_state_bytes`.
        self._sessions: OrderedDict[str, _SessionState] = OrderedDict()
        self.max_state_bytes = cache_bytes_setting() // STATE_SHARE
        self.state_bytes = 0

    # -- upstream plumbing

    def url(self, path: str, query: str) -> str:
        rest = path[3:] if path == "/v1" or path.startswith("/v1/") else path
        return self.upstream + rest + (f"?{query}" if query else "")

    async def forward(
        self, request: Request, body: bytes, fmt: Format = _CHAT,
        on_answer: Callable[[dict | None, dict], BackgroundTask | None] | None = None,
        headers: Sequence[tuple[str, str]] = (),
    ) -> Response:
        """The upstream's answer to `body`, with `headers` added. Until the answer streams, a
        client that leaves cancels the upstream call (then StreamingResponse does: it cancels
        `relay`)."""
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            return await self._forward(request, body, fmt, on_answer, headers, gone)
        except _ClientGone:
            log.info("client left before the upstream answered %s; upstream call cancelled", request.url.path)
            return Response(status_code=499)
        finally:
            gone.cancel()

    async def _forward(
        self, request: Request, body: bytes, fmt: Format,
        on_answer: Callable[[dict | None, dict], BackgroundTask | None] | None,
        headers: Sequence[tuple[str, str]], gone: asyncio.Future,
    ) -> Response:
        sent = [(k, v) for (k, v) in request.headers.items() if k.lower() not in _REQUEST_SKIP and not k.lower().startswith(_OWN_HEADERS)]
        # A bare httpx.Request: the client's default headers (User-Agent, Accept-Encoding) would
        # otherwise be added to what the agent sent.
        upstream_request = httpx.Request(
            request.method, self.url(request.url.path, request.url.query), headers=sent, content=body,
        )
        try:
            response = await _unless_gone(gone, self.client.send(upstream_request, stream=True))
        except httpx.TimeoutException as exc:
            return self.timed_out(exc, fmt)
        except httpx.HTTPError as exc:
            log.warning("upstream %s unreachable: %s", self.upstream, exc)
            failed = fmt.error(502, f"ContextRender proxy: upstream {self.upstream} failed: {exc}", "upstream_error")
            return JSONResponse(failed, status_code=502, headers=dict(headers))
        out_headers = [(k, v) for (k, v) in response.headers.multi_items() if k.lower() not in _RESPONSE_SKIP] + list(headers)
        if on_answer is None:
            # Passthrough: the bytes as they come, with the upstream's length (HEAD included).
            length = response.headers.get("content-length")
            relayed = StreamingResponse(response.aiter_raw(), status_code=response.status_code, background=BackgroundTask(response.aclose))
            relayed.raw_headers = _raw(out_headers + ([("content-length", length)] if length is not None else []))
            return relayed
        wants_answer = response.status_code == 200
        decoder = Decoder(response.headers.get("content-encoding", ""))
        if "text/event-stream" not in response.headers.get("content-type", ""):
            try:
                raw = await _unless_gone(gone, _read_all(response))
            except httpx.TimeoutException as exc:
                return self.timed_out(exc, fmt)
            except httpx.HTTPError as exc:
                log.warning("upstream %s closed its answer early: %s", self.upstream, exc)
                return _error(fmt, 502, f"ContextRender proxy: upstream {self.upstream} closed its answer before the end: {exc}", "upstream_error")
            finally:
                await response.aclose()
            task = None  # an answer in JSON: read whole to ingest it
            if wants_answer and decoder.ok:
                task = on_answer(*fmt.answer(decoder.feed(raw)))
            plain = Response(raw, status_code=response.status_code, background=task)
            plain.raw_headers = _raw(out_headers) + [(b"content-length", str(len(raw)).encode())]
            return plain

        stream = fmt.reader()
        tasks: list[BackgroundTask] = []

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
                    if wants_answer and decoder.ok:
                        stream.feed(decoder.feed(chunk))
            except httpx.HTTPError as exc:  # headers are sent: the stream can only end early
                log.warning("upstream %s stream ended early: %s", self.upstream, exc)
            finally:
                await response.aclose()
            # Runs before the response's last frame is sent: the answer is recorded before the
            # agent can send its next request.
            if wants_answer and decoder.ok:
                stream.feed(b"\n\n")
                if stream.done:
                    task = on_answer(stream.answer(), stream.usage)
                    if task:
                        tasks.append(task)

        async def after() -> None:
            for task in tasks:
                await task()

        streaming = StreamingResponse(relay(), status_code=response.status_code, background=BackgroundTask(after))
        streaming.raw_headers = _raw(out_headers)
        return streaming

    # -- restores (chat completions)

    async def forward_restoring(
        self, request: Request, body: dict, session_id: str, on_answer: Callable[..., BackgroundTask | None],
        headers: Sequence[tuple[str, str]], rounds: _Rounds,
    ) -> Response:
        """Forward a chat-completions request with the restore tool offered, answer the restore
        rounds the model asks for, and return the one answer that is the agent's (README,
        "Restores"). Until the response starts, a client that leaves cancels the upstream call."""
        # The proxy reads every answer (and may withhold frames): it asks for it uncompressed.
        sent = [(k, v) for (k, v) in request.headers.items()
                if k.lower() not in _REQUEST_SKIP and not k.lower().startswith(_OWN_HEADERS) and k.lower() != "accept-encoding"]
        sent.append(("accept-encoding", "identity"))
        url = self.url(request.url.path, request.url.query)
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            if body.get("stream"):
                return await self._restoring_stream(url, sent, body, session_id, on_answer, list(headers), rounds, gone)
            return await self._restoring(url, sent, body, session_id, on_answer, list(headers), rounds, gone)
        except _ClientGone:
            log.info("client left during a restore round of session %s; upstream call cancelled", session_id)
            return Response(status_code=499)
        finally:
            gone.cancel()

    async def _restoring(
        self, url: str, sent: list, body: dict, session_id: str, on_answer: Callable[..., BackgroundTask | None],
        headers: list, rounds: _Rounds, gone: asyncio.Future,
    ) -> Response:
        while True:
            offered = rounds.count < self.restore_rounds
            try:
                response = await _unless_gone(gone, self.client.send(self._round_request(url, sent, body, offered, rounds)))
            except httpx.TimeoutException as exc:
                return self.timed_out(exc, _CHAT)
            except httpx.HTTPError as exc:
                return self._unreachable(exc, rounds, headers)
            raw = response.content  # decoded: the agent gets it without content-encoding
            out_headers = [(k, v) for (k, v) in response.headers.multi_items()
                           if k.lower() not in _RESPONSE_SKIP and k.lower() != "content-encoding"]
            (message, usage) = _CHAT.answer(raw) if response.status_code == 200 else (None, {})
            rounds.answered(usage)
            calls = restore_loop.split_answer(message) if message else None
            if calls is not None and offered and calls.restore_first:
                await self._answer_round(session_id, calls, rounds)
                with contextlib.suppress(ValueError, AttributeError):
                    restore_loop.add_usage(rounds.usage, json.loads(raw).get("usage"))
                continue
            if calls is not None and calls.restore_calls:
                raw = restore_loop.strip_restore_calls(raw) or raw
                message = _CHAT.answer(raw)[0]
            task = on_answer(message, rounds.reported, rounds.extra_estimate) if response.status_code == 200 else None
            plain = Response(raw, status_code=response.status_code, background=task)
            plain.raw_headers = _raw(out_headers + headers + rounds.headers()) + [(b"content-length", str(len(raw)).encode())]
            return plain

    def _round_request(self, url: str, sent: list, body: dict, offered: bool, rounds: _Rounds) -> httpx.Request:
        rounds.called()
        payload = restore_loop.with_tool(body, offered)
        payload["messages"] = list(body["messages"]) + rounds.messages
        return httpx.Request("POST", url, headers=sent, content=json.dumps(payload, ensure_ascii=False).encode())

    def _unreachable(self, exc: Exception, rounds: _Rounds, headers: list) -> Response:
        log.warning("upstream %s unreachable: %s", self.upstream, exc)
        failed = _CHAT.error(502, f"ContextRender proxy: upstream {self.upstream} failed: {exc}", "upstream_error")
        return JSONResponse(failed, status_code=502, headers=dict(headers + rounds.headers()))

    async def _answer_round(self, session_id: str, calls: restore_loop.AnswerCalls, rounds: _Rounds) -> None:
        """Answer each restore call from the store (a tool error when it cannot be: the model goes
        on without it) and add the round to the next upstream request."""
        contents: list[Any] = []
        state = self.session(session_id)
        async with state.lock:  # a restore writes its edge: one writer per session
            for call in calls.restore_calls:
                handle = ""
                try:
                    handle = restore_loop.handle_of(call)
                    restored = await run_in_threadpool(self.backend.restore, session_id, handle)
                    contents.append(_field(restored, "message").get("content"))
                except Exception as exc:  # noqa: BLE001 - the model gets the error as the tool's answer
                    log.info("session %s: restore of %r refused: %s", session_id, handle, exc)
                    contents.append(restore_loop.tool_error(handle, str(exc)))
        rounds.messages.extend(restore_loop.round_messages(calls, contents))
        rounds.count += 1

    async def _restoring_stream(
        self, url: str, sent: list, body: dict, session_id: str, on_answer: Callable[..., BackgroundTask | None],
        headers: list, rounds: _Rounds, gone: asyncio.Future,
    ) -> Response:
        seen = _CHAT.reader()  # what the agent received, rebuilt: the answer the session stores
        tasks: list[BackgroundTask] = []

        async def run() -> AsyncIterator[Any]:
            # Yields the response's start (status, headers) once, right before its first bytes.
            started = False
            while True:
                offered = rounds.count < self.restore_rounds
                try:
                    response = await self.client.send(self._round_request(url, sent, body, offered, rounds), stream=True)
                except httpx.HTTPError as exc:
                    if not started:
                        yield self.timed_out(exc, _CHAT) if isinstance(exc, httpx.TimeoutException) else self._unreachable(exc, rounds, headers)
                    else:
                        yield _stream_error(f"upstream {self.upstream} failed during a restore round: {exc}")
                    return
                out_headers = [(k, v) for (k, v) in response.headers.multi_items()
                               if k.lower() not in _RESPONSE_SKIP and k.lower() != "content-encoding"]
                reader = restore_loop.StreamRound(may_restore=offered)
                try:
                    if response.status_code != 200:
                        failed = await response.aread()
                        if not started:
                            yield (response.status_code, out_headers)
                            yield failed
                        else:
                            yield _stream_error(f"upstream answered {response.status_code} during a restore round: "
                                                f"{failed[:500].decode('utf-8', 'replace')}")
                        return
                    async for chunk in response.aiter_bytes():
                        for frame in reader.feed(chunk):
                            if not started:
                                started = True
                                yield (200, out_headers)
                            seen.feed(frame)
                            yield frame
                    for frame in reader.close():
                        if not started:
                            started = True
                            yield (200, out_headers)
                        seen.feed(frame)
                        yield frame
                except httpx.HTTPError as exc:  # the upstream's answer ended early, or it fell silent
                    log.warning("upstream %s answer ended early: %s", self.upstream, exc)
                    if not started:
                        yield self.timed_out(exc, _CHAT) if isinstance(exc, httpx.TimeoutException) else _error(
                            _CHAT, 502, f"ContextRender proxy: upstream {self.upstream} closed its answer before the end: {exc}", "upstream_error")
                    else:
                        yield _stream_error(f"upstream {self.upstream} answer ended early: {exc}")
                    return
                finally:
                    await response.aclose()
                rounds.answered(_chat_usage(reader.usage))
                if reader.restore_round:
                    await self._answer_round(session_id, reader.answer(), rounds)
                    restore_loop.add_usage(rounds.usage, reader.usage)
                    continue
                if not started:
                    yield (200, out_headers)
                seen.feed(b"\n\n")
                if seen.done:
                    task = on_answer(seen.answer(), rounds.reported, rounds.extra_estimate)
                    if task:
                        tasks.append(task)
                return

        stream = run()
        start = await _unless_gone(gone, stream.__anext__())
        if isinstance(start, Response):
            return start
        (status, out_headers) = start

        async def after() -> None:
            for task in tasks:
                await task()

        streaming = StreamingResponse(stream, status_code=status, background=BackgroundTask(after))
        streaming.raw_headers = _raw(out_headers + headers + rounds.headers())
        return streaming

    def timed_out(self, exc: Exception, fmt: Any) -> Response:
        log.warning("upstream %s timed out: %s", self.upstream, type(exc).__name__)
        return _error(fmt, 504, f"ContextRender proxy: upstream {self.upstream} sent nothing for {self.upstream_timeout:g} s (--upstream-timeout)", "upstream_timeout")

    # -- sessions

    def session(self, session_id: str) -> _SessionState:
        """The session's state, marked as just used; the least recently used idle sessions are
        forgotten while the states hold more than `max_state_bytes` (their answers then match by
        normal form only, as the engine matches echoes)."""
        state = self._sessions.get(session_id)
        if state is None:
            state = self._sessions[session_id] = _SessionState()
            self.state_bytes += state.size
        self._sessions.move_to_end(session_id)
        while self.state_bytes > self.max_state_bytes and len(self._sessions) > 1:
            (oldest, old) = next(iter(self._sessions.items()))
            if old.lock.locked() or old is state:
                break  # in use: forget it later
            del self._sessions[oldest]
            self.state_bytes -= old.size
        return state

    def remember(self, state: _SessionState, position: int, message: dict) -> None:
        self.forget(state, [position])
        state.answers[position] = message
        size = _answer_bytes(message)
        state.size += size
        self.state_bytes += size

    def forget(self, state: _SessionState, positions: list[int]) -> None:
        for position in positions:
            if position in state.answers:
                size = _answer_bytes(state.answers.pop(position))
                state.size -= size
                self.state_bytes -= size

    def reconcile(self, session_id: str, messages: list) -> list:
        """The message list as the session stores it: assistant messages in normal form, and
        each answer the proxy stored in place of the agent's copy of it (agents rebuild answers
        from streams or SDK objects: `content` "" for null, extra keys in tool calls). Without
        this the engine, which compares exactly, would take every echoed answer for a rewrite."""
        messages = [normal_form(m) for m in messages]
        state = self.session(session_id)
        stored = state.answers
        for position in sorted(stored):
            if position < len(messages) and same_event(stored[position], messages[position]):
                messages[position] = stored[position]
                continue
            # History rewritten (or cut) here: the engine forks; later answers are on the old branch.
            self.forget(state, [p for p in stored if p >= position])
            break
        return messages

    def check_encoding(self, session_id: str, state: _SessionState, encoding: str) -> None:
        """Count a new session's tokens with its model family's encoding (once per session and
        process). A session's own setting wins, and one that already holds events keeps the
        encoding it was counted with (its stored counts would not match)."""
        if state.encoding == encoding:
            return
        try:
            info = self.backend.get_session(session_id)
        except UnknownSession:
            info = {"events": 0, "config": {}}
        chosen = info["config"].get("encoding")
        if chosen is None and info["events"] == 0 and encoding != core.DEFAULT_ENCODING:
            self.backend.configure(session_id, encoding=encoding)
        elif (chosen or core.DEFAULT_ENCODING) != encoding:
            log.warning("session %s counts tokens with %s, not %s (its model's): set on an earlier request or by configure_session",
                        session_id, chosen or core.DEFAULT_ENCODING, encoding)
        state.encoding = encoding

    def estimate(self, state: _SessionState, encoding: str, result: Any, tools: Any) -> int:
        """The whole input the upstream will count, estimated: system prompt, rendered history,
        current message and tool definitions (the first and last cached per session: long and
        mostly unchanged between calls)."""
        tokenizer = get_tokenizer(encoding)
        messages = list(result.messages)
        lead = next((i for (i, m) in enumerate(messages) if m.get("role") not in ("system", "developer")), len(messages))
        system = messages[:lead]
        current = messages[-1:] if len(messages) > lead and messages[-1].get("role") == "user" else []

        def cached(kind: str, value: Any, count: Callable[[], int]) -> int:
            key = json.dumps(value, ensure_ascii=False, sort_keys=True)
            if state.counted.get(kind, ("", 0))[0] != key:
                state.counted[kind] = (key, count())
            return state.counted[kind][1]

        total = result.history_tokens + tokenizer.history_tokens(current)
        total += cached("system", system, lambda: tokenizer.history_tokens(system))
        if tools:
            total += cached("tools", tools, lambda: tokenizer.count(json.dumps(tools, ensure_ascii=False)))
        return total

    def answered(self, session_id: str, turn: int, position: int, estimate: int) -> Callable[..., BackgroundTask | None]:
        # `extra_estimate`: the estimated input of the request's restore rounds, whose usage the
        # report includes.
        def record(message: dict | None, usage: dict, extra_estimate: int = 0) -> BackgroundTask | None:
            state = self.session(session_id)
            if state.turn != turn:
                message = None  # a later request of the session has been rendered meanwhile
            if message is not None:
                self.remember(state, position, message)
            if usage:
                usage = usage | {"estimated_input_tokens": estimate + extra_estimate}
            if message is None and not usage:
                return None
            return BackgroundTask(self.ingest_answer, session_id, turn, message, usage)

        return record

    async def ingest_answer(self, session_id: str, turn: int, message: dict | None, usage: dict) -> None:
        state = self.session(session_id)
        async with state.lock:
            # A next request of the session, rendered meanwhile, has ingested it with its own list.
            messages = [message] if message is not None and state.turn == turn else []
            if not messages and not usage:
                return
            options = {"usage": usage} if usage else {}
            try:
                await run_in_threadpool(self.backend.ingest, session_id, messages, append=True, **options)
            except Exception as exc:  # noqa: BLE001 - an answer that cannot be stored must not break the agent
                log.warning("session %s: the answer was not ingested: %s", session_id, exc)

    # -- conversation requests, in any format

    def controls(self, request: Request) -> tuple[int, str]:
        """The budget and selector of this request: the proxy's, or its `X-ContextRender-Budget`
        and `X-ContextRender-Selector` headers (checked: InvalidRequest names the header)."""
        # Imported here: the renderer loads byLLM, which `contextrender --help` need not wait for.
        from contextrender_adapters.core import MIN_BUDGET, render_settings

        budget, selector = self.budget, self.selector
        if BUDGET_HEADER in request.headers:
            value = request.headers[BUDGET_HEADER].strip()
            if not value.isdigit() or int(value) < MIN_BUDGET:
                raise InvalidRequest(f"X-ContextRender-Budget must be a whole number of tokens >= {MIN_BUDGET} (got {value!r})")
            budget = int(value)
        if SELECTOR_HEADER in request.headers:
            selector = request.headers[SELECTOR_HEADER].strip()
            try:
                render_settings({"selector": selector})
            except InvalidRequest as exc:
                raise InvalidRequest(f"X-ContextRender-Selector: {exc}") from exc
        return budget, selector

    async def managed(self, request: Request, fmt: Format) -> Response:
        try:
            budget, selector = self.controls(request)
        except InvalidRequest as exc:
            # The caller asked for this request's settings: a bad one is refused, fail-open or not.
            return JSONResponse(fmt.error(400, f"ContextRender: {exc}", "invalid_request_error"), status_code=400)
        raw = await request.body()
        try:
            body = json.loads(raw)
        except RecursionError:
            return _error(fmt, 400, "ContextRender proxy: the JSON body is nested too deeply", "invalid_request_error")
        except ValueError:
            body = None
        failure: Exception | None = None
        try:
            exchange = fmt.parse(body) if isinstance(body, dict) else None
        except InvalidRequest as exc:
            exchange, failure = None, exc
        if exchange is None and failure is None:
            # Not ours to judge: the upstream answers it.
            return await self.forward(request, raw, fmt, headers=[(STATUS_HEADER, "unmanaged; reason=no_messages_list")])
        messages = exchange.messages if exchange is not None else []
        session_id = request.headers.get(SESSION_HEADER) or derive_session(messages)
        if failure is not None:
            return await self.engine_failed(request, raw, session_id, failure, fmt)
        state = self.session(session_id)
        if fmt is _CHAT and self.restore_rounds and restore_loop.declares_restore(body):
            # Refused before anything is stored: the proxy would answer the agent's own tool.
            return JSONResponse({"error": {
                "message": f"ContextRender proxy: this request declares a tool named {restore_loop.RESTORE_TOOL!r}, the name "
                           "the proxy reserves for the model to take back omitted tool results. Rename your tool, or start "
                           "the proxy with --restore-rounds 0 if your agent answers that tool itself.",
                "type": "invalid_request_error", "param": "tools", "code": "contextrender_reserved_tool_name",
            }}, status_code=400)
        if exchange.unmanaged:
            if not state.warned:
                state.warned = True
                log.warning("session %s: forwarded without rendering: %s", session_id, exchange.unmanaged)
            # The reason can quote a client's item type: ASCII only in a header.
            reason = exchange.unmanaged.encode("ascii", "replace").decode()
            return await self.forward(request, raw, fmt, headers=[
                (STATUS_HEADER, "unmanaged; reason=not_renderable"), (UNMANAGED_HEADER, reason),
            ])
        encoding = model_encoding(exchange.model)
        async with state.lock:
            state.turn += 1
            turn = state.turn
            try:
                await run_in_threadpool(self.check_encoding, session_id, state, encoding)
                prepared = self.reconcile(session_id, messages)
                result = await run_in_threadpool(
                    lambda: self.backend.render(session_id, prepared, budget=budget, selector=selector)
                )
                (out_body, state.previous) = exchange.build(list(result.messages), prepared, state.previous)
                estimate = self.estimate(state, state.encoding or encoding, result, exchange.tools)
            except Exception as exc:  # noqa: BLE001 - fail-open covers every engine failure
                failure = exc
        if failure is not None:
            return await self.engine_failed(request, raw, session_id, failure, fmt)
        state.unmanaged = False
        try:
            out = json.dumps(out_body, ensure_ascii=False).encode()
        except RecursionError:
            return _error(fmt, 400, "ContextRender proxy: the JSON body is nested too deeply", "invalid_request_error")
        on_answer = self.answered(session_id, turn, len(messages), estimate)
        headers = [(STATUS_HEADER, "managed")] + _summary_headers(session_id, result)
        if fmt is _CHAT and self.restore_rounds and restore_loop.offers_tool(out_body, _field(result, "omitted"), _field(result, "compacted")):
            rounds = _Rounds(estimate, state.encoding or encoding)
            return await self.forward_restoring(request, out_body, session_id, on_answer, headers, rounds)
        return await self.forward(request, out, fmt, on_answer=on_answer, headers=headers)

    async def chat_completions(self, request: Request) -> Response:
        return await self.managed(request, _CHAT)

    async def messages(self, request: Request) -> Response:
        return await self.managed(request, anthropic.FORMAT)

    async def responses(self, request: Request) -> Response:
        return await self.managed(request, responses.FORMAT)

    async def engine_failed(self, request: Request, raw: bytes, session_id: str, exc: Exception, fmt: Format) -> Response:
        status = getattr(exc, "status", 500)
        if self.fail_closed:
            # The request's own faults go back as such; anything else (the server down, an
            # expired login) is the proxy's failure, not the agent's: 502.
            code = status if status in _REQUEST_FAULTS else 502
            kind = "invalid_request_error" if code != 502 else "contextrender_error"
            return JSONResponse(fmt.error(code, f"ContextRender: {exc}", kind), status_code=code)
        # Fail-open: the agent gets its answer, and the headers say the history went unmanaged;
        # the log says why once, not at every call of a session that keeps failing.
        state = self.session(session_id)
        if not state.unmanaged:
            state.unmanaged = True
            log.warning("session %s: render failed, forwarding requests unmanaged until it works again: %s: %s",
                        session_id, type(exc).__name__, exc)
        return await self.forward(request, raw, fmt, headers=[
            (STATUS_HEADER, f"unmanaged; reason={type(exc).__name__}"),
            (UNMANAGED_HEADER, f"render failed ({type(exc).__name__})"),
        ])


def create_app(
    backend: Backend,
    upstream: str,
    budget: int,
    selector: str = DEFAULT_SELECTOR,
    fail_closed: bool = False,
    upstream_timeout: float | None = None,
    restore_rounds: int = DEFAULT_RESTORE_ROUNDS,
) -> FastAPI:
    """The proxy as an ASGI app (serve it with uvicorn). `backend` is an `Engine` or a `Client`.
    `upstream_timeout`: seconds of upstream silence before a 504 (default
    $CONTEXTRENDER_UPSTREAM_TIMEOUT or 600). `restore_rounds`: restore rounds one chat-completions
    request may take (0: the restore tool is never offered)."""
    if not isinstance(budget, int) or budget <= 0:
        raise ValueError(f"budget must be a positive number of tokens (got {budget!r})")
    if not isinstance(restore_rounds, int) or restore_rounds < 0:
        raise ValueError(f"restore_rounds must be an integer >= 0 (got {restore_rounds!r})")
    if upstream_timeout is None:
        upstream_timeout = float(os.environ.get("CONTEXTRENDER_UPSTREAM_TIMEOUT", DEFAULT_UPSTREAM_TIMEOUT))
    if not upstream_timeout > 0:
        raise ValueError(f"upstream_timeout must be a positive number of seconds (got {upstream_timeout!r})")
    proxy = _Proxy(backend, upstream, budget, selector, fail_closed, upstream_timeout=upstream_timeout, restore_rounds=restore_rounds)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(upstream_timeout, connect=30.0, pool=None)
        warm_up = getattr(backend, "warm_up", None)  # an Engine: its models load before the first request
        if warm_up is not None:
            await run_in_threadpool(warm_up)
        # Everything loaded so far (Jac modules, litellm, models) lives as long as the process:
        # moved out of the collector's reach, a full collection no longer walks it. Without
        # this, the first request that allocated enough paid for one walk of the whole start-up
        # heap: a first request with 150 results 2.0 s, against 0.27 s after it.
        gc.collect()
        gc.freeze()
        async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
            proxy.client = client
            yield

    app = FastAPI(title="ContextRender proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.proxy = proxy
    app.add_api_route("/v1/chat/completions", proxy.chat_completions, methods=["POST"])
    app.add_api_route("/v1/messages", proxy.messages, methods=["POST"])
    app.add_api_route("/v1/responses", proxy.responses, methods=["POST"])

    async def passthrough(request: Request, path: str) -> Response:
        # Anthropic's other paths (count_tokens, batches) get its error shape from the proxy too.
        fmt = anthropic.FORMAT if path.startswith("v1/messages/") else _CHAT
        return await proxy.forward(request, await request.body(), fmt)

    app.add_api_route(
        "/{path:path}", passthrough, methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"],
    )
    return app


# ---------------------------------------------------------------- command line


def _backend(args: argparse.Namespace) -> Backend:
    if args.server:
        from contextrender_adapters.client import Client

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
    from contextrender_adapters.engine import Engine

    return Engine(args.store)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from contextrender_adapters.core import SELECTORS

    if args.selector not in SELECTORS:
        # Checked here: once serving, a bad selector would fail every request open.
        raise SystemExit(f"contextrender proxy: unknown selector {args.selector!r}; known: {', '.join(SELECTORS)}")

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.restore_rounds < 0:
        raise SystemExit(f"contextrender proxy: --restore-rounds must be >= 0 (got {args.restore_rounds})")
    app = create_app(_backend(args), args.upstream, args.budget, args.selector, args.fail_closed, args.upstream_timeout,
                     args.restore_rounds)
    where = f"server {args.server}" if args.server else f"store {os.path.abspath(args.store)}"
    log.info("proxy on http://%s:%d -> %s (budget %d, selector %s, restore rounds %d, %s)", args.host, args.port,
             args.upstream, args.budget, args.selector, args.restore_rounds, where)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def register(subparsers: Any) -> None:
    """Add `contextrender proxy` to the command line."""
    parser = subparsers.add_parser(
        "proxy",
        help="OpenAI-compatible proxy that renders each request's history within a token budget",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--upstream", required=True, help="upstream base URL, as an OpenAI client takes it (e.g. https://api.openai.com/v1)")
    parser.add_argument("--budget", type=int, required=True, help="history budget B in tokens (system prompt and current user message are outside B)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--selector", default=DEFAULT_SELECTOR, help="renderer selector (default: contextrender; also full, cr-recency, ...)")
    parser.add_argument("--server", default="", help="URL of a running `jac start` ContextRender server (default: the engine in-process)")
    parser.add_argument("--token", default=os.environ.get("CONTEXTRENDER_TOKEN", ""), help="with --server: bearer token (default $CONTEXTRENDER_TOKEN)")
    parser.add_argument("--store", default=os.environ.get("CONTEXTRENDER_STORE", ".contextrender"), help="without --server: the graph store (default $CONTEXTRENDER_STORE or .contextrender)")
    parser.add_argument("--fail-closed", action="store_true", help="answer engine failures with an error instead of forwarding the original request")
    parser.add_argument("--upstream-timeout", type=float, default=None,
                        help=f"seconds the upstream may send nothing before a 504 (default $CONTEXTRENDER_UPSTREAM_TIMEOUT or {DEFAULT_UPSTREAM_TIMEOUT:g})")
    parser.add_argument("--restore-rounds", type=int, default=DEFAULT_RESTORE_ROUNDS,
                        help=f"restore rounds per chat-completions request: the model may take back omitted results with the "
                             f"tool contextrender_restore, answered by the proxy (default {DEFAULT_RESTORE_ROUNDS}; 0: never offered)")
    parser.set_defaults(func=run)
