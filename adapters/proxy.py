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
import hashlib
import json
import logging
import os
import re
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from contextrender_adapters.core import content_text
from contextrender_adapters.streams import Decoder, StreamAnswer, body_answer

__all__ = ["Backend", "create_app", "derive_session", "register", "SESSION_HEADER", "STATUS_HEADER"]

log = logging.getLogger("contextrender.proxy")

SESSION_HEADER = "x-contextrender-session"
STATUS_HEADER = "x-contextrender-status"
# Seconds the upstream may stay silent (before its headers, or between two chunks) before a 504.
DEFAULT_UPSTREAM_TIMEOUT = 600.0
_DIGITS = re.compile(r"\d+")
# Engine errors that are the request's fault (malformed messages, a rewrite refused, too large).
_REQUEST_FAULTS = {400, 409, 413, 422}
DEFAULT_SELECTOR = "contextrender"
# Sessions whose stored answers the proxy remembers (oldest forgotten first).
MAX_SESSIONS = 10_000
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


# ---------------------------------------------------------------- the proxy


def _raw(headers: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(k.encode("latin-1"), v.encode("latin-1")) for (k, v) in headers]


class _SessionState:
    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.turn = 0
        self.answers: dict[int, dict] = {}
        # Whether its last request went upstream unmanaged (warned once until it is managed again).
        self.unmanaged = False


def _error(status: int, message: str, kind: str) -> JSONResponse:
    """An error in OpenAI's shape."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


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


class _Proxy:
    def __init__(
        self, backend: Backend, upstream: str, budget: int, selector: str, fail_closed: bool,
        client: httpx.AsyncClient | None = None, upstream_timeout: float = DEFAULT_UPSTREAM_TIMEOUT,
    ) -> None:
        self.backend = backend
        self.upstream = upstream.rstrip("/")
        self.budget = budget
        self.selector = selector or DEFAULT_SELECTOR
        self.fail_closed = fail_closed
        self.client = client
        self.upstream_timeout = upstream_timeout
        # Per session, least recently used first: its lock, its request count, and the answers
        # the proxy stored, by their position in the message list.
        self._sessions: OrderedDict[str, _SessionState] = OrderedDict()

    # -- upstream plumbing

    def url(self, path: str, query: str) -> str:
        rest = path[3:] if path == "/v1" or path.startswith("/v1/") else path
        return self.upstream + rest + (f"?{query}" if query else "")

    async def forward(
        self, request: Request, body: bytes, on_answer: Callable[[dict], BackgroundTask | None] | None = None,
        status: str = "",
    ) -> Response:
        """The upstream's answer to `body`; `status` goes back in X-ContextRender-Status. Until the
        answer streams, a client that leaves cancels the upstream call (then StreamingResponse
        does: it cancels `relay`)."""
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            return await self._forward(request, body, on_answer, status, gone)
        except _ClientGone:
            log.info("client left before the upstream answered %s; upstream call cancelled", request.url.path)
            return Response(status_code=499)
        finally:
            gone.cancel()

    async def _forward(
        self, request: Request, body: bytes, on_answer: Callable[[dict], BackgroundTask | None] | None,
        status: str, gone: asyncio.Future,
    ) -> Response:
        headers = [(k, v) for (k, v) in request.headers.items() if k.lower() not in _REQUEST_SKIP]
        # A bare httpx.Request: the client's default headers (User-Agent, Accept-Encoding) would
        # otherwise be added to what the agent sent.
        upstream_request = httpx.Request(
            request.method, self.url(request.url.path, request.url.query), headers=headers, content=body,
        )
        try:
            response = await _unless_gone(gone, self.client.send(upstream_request, stream=True))
        except httpx.TimeoutException as exc:
            return self.timed_out(exc)
        except httpx.HTTPError as exc:
            log.warning("upstream %s unreachable: %s", self.upstream, exc)
            return _error(502, f"ContextRender proxy: upstream {self.upstream} failed: {exc}", "upstream_error")
        out_headers = [(k, v) for (k, v) in response.headers.multi_items() if k.lower() not in _RESPONSE_SKIP]
        out_headers += [(STATUS_HEADER, status)] if status else []
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
                return self.timed_out(exc)
            except httpx.HTTPError as exc:
                log.warning("upstream %s closed its answer early: %s", self.upstream, exc)
                return _error(502, f"ContextRender proxy: upstream {self.upstream} closed its answer before the end: {exc}", "upstream_error")
            finally:
                await response.aclose()
            task = None  # a chat-completions answer (JSON): read whole to ingest it
            if wants_answer and decoder.ok:
                answer = body_answer(decoder.feed(raw))
                task = on_answer(_normal(answer)) if answer else None
            plain = Response(raw, status_code=response.status_code, background=task)
            plain.raw_headers = _raw(out_headers) + [(b"content-length", str(len(raw)).encode())]
            return plain

        stream = StreamAnswer()
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
            if wants_answer and decoder.ok and stream.done:
                stream.feed(b"\n")
                answer = stream.answer()
                task = on_answer(_normal(answer)) if answer else None
                if task:
                    tasks.append(task)

        async def after() -> None:
            for task in tasks:
                await task()

        streaming = StreamingResponse(relay(), status_code=response.status_code, background=BackgroundTask(after))
        streaming.raw_headers = _raw(out_headers)
        return streaming

    def timed_out(self, exc: Exception) -> Response:
        log.warning("upstream %s timed out: %s", self.upstream, type(exc).__name__)
        return _error(504, f"ContextRender proxy: upstream {self.upstream} sent nothing for {self.upstream_timeout:g} s (--upstream-timeout)", "upstream_timeout")

    # -- sessions

    def session(self, session_id: str) -> _SessionState:
        """The session's state, marked as just used; the least recently used idle sessions are
        forgotten beyond MAX_SESSIONS (their answers then match by normal form only)."""
        state = self._sessions.get(session_id)
        if state is None:
            state = self._sessions[session_id] = _SessionState()
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > MAX_SESSIONS:
            (oldest, old) = next(iter(self._sessions.items()))
            if old.lock.locked():
                break  # in use: forget it later
            del self._sessions[oldest]
        return state

    def reconcile(self, session_id: str, messages: list) -> list:
        """The message list as the session stores it: assistant messages in normal form, and
        each answer the proxy stored in place of the agent's copy of it (agents rebuild answers
        from streams or SDK objects: `content` "" for null, extra keys in tool calls). Without
        this the engine, which compares exactly, would take every echoed answer for a rewrite."""
        messages = [_normal(m) for m in messages]
        stored = self.session(session_id).answers
        for position in sorted(stored):
            if position < len(messages) and _same_turn(messages[position], stored[position]):
                messages[position] = stored[position]
                continue
            # History rewritten (or cut) here: the engine forks; later answers are on the old branch.
            for later in [p for p in stored if p >= position]:
                del stored[later]
            break
        return messages

    def answered(self, session_id: str, turn: int, position: int) -> Callable[[dict], BackgroundTask | None]:
        def record(message: dict) -> BackgroundTask | None:
            state = self.session(session_id)
            if state.turn != turn:
                return None  # a later request of the session has been rendered meanwhile
            state.answers[position] = message
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
        except RecursionError:
            return _error(400, "ContextRender proxy: the JSON body is nested too deeply", "invalid_request_error")
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            # Not ours to judge: the upstream answers it.
            return await self.forward(request, raw, status="unmanaged; reason=no_messages_list")
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
        state.unmanaged = False
        body["messages"] = rendered
        try:
            out = json.dumps(body, ensure_ascii=False).encode()
        except RecursionError:
            return _error(400, "ContextRender proxy: the JSON body is nested too deeply", "invalid_request_error")
        return await self.forward(request, out, on_answer=self.answered(session_id, turn, len(messages)), status="managed")

    async def engine_failed(self, request: Request, raw: bytes, session_id: str, exc: Exception) -> Response:
        status = getattr(exc, "status", 500)
        if self.fail_closed:
            # The request's own faults go back as such; anything else (the server down, an
            # expired login) is the proxy's failure, not the agent's: 502.
            code = status if status in _REQUEST_FAULTS else 502
            kind = "invalid_request_error" if code != 502 else "contextrender_error"
            return _error(code, f"ContextRender: {exc}", kind)
        # Fail-open: the agent gets its answer, and the header says the history went unmanaged;
        # the log says why once, not at every call of a session that keeps failing.
        state = self.session(session_id)
        if not state.unmanaged:
            state.unmanaged = True
            log.warning("session %s: render failed, forwarding requests unmanaged until it works again: %s: %s",
                        session_id, type(exc).__name__, exc)
        return await self.forward(request, raw, status=f"unmanaged; reason={type(exc).__name__}")


def create_app(
    backend: Backend,
    upstream: str,
    budget: int,
    selector: str = DEFAULT_SELECTOR,
    fail_closed: bool = False,
    upstream_timeout: float | None = None,
) -> FastAPI:
    """The proxy as an ASGI app (serve it with uvicorn). `backend` is an `Engine` or a `Client`.
    `upstream_timeout`: seconds of upstream silence before a 504 (default
    $CONTEXTRENDER_UPSTREAM_TIMEOUT or 600)."""
    if not isinstance(budget, int) or budget <= 0:
        raise ValueError(f"budget must be a positive number of tokens (got {budget!r})")
    if upstream_timeout is None:
        upstream_timeout = float(os.environ.get("CONTEXTRENDER_UPSTREAM_TIMEOUT", DEFAULT_UPSTREAM_TIMEOUT))
    if not upstream_timeout > 0:
        raise ValueError(f"upstream_timeout must be a positive number of seconds (got {upstream_timeout!r})")
    proxy = _Proxy(backend, upstream, budget, selector, fail_closed, upstream_timeout=upstream_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(upstream_timeout, connect=30.0, pool=None)
        async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
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

    from contextrender_adapters.core import SELECTORS

    if args.selector not in SELECTORS:
        # Checked here: once serving, a bad selector would fail every request open.
        raise SystemExit(f"contextrender proxy: unknown selector {args.selector!r}; known: {', '.join(SELECTORS)}")

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(_backend(args), args.upstream, args.budget, args.selector, args.fail_closed, args.upstream_timeout)
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
    parser.add_argument("--upstream-timeout", type=float, default=None,
                        help=f"seconds the upstream may send nothing before a 504 (default $CONTEXTRENDER_UPSTREAM_TIMEOUT or {DEFAULT_UPSTREAM_TIMEOUT:g})")
    parser.set_defaults(func=run)
