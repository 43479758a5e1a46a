"""The OpenAI-compatible proxy: it renders the history of every chat-completions request within
the budget before forwarding it upstream, and passes everything else through unchanged.

    contextrender proxy --upstream https://api.openai.com/v1 --budget 6000 --port 8800

Requests to `/v1/<path>` go to `<upstream>/<path>` (the upstream is a base URL as an OpenAI client
takes it, `/v1` included); other paths are appended to the upstream URL as they are.

For `POST /v1/chat/completions` the proxy
1. names the session: the `X-ContextRender-Session` header, else a hash of the conversation's
   stable prefix (`derive_session`);
2. asks the backend (the in-process `Engine`, or a `Client` of a running server) to ingest the
   message list and render it within the budget, and replaces `messages` with the rendered list;
   every other field of the body, and every header but the session header, is forwarded as is;
3. returns the upstream's answer unchanged: status, headers and body bytes, streamed chunk by chunk
   when the upstream streams;
4. ingests the answer's assistant message into the session once the answer is complete.

If the backend fails, the proxy logs it and forwards the original request (fail-open), unless it
was created with `fail_closed=True`: then it answers with the error (the engine's 4xx status, or 502).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import zlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from engine.index import cache_bytes_setting
from engine.measure import content_text

__all__ = ["Backend", "create_app", "derive_session", "register", "SESSION_HEADER"]

log = logging.getLogger("contextrender.proxy")

SESSION_HEADER = "x-contextrender-session"
_DIGITS = re.compile(r"\d+")
# Engine errors that are the request's fault (malformed messages, a rewrite refused, too large).
_REQUEST_FAULTS = {400, 409, 413, 422}
DEFAULT_SELECTOR = "contextrender"
# The stored answers the proxy remembers, least recently used sessions forgotten first: this
# share of CONTEXTRENDER_INDEX_CACHE_MB (the engine's indexes hold the rest; answers are small).
STATE_SHARE = 16
# A session's state without its answers (lock, counters, its table entry).
STATE_BYTES = 600
# Hop-by-hop headers (RFC 9110 7.6.1) and the ones the HTTP layer recomputes.
_REQUEST_SKIP = {
    "host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
    "upgrade", "proxy-authorization", "proxy-connection", SESSION_HEADER,
}
_RESPONSE_SKIP = {"content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}


class Backend(Protocol):
    """What the proxy needs from the engine: `Engine` and `Client` both have it."""

    def render(self, session_id: str, messages: list[dict], *, budget: int, selector: str = "", **params: Any) -> Any: ...

    def ingest(self, session_id: str, messages: list[dict], *, append: bool = False) -> Any: ...


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


def _calls(message: dict) -> list[tuple]:
    return [
        (c.get("id"), (c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments"))
        for c in message.get("tool_calls") or []
        if isinstance(c, dict)
    ]


def _same_turn(a: Any, b: dict) -> bool:
    """Whether a message the agent sends back is the answer the proxy stored: same role, text and
    calls. Clients re-serialise answers (null fields added or dropped, key order), which the
    engine's exact comparison would take for a rewrite."""
    return (
        isinstance(a, dict)
        and a.get("role") == b.get("role")
        and content_text(a.get("content")) == content_text(b.get("content"))
        and _calls(a) == _calls(b)
    )


def _normal(message: Any) -> Any:
    """An assistant message with only the fields a chat-completions request takes: role, content
    (`""` and null alike: null beside tool calls, else `""`), name, refusal, and tool calls as id,
    type and function name and arguments. SDKs add or drop fields when they re-serialise an answer (`refusal: null`, `annotations: []`,
    an `index` in tool calls), and providers return fields they refuse to be sent back (DeepSeek's
    `reasoning_content`), which the history budget would not count either. Every assistant message
    is stored and forwarded in this form, so an echoed answer matches the stored one."""
    if not isinstance(message, dict) or message.get("role") != "assistant":
        return message
    calls = [c for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    # Content may be null only beside tool calls or a refusal; otherwise an empty answer is "".
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content") or (None if calls or message.get("refusal") else "")}
    for key in ("name", "refusal"):
        if message.get(key):
            out[key] = message[key]
    if calls:
        out["tool_calls"] = [
            {"id": c.get("id"), "type": c.get("type") or "function",
             "function": {"name": (c.get("function") or {}).get("name"), "arguments": (c.get("function") or {}).get("arguments")}}
            for c in calls
        ]
    return out


# ---------------------------------------------------------------- the answer, from a body or a stream


class _Decoder:
    """Decodes a (possibly compressed) upstream body so the answer can be read; the bytes sent
    to the client are never touched."""

    def __init__(self, encoding: str) -> None:
        encoding = encoding.strip().lower()
        self.ok = encoding in ("", "identity", "gzip", "deflate")
        self._z = None
        if encoding == "gzip":
            self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif encoding == "deflate":
            self._z = zlib.decompressobj()

    def feed(self, chunk: bytes) -> bytes:
        return self._z.decompress(chunk) if self._z else chunk


class _StreamAnswer:
    """Rebuilds the assistant message from chat-completions SSE chunks (choice 0)."""

    def __init__(self) -> None:
        self._buffer = b""
        self.message: dict[str, Any] = {"role": "assistant"}
        self._texts: dict[str, list[str]] = {}
        self._calls: dict[int, dict] = {}
        self.choices: set[int] = set()
        self.done = False
        self.broken = False

    def feed(self, data: bytes) -> None:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            try:
                chunk = json.loads(payload)
                for choice in chunk.get("choices") or []:
                    self._choice(choice)
            except (ValueError, AttributeError, TypeError):
                self.broken = True

    def _choice(self, choice: dict) -> None:
        self.choices.add(choice.get("index", 0))
        if choice.get("index", 0) != 0:
            return
        delta = choice.get("delta") or {}
        for key, value in delta.items():
            if key == "tool_calls":
                for part in value or []:
                    call = self._calls.setdefault(
                        part.get("index", 0), {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                    )
                    call["id"] = part.get("id") or call["id"]
                    call["type"] = part.get("type") or call["type"]
                    function = part.get("function") or {}
                    call["function"]["name"] += function.get("name") or ""
                    call["function"]["arguments"] += function.get("arguments") or ""
            elif key == "role":
                self.message["role"] = value or "assistant"
            elif isinstance(value, str):
                self._texts.setdefault(key, []).append(value)

    def answer(self) -> dict | None:
        if self.broken or len(self.choices) != 1 or not (self._texts or self._calls):
            return None
        message = dict(self.message)
        for key, parts in self._texts.items():
            message[key] = "".join(parts)
        message.setdefault("content", None)
        if self._calls:
            message["tool_calls"] = [self._calls[i] for i in sorted(self._calls)]
        return _normal(message)


def _body_answer(body: bytes) -> dict | None:
    try:
        choices = json.loads(body).get("choices") or []
    except (ValueError, AttributeError):
        return None
    if len(choices) != 1 or not isinstance(choices[0].get("message"), dict):
        return None
    return _normal(choices[0]["message"])


# ---------------------------------------------------------------- the proxy


def _raw(headers: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(k.encode("latin-1"), v.encode("latin-1")) for (k, v) in headers]


class _SessionState:
    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.turn = 0
        self.answers: dict[int, dict] = {}
        # Bytes it holds (estimated: its answers as JSON, plus STATE_BYTES).
        self.size = STATE_BYTES


def _answer_bytes(message: dict) -> int:
    return 2 * len(json.dumps(message, ensure_ascii=False)) + STATE_BYTES


class _Proxy:
    def __init__(
        self, backend: Backend, upstream: str, budget: int, selector: str, fail_closed: bool,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.backend = backend
        self.upstream = upstream.rstrip("/")
        self.budget = budget
        self.selector = selector or DEFAULT_SELECTOR
        self.fail_closed = fail_closed
        self.client = client
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
        self, request: Request, body: bytes, on_answer: Callable[[dict], BackgroundTask | None] | None = None,
    ) -> Response:
        headers = [(k, v) for (k, v) in request.headers.items() if k.lower() not in _REQUEST_SKIP]
        # A bare httpx.Request: the client's default headers (User-Agent, Accept-Encoding) would
        # otherwise be added to what the agent sent.
        upstream_request = httpx.Request(
            request.method, self.url(request.url.path, request.url.query), headers=headers, content=body,
        )
        try:
            response = await self.client.send(upstream_request, stream=True)
        except httpx.HTTPError as exc:
            log.warning("upstream %s unreachable: %s", self.upstream, exc)
            return JSONResponse(
                {"error": {"message": f"ContextRender proxy: upstream {self.upstream} failed: {exc}", "type": "upstream_error"}},
                status_code=502,
            )
        out_headers = [(k, v) for (k, v) in response.headers.multi_items() if k.lower() not in _RESPONSE_SKIP]
        if on_answer is None:
            # Passthrough: the bytes as they come, with the upstream's length (HEAD included).
            length = response.headers.get("content-length")
            relayed = StreamingResponse(response.aiter_raw(), status_code=response.status_code, background=BackgroundTask(response.aclose))
            relayed.raw_headers = _raw(out_headers + ([("content-length", length)] if length is not None else []))
            return relayed
        wants_answer = response.status_code == 200
        decoder = _Decoder(response.headers.get("content-encoding", ""))
        if "text/event-stream" not in response.headers.get("content-type", ""):
            try:
                raw = b"".join([chunk async for chunk in response.aiter_raw()])
            finally:
                await response.aclose()
            task = None  # a chat-completions answer (JSON): read whole to ingest it
            if wants_answer and decoder.ok:
                answer = _body_answer(decoder.feed(raw))
                task = on_answer(answer) if answer else None
            plain = Response(raw, status_code=response.status_code, background=task)
            plain.raw_headers = _raw(out_headers) + [(b"content-length", str(len(raw)).encode())]
            return plain

        stream = _StreamAnswer()
        tasks: list[BackgroundTask] = []

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
                    if wants_answer and decoder.ok:
                        stream.feed(decoder.feed(chunk))
            finally:
                await response.aclose()
            # Runs before the response's last frame is sent: the answer is recorded before the
            # agent can send its next request.
            if wants_answer and decoder.ok and stream.done:
                stream.feed(b"\n")
                answer = stream.answer()
                task = on_answer(answer) if answer else None
                if task:
                    tasks.append(task)

        async def after() -> None:
            for task in tasks:
                await task()

        streaming = StreamingResponse(relay(), status_code=response.status_code, background=BackgroundTask(after))
        streaming.raw_headers = _raw(out_headers)
        return streaming

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
        messages = [_normal(m) for m in messages]
        state = self.session(session_id)
        stored = state.answers
        for position in sorted(stored):
            if position < len(messages) and _same_turn(messages[position], stored[position]):
                messages[position] = stored[position]
                continue
            # History rewritten (or cut) here: the engine forks; later answers are on the old branch.
            self.forget(state, [p for p in stored if p >= position])
            break
        return messages

    def answered(self, session_id: str, turn: int, position: int) -> Callable[[dict], BackgroundTask | None]:
        def record(message: dict) -> BackgroundTask | None:
            state = self.session(session_id)
            if state.turn != turn:
                return None  # a later request of the session has been rendered meanwhile
            self.remember(state, position, message)
            return BackgroundTask(self.ingest_answer, session_id, turn, message)

        return record

    async def ingest_answer(self, session_id: str, turn: int, message: dict) -> None:
        state = self.session(session_id)
        async with state.lock:
            # A next request of the session, rendered meanwhile, has ingested it with its own list.
            if state.turn != turn:
                return
            try:
                await run_in_threadpool(self.backend.ingest, session_id, [message], append=True)
            except Exception as exc:  # noqa: BLE001 - an answer that cannot be stored must not break the agent
                log.warning("session %s: the answer was not ingested: %s", session_id, exc)

    # -- chat completions

    async def chat_completions(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return await self.forward(request, raw)  # not ours to judge: the upstream answers it
        messages = body["messages"]
        session_id = request.headers.get(SESSION_HEADER) or derive_session(messages)
        failure: Exception | None = None
        state = self.session(session_id)
        async with state.lock:
            state.turn += 1
            turn = state.turn
            try:
                prepared = self.reconcile(session_id, messages)
                result = await run_in_threadpool(
                    lambda: self.backend.render(session_id, prepared, budget=self.budget, selector=self.selector)
                )
                rendered = list(result.messages)
            except Exception as exc:  # noqa: BLE001 - fail-open covers every engine failure
                failure = exc
        if failure is not None:
            return await self.engine_failed(request, raw, session_id, failure)
        body["messages"] = rendered
        out = json.dumps(body, ensure_ascii=False).encode()
        return await self.forward(request, out, on_answer=self.answered(session_id, turn, len(messages)))

    async def engine_failed(self, request: Request, raw: bytes, session_id: str, exc: Exception) -> Response:
        status = getattr(exc, "status", 500)
        if self.fail_closed:
            # The request's own faults go back as such; anything else (the server down, an
            # expired login) is the proxy's failure, not the agent's: 502.
            code = status if status in _REQUEST_FAULTS else 502
            kind = "invalid_request_error" if code != 502 else "contextrender_error"
            return JSONResponse({"error": {"message": f"ContextRender: {exc}", "type": kind, "code": code}}, status_code=code)
        log.warning("session %s: render failed, forwarding the original request: %s: %s", session_id, type(exc).__name__, exc)
        return await self.forward(request, raw)


def create_app(
    backend: Backend,
    upstream: str,
    budget: int,
    selector: str = DEFAULT_SELECTOR,
    fail_closed: bool = False,
) -> FastAPI:
    """The proxy as an ASGI app (serve it with uvicorn). `backend` is an `Engine` or a `Client`."""
    if not isinstance(budget, int) or budget <= 0:
        raise ValueError(f"budget must be a positive number of tokens (got {budget!r})")
    proxy = _Proxy(backend, upstream, budget, selector, fail_closed)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=httpx.Limits(max_connections=None)) as client:
            proxy.client = client
            yield

    app = FastAPI(title="ContextRender proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.proxy = proxy
    app.add_api_route("/v1/chat/completions", proxy.chat_completions, methods=["POST"])

    async def passthrough(request: Request, path: str) -> Response:
        return await proxy.forward(request, await request.body())

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

    from engine.selectors import SELECTORS

    if args.selector not in SELECTORS:
        # Checked here: once serving, a bad selector would fail every request open.
        raise SystemExit(f"contextrender proxy: unknown selector {args.selector!r}; known: {', '.join(SELECTORS)}")

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(_backend(args), args.upstream, args.budget, args.selector, args.fail_closed)
    where = f"server {args.server}" if args.server else f"store {os.path.abspath(args.store)}"
    log.info("proxy on http://%s:%d -> %s (budget %d, selector %s, %s)", args.host, args.port, args.upstream, args.budget, args.selector, where)
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
    parser.set_defaults(func=run)
