"""The proxy's routes: the ASGI app (`create_app`), and what happens to one conversation request
in any format: its per-request settings read, its session named, the history rendered (or the
request forwarded unmanaged, fail-open, when the engine fails), and the result forwarded."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from contextrender.core import RESTORE_TOOL, InvalidRequest, cache_bytes_setting
from contextrender.inspector import routes as inspector
from contextrender.metrics import CountRequests, ProxyMetrics, metrics_response
from contextrender.proxy.admission import Admission, allowed_origins_setting
from contextrender.proxy.bodies import Bodies, unnamed_key
from contextrender.proxy.defaults import DEFAULT_ANSWER_DELAY, DEFAULT_RESTORE_ROUNDS, DEFAULT_SELECTOR, DEFAULT_UPSTREAM_TIMEOUT
from contextrender.proxy.interfaces import Backend, Format, field, sent_unchanged
from contextrender.proxy.protocols import PROTOCOLS, Protocol, format_of_path, format_of_request
from contextrender.proxy.restores import RequestRounds, Restores, encoded_body, first_body
from contextrender.proxy.sessions import Sessions, chain_events, derive_session, model_encoding, named_session
from contextrender.proxy.upstream import Upstream, error
from contextrender.settings import positive_number

__all__ = ["BUDGET_HEADER", "DEFAULT_SELECTOR", "READY_PATH", "SELECTOR_HEADER", "SESSION_HEADER", "SESSION_NAME_HEADER", "STATUS_HEADER",
           "UNMANAGED_HEADER", "create_app", "session_of"]

log = logging.getLogger("contextrender.proxy")

SESSION_HEADER = "x-contextrender-session"
STATUS_HEADER = "x-contextrender-status"
BUDGET_HEADER = "x-contextrender-budget"
SELECTOR_HEADER = "x-contextrender-selector"
# Why a conversation request was forwarded without a render (absent when it was rendered).
UNMANAGED_HEADER = "x-contextrender-unmanaged"
# The session's name as the agent sent it, when its key (`X-ContextRender-Session` of the answer)
# is a digest of it.
SESSION_NAME_HEADER = "x-contextrender-session-name"
# Engine errors that are the request's fault (malformed messages, a rewrite refused, too large).
_REQUEST_FAULTS = {400, 409, 413, 422}
_TOO_DEEP = "ContextRender proxy: the JSON body is nested too deeply"
# The share of CONTEXTRENDER_INDEX_CACHE_MB the last bodies of the sessions may hold (bodies.py).
BODY_SHARE = 16
# The proxy's own readiness endpoint (never forwarded).
READY_PATH = "/contextrender/ready"


def _header(request: Request, name: str) -> str:
    """A request header's value read as UTF-8 (Starlette reads the bytes as Latin-1)."""
    return request.headers[name].encode("latin-1").decode("utf-8", "replace")


def session_of(request: Request, messages: list[dict]) -> tuple[str, str]:
    """The session of a request, its key and its name: the one `X-ContextRender-Session` names
    (its bytes read as UTF-8; `named_session` says which key), else one derived from the
    conversation (`derive_session`)."""
    sent = request.headers.get(SESSION_HEADER)
    if sent:
        # Starlette decodes header bytes as Latin-1: encoded back, they are the bytes as sent.
        return named_session(sent.encode("latin-1"))
    session_id = derive_session(messages)
    return session_id, session_id


def _shown(session_id: str, name: str) -> str:
    """A session as the log names it: its name as sent, with its key when that differs."""
    return session_id if name in ("", session_id) else f"{name!r} (key {session_id})"


def without_restore_tool(messages: list[dict]) -> list[dict]:
    """A rendered history for a request that is not offered the restore tool: the restore hints
    in the texts ContextRender wrote (stubs, notes, the fold marker) name no tool
    (engine/notices.jac `without_restore_tool`); nothing else changes."""
    from contextrender.core import without_restore_tool as rewrite

    def text(value: Any) -> Any:
        if isinstance(value, str):
            return rewrite(value) if RESTORE_TOOL in value else value
        if isinstance(value, list):
            return [dict(p, text=text(p["text"])) if isinstance(p, dict) and isinstance(p.get("text"), str) else p for p in value]
        return value

    out = []
    for message in messages:
        content = message.get("content")
        changed = text(content)
        out.append(message if changed == content else dict(message, content=changed))
    return out


def _summary_headers(session_id: str, name: str, result: Any) -> list[tuple[str, str]]:
    named = [(SESSION_NAME_HEADER, name)] if name and name != session_id else []
    return named + [
        ("x-contextrender-session", session_id),
        ("x-contextrender-history-tokens", str(result.history_tokens)),
        ("x-contextrender-kept", str(result.kept)),
        ("x-contextrender-omitted", str(result.omitted)),
        ("x-contextrender-folded", str(result.folded_messages)),
    ]


class _Proxy:
    def __init__(
        self, backend: Backend, upstream: str, budget: int, selector: str, fail_closed: bool,
        client: httpx.AsyncClient | None = None, upstream_timeout: float = DEFAULT_UPSTREAM_TIMEOUT,
        restore_rounds: int = DEFAULT_RESTORE_ROUNDS, answer_delay: float = DEFAULT_ANSWER_DELAY,
    ) -> None:
        self.backend = backend
        self.restore_rounds = restore_rounds
        self.upstream = Upstream(upstream, upstream_timeout, client)
        self.budget = budget
        self.selector = selector or DEFAULT_SELECTOR
        self.fail_closed = fail_closed
        self.sessions = Sessions(backend, answer_delay)
        # The last body of each session, parsed again only where it changed (bodies.py).
        self.bodies = Bodies(cache_bytes_setting() // BODY_SHARE)
        self.restores = Restores(self.upstream, self.sessions, backend, restore_rounds)
        self.metrics = ProxyMetrics({p.path: p.name for p in PROTOCOLS})
        self.restores.metrics = self.metrics

    def controls(self, request: Request) -> tuple[int, str]:
        """The budget and selector of this request: the proxy's, or its `X-ContextRender-Budget`
        and `X-ContextRender-Selector` headers (checked: InvalidRequest names the header)."""
        # Imported here: the renderer loads byLLM, which `contextrender --help` need not wait for.
        from contextrender.core import MIN_BUDGET, render_settings

        budget, selector = self.budget, self.selector
        if BUDGET_HEADER in request.headers:
            value = _header(request, BUDGET_HEADER).strip()
            if not value.isdigit() or int(value) < MIN_BUDGET:
                raise InvalidRequest(f"X-ContextRender-Budget must be a whole number of tokens >= {MIN_BUDGET} (got {value!r})")
            budget = int(value)
        if SELECTOR_HEADER in request.headers:
            selector = _header(request, SELECTOR_HEADER).strip()
            try:
                render_settings({"selector": selector})
            except InvalidRequest as exc:
                raise InvalidRequest(f"X-ContextRender-Selector: {exc}") from exc
        return budget, selector

    async def managed(self, request: Request, protocol: Protocol) -> Response:
        """A conversation request in `protocol`, rendered and forwarded."""
        started = time.perf_counter()
        fmt = protocol.format
        try:
            budget, selector = self.controls(request)
        except InvalidRequest as exc:
            # The caller asked for this request's settings: a bad one is refused, fail-open or not.
            return error(fmt, 400, f"ContextRender: {exc}", "invalid_request_error")
        raw = await request.body()
        named = request.headers.get(SESSION_HEADER)
        try:
            key = (protocol.path, named) if named else unnamed_key(protocol.path, raw)
            body = self.bodies.parse(raw, key, protocol.history)
        except RecursionError:
            return error(fmt, 400, _TOO_DEEP, "invalid_request_error")
        except ValueError as exc:
            # Nothing is forwarded: a body that is not JSON is no request of this protocol (and a
            # cross-site `text/plain` form post is not one either).
            return error(fmt, 400, f"ContextRender proxy: the body of POST {protocol.path} must be JSON ({exc})", "invalid_request_error")
        failure: Exception | None = None
        try:
            exchange = fmt.parse(body) if isinstance(body, dict) else None
        except InvalidRequest as exc:
            exchange, failure = None, exc
        if exchange is None and failure is None:
            return error(fmt, 400, f"ContextRender proxy: {protocol.needs}", "invalid_request_error")
        messages = exchange.messages if exchange is not None else []
        (session_id, name) = session_of(request, messages)
        if failure is not None:
            return await self.engine_failed(request, raw, session_id, failure, fmt, protocol)
        state = self.sessions.session(session_id)
        state.name = name
        rounds = protocol.rounds
        if self.restore_rounds and rounds.declares(body):
            # Refused before anything is stored: the proxy would answer the agent's own tool.
            message = (f"ContextRender proxy: this request declares a tool named {RESTORE_TOOL!r}, the name "
                       "the proxy reserves for the model to take back omitted tool results. Rename your tool, or start "
                       "the proxy with --restore-rounds 0 if your agent answers that tool itself.")
            if protocol.name == "messages":
                return error(fmt, 400, message, "invalid_request_error")
            return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": "tools",
                                           "code": "contextrender_reserved_tool_name"}}, status_code=400)
        if exchange.unmanaged:
            if not state.warned:
                state.warned = True
                log.warning("session %s: forwarded without rendering: %s", _shown(session_id, name), exchange.unmanaged)
            # The reason can quote a client's item type: ASCII only in a header.
            reason = exchange.unmanaged.encode("ascii", "replace").decode()
            self.metrics.of(self.metrics.unmanaged, protocol.name, "not_renderable").inc()
            return await self.upstream.forward(request, raw, fmt, headers=[
                (STATUS_HEADER, "unmanaged; reason=not_renderable"), (UNMANAGED_HEADER, reason),
            ])
        encoding = model_encoding(exchange.model)
        async with state.lock:
            state.turn += 1
            turn = state.turn
            answer = None
            try:
                if not self.sessions.checked(session_id, state, encoding):
                    await run_in_threadpool(self.sessions.check_encoding, session_id, state, encoding)
                prepared = self.sessions.reconcile(session_id, messages)
                # The previous answer, when this request re-sends it, is stored by this render.
                answer = await self.sessions.take_answer(session_id, state, prepared)
                usage = {"usage": answer.usage} if answer is not None and answer.usage else {}
                rendering = time.perf_counter()
                result = await run_in_threadpool(
                    lambda: sent_unchanged(self.backend.render, session_id, prepared, budget=budget, selector=selector, **usage)
                )
                answer = None
                self.metrics.rendered(protocol.name, field(result, "full_history_tokens"), field(result, "history_tokens"),
                                      time.perf_counter() - rendering)
                offered = bool(self.restore_rounds) and rounds.offers(body, field(result, "omitted"), field(result, "compacted"))
                rendered = list(result.messages) if offered else without_restore_tool(list(result.messages))
                (out_body, state.previous) = exchange.build(rendered, prepared, state.previous)
                estimate = self.sessions.estimate(state, state.encoding or encoding, result, exchange.tools)
            except Exception as exc:  # noqa: BLE001 - fail-open covers every engine failure
                failure = exc
                if answer is not None:  # the render that would have stored it failed: alone, as before
                    await self.sessions.store_held(session_id, state, answer, alone=True)
        if failure is not None:
            return await self.engine_failed(request, raw, session_id, failure, fmt, protocol)
        state.unmanaged = False
        self.metrics.prefix(protocol.name, state.rendered, rendered)
        state.rendered = rendered
        try:  # encoded once: with the restore tool when it is offered (the first upstream call's body)
            out = first_body(out_body, rounds, state.encoded) if offered else encoded_body(out_body, state.encoded)
        except RecursionError:
            return error(fmt, 400, _TOO_DEEP, "invalid_request_error")
        # The one line a request gets at --log-level info.
        log.info("session %s %s: history %d -> %d tokens, %s, %.0f ms", _shown(session_id, name), protocol.name,
                 result.full_history_tokens, result.history_tokens, result.mode or "-", (time.perf_counter() - started) * 1000)
        on_answer = self.sessions.answered(session_id, turn, len(messages), estimate, chain_events(prepared), prepared)
        headers = [(STATUS_HEADER, "managed")] + _summary_headers(session_id, name, result)
        self.metrics.of(self.metrics.in_proxy_seconds, protocol.name).observe(time.perf_counter() - started)
        if offered:
            taken = RequestRounds(estimate, state.encoding or encoding, first=out)
            return await self.restores.forward(request, out_body, session_id, on_answer, headers, taken, rounds)
        return await self.upstream.forward(request, out, fmt, on_answer=on_answer, headers=headers)

    async def engine_failed(self, request: Request, raw: bytes, session_id: str, exc: Exception, fmt: Format,
                            protocol: Protocol) -> Response:
        status = getattr(exc, "status", 500)
        if self.fail_closed:
            # The request's own faults go back as such; anything else (the server down, an
            # expired login) is the proxy's failure, not the agent's: 502.
            code = status if status in _REQUEST_FAULTS else 502
            kind = "invalid_request_error" if code != 502 else "contextrender_error"
            return error(fmt, code, f"ContextRender: {exc}", kind)
        # Fail-open: the agent gets its answer, and the headers say the history went unmanaged;
        # the log says why once, not at every call of a session that keeps failing.
        state = self.sessions.session(session_id)
        self.metrics.of(self.metrics.unmanaged, protocol.name, type(exc).__name__).inc()
        if not state.unmanaged:
            state.unmanaged = True
            log.warning("session %s: render failed, forwarding requests unmanaged until it works again: %s: %s",
                        _shown(session_id, state.name), type(exc).__name__, exc)
        return await self.upstream.forward(request, raw, fmt, headers=[
            (STATUS_HEADER, f"unmanaged; reason={type(exc).__name__}"),
            (UNMANAGED_HEADER, f"render failed ({type(exc).__name__})"),
        ])


def _route(proxy: _Proxy, protocol: Protocol) -> Any:
    async def route(request: Request) -> Response:
        return await proxy.managed(request, protocol)

    return route


class Conversations:
    """ASGI middleware, the app's innermost: a POST to a protocol's path goes to `_Proxy.managed`
    directly, as its FastAPI route would send it, without the route machinery around it (FastAPI's
    per-request dependency solving and exception wrappers, Starlette's route matching). Anything
    else goes on to the app's routes, and so does a request under a `root_path` (the routes match
    it as they always did). An error raised by `managed` still reaches Starlette's outermost
    middleware (a 500); there is no HTTPException on this path for the inner one to handle."""

    def __init__(self, app: Any, proxy: _Proxy) -> None:
        self.app = app
        self.proxy = proxy
        self.protocols = {p.path: p for p in PROTOCOLS}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        protocol = self.protocols.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if protocol is None or scope.get("root_path"):
            await self.app(scope, receive, send)
            return
        response = await self.proxy.managed(Request(scope, receive, send), protocol)
        await response(scope, receive, send)


def create_app(
    backend: Backend,
    upstream: str,
    budget: int,
    selector: str = DEFAULT_SELECTOR,
    fail_closed: bool = False,
    upstream_timeout: float | None = None,
    restore_rounds: int = DEFAULT_RESTORE_ROUNDS,
    inspect: bool = True,
    allowed_origins: Iterable[str] | None = None,
    max_body: int | None = None,
    answer_delay: float | None = None,
) -> FastAPI:
    """The proxy as an ASGI app (serve it with uvicorn). `backend` is an `Engine` or a `Client`.
    `upstream_timeout`: seconds of upstream silence before a 504 (default
    $CONTEXTRENDER_UPSTREAM_TIMEOUT or 600). `restore_rounds`: restore rounds one chat-completions
    request may take (0: the restore tool is never offered). `inspect`: serve the session inspector at
    /contextrender/ (loopback clients only; adapters/inspector/routes.py). `allowed_origins`: web
    origins served beside the loopback (default $CONTEXTRENDER_ALLOWED_ORIGINS); `max_body`: the
    largest request body in bytes (default $CONTEXTRENDER_MAX_BODY_MB MB, 32) (admission.py);
    `answer_delay`: seconds an answer waits for its session's next request, to be stored with
    its render (default $CONTEXTRENDER_ANSWER_DELAY or 1; 0: stored alone after the response)."""
    if not isinstance(budget, int) or budget <= 0:
        raise ValueError(f"budget must be a positive number of tokens (got {budget!r})")
    if not isinstance(restore_rounds, int) or restore_rounds < 0:
        raise ValueError(f"restore_rounds must be an integer >= 0 (got {restore_rounds!r})")
    if upstream_timeout is None:
        upstream_timeout = float(os.environ.get("CONTEXTRENDER_UPSTREAM_TIMEOUT", DEFAULT_UPSTREAM_TIMEOUT))
    if not upstream_timeout > 0:
        raise ValueError(f"upstream_timeout must be a positive number of seconds (got {upstream_timeout!r})")
    if answer_delay is None:
        answer_delay = positive_number("CONTEXTRENDER_ANSWER_DELAY", DEFAULT_ANSWER_DELAY, unit="seconds")
    if not answer_delay >= 0:
        raise ValueError(f"answer_delay must be a number of seconds >= 0 (got {answer_delay!r})")
    proxy = _Proxy(backend, upstream, budget, selector, fail_closed, upstream_timeout=upstream_timeout, restore_rounds=restore_rounds,
                   answer_delay=answer_delay)

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
            proxy.upstream.client = client
            yield
            await proxy.sessions.store_all()  # the answers no request came back for

    app = FastAPI(title="ContextRender proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.proxy = proxy
    app.add_middleware(Conversations, proxy=proxy)  # innermost: after the admission and the count
    app.add_middleware(Admission, fmt_of=format_of_request, max_body=max_body,
                       allowed_origins=allowed_origins_setting() if allowed_origins is None else list(allowed_origins))
    # Outside the admission: its refusals are counted too.
    app.add_middleware(CountRequests, metrics=proxy.metrics)

    async def metrics(request: Request) -> Response:
        return metrics_response(proxy.metrics, request.client.host if request.client else None)

    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)

    async def ready() -> JSONResponse:
        """The proxy's readiness (served once it listens), whether or not the upstream answers."""
        return JSONResponse({"ready": True})

    app.add_api_route(READY_PATH, ready, methods=["GET"])  # before the inspector's /contextrender/ routes
    for protocol in PROTOCOLS:  # served by `Conversations`; here for a request under a root_path
        app.add_api_route(protocol.path, _route(proxy, protocol), methods=["POST"], name=protocol.name)
    if inspect:  # the session inspector (docs/inspector.md), before the passthrough route below
        app.include_router(inspector.proxy_router(backend))

    async def passthrough(request: Request, path: str) -> Response:
        return await proxy.upstream.forward(request, await request.body(), format_of_path("/" + path))

    app.add_api_route(
        "/{path:path}", passthrough, methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"],
    )
    return app
