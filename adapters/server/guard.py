"""The server's request guard (ASGI middleware): refused routes, the body limit and read
timeout, the JSON checks, a walker body's unknown fields, one request at a time per session, and
walker errors with their own statuses (`walker_errors.py`)."""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
import time
from typing import Any

from contextrender.limits import BodyRefused, body_timeout, max_body_bytes, read_body, replaying
from contextrender.locks import KeyedLocks
from contextrender.server.errors import map_walker_error
from contextrender.settings import start_setting

__all__ = ["REFUSED_PREFIXES", "ClientWatch", "RequestGuard", "body_timeout", "json_problem", "max_body_bytes"]

logger = logging.getLogger("contextrender.server")

# The walker that makes a session (the request guard calls it ahead of a new session's first call).
CREATE_WALKER = "create_session"
# Sessions the per-session lock remembers as existing (the least recently used are forgotten).
MAX_KNOWN_SESSIONS = 100_000
DEFAULT_MAX_STORED_MB = 1024
# Seconds a user's stored total (list_sessions) is trusted before it is read again; the bytes
# this process accepted since are added to it meanwhile.
STORED_REFRESH = 5.0
# A longer body is checked in a worker thread, off the event loop all requests' I/O runs on.
OFF_LOOP_BYTES = 256 * 1024


def max_stored_bytes() -> int:
    """CONTEXTRENDER_MAX_STORED_MB: the most bytes of events one user may store (default 1024 MB)."""
    return int(start_setting("CONTEXTRENDER_MAX_STORED_MB", DEFAULT_MAX_STORED_MB, unit="MB") * 1024 * 1024)


# Route prefixes that are not ContextRender's: module functions, the client-app error log.
REFUSED_PREFIXES = {"/function/": "ContextRender serves no /function routes; its endpoints are POST /walker/<name>",
                    "/cl/": "ContextRender serves no client app"}


def json_problem(body: bytes) -> tuple[Any, str]:
    """(the parsed body, why it is refused or ""): NaN/Infinity, lone UTF-16 surrogates (from
    `\\udc80` escapes) or nesting deeper than the engine's MAX_DEPTH anywhere in the body, by the
    engine's own rules for a message, so that no route (jac-scale's included) fails on them. A body
    that is not JSON parses to None with no problem: the route answers it (FastAPI's 422)."""
    from contextrender.core import MAX_DEPTH, InvalidRequest, check_message

    try:
        value = json.loads(body)
    except RecursionError:
        return None, f"the JSON body is nested more than {MAX_DEPTH} levels deep"
    except ValueError:
        return None, ""
    try:
        check_message("", value)
    except InvalidRequest as err:
        return None, str(err)
    return value, ""


async def checked_json(body: bytes) -> tuple[Any, str]:
    """`json_problem(body)`, in a worker thread for a body over OFF_LOOP_BYTES: on the loop, a 6 MB
    body's check held every other request's I/O for seconds (a thread yields at each switch interval)."""
    if len(body) <= OFF_LOOP_BYTES:
        return json_problem(body)
    return await asyncio.to_thread(json_problem, body)


def _json_response(status: int, code: str, message: str, close: bool = False) -> tuple[dict, bytes]:
    body = json.dumps({"ok": False, "type": "error", "data": None, "error": {"code": code, "message": message}})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    start = {"type": "http.response.start", "status": status, "headers": headers + ([(b"connection", b"close")] if close else [])}
    return start, body.encode()


def _reported_value(payload: bytes) -> Any:
    """The one report of a walker's answer, whatever it is (None when it has none)."""
    try:
        reports = (json.loads(payload).get("data") or {}).get("reports") or [None]
    except (ValueError, AttributeError):
        return None
    return reports[0]


def _reported(payload: bytes) -> dict:
    """The one report of a walker's answer ({} when it has none)."""
    report = _reported_value(payload)
    return report if isinstance(report, dict) else {}


class _Refused(Exception):
    def __init__(self, status: int, code: str, message: str, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.close = status, code, message, close


class ClientWatch:
    """Whether a request's client has left, once its body is read: the next ASGI message is then
    the disconnect (the client closed the connection), or, when the answer is complete, the
    server's own. `left` is set when the client has gone before its answer started (`send`
    marks that); the app's own reads after the body (`receive`) get the same message."""

    def __init__(self, receive: Any) -> None:
        self.left = threading.Event()
        self.answered = False
        self._next = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Any) -> dict:
        message = await receive()
        if message["type"] == "http.disconnect" and not self.answered:
            self.left.set()
        return message

    def sending(self, send: Any) -> Any:
        """`send`, marking the answer started at its first message."""
        async def watched(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.answered = True
            await send(message)

        return watched

    async def receive(self) -> dict:
        return await asyncio.shield(self._next)

    def stop(self) -> None:
        self._next.cancel()


class RequestGuard:
    """ASGI middleware, inside jac-scale's CORS and login middleware (a request without a token
    gets 401 before its fields are checked; every answer gets the CORS headers).

    Every HTTP request: refused routes, the admin portal when it is off, the body limit and read
    timeout, the JSON checks. `/walker/` requests also: unknown fields, the per-session lock and
    the error statuses. `fields_of(name, caller)` gives a walker's request fields (None: not ours
    to check, such as a walker that needs a login the request lacks: it answers 401 itself)."""

    def __init__(self, app: Any, limit: int | None = None, fields_of: Any = None, admin: bool = False,
                 timeout: float | None = None, root_writers: set[str] | frozenset = frozenset(),
                 max_stored: int | None = None) -> None:
        self.app = app
        self.limit = max_body_bytes() if limit is None else limit
        self.timeout = body_timeout() if timeout is None else timeout
        self.fields_of = fields_of or (lambda name, caller: None)
        self.admin = admin
        self.locks = KeyedLocks()  # by (user, session_id), and by (user,)
        # Walkers that may add or remove a session under the caller's root, and the sessions
        # (user, session_id) this process has answered, most recent last.
        self.root_writers = root_writers
        self.known: collections.OrderedDict = collections.OrderedDict()
        # The per-user quota on stored bytes, and each user's total as last read: (when, bytes).
        self.max_stored = max_stored_bytes() if max_stored is None else max_stored
        self.stored: collections.OrderedDict = collections.OrderedDict()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        from contextrender import core

        # Counted while in progress: a long call gives way to the others (engine/courtesy.jac).
        core.CALLS.enter()
        token = core.TURN.set(turn := core.CallTurn())
        try:
            await self.guarded(scope, receive, send)
        finally:
            core.TURN.reset(token)
            core.CALLS.leave(turn)

    async def guarded(self, scope: dict, receive: Any, send: Any) -> None:
        from contextrender import core
        path = scope["path"]
        try:
            self.check_route(path)
            body = await self.read_body(scope, receive)
            if body is None:
                # One line, and an answer nobody reads: returning none would make jac-scale's
                # middleware log a traceback ("No response returned").
                logger.info("%s: the client closed the connection before its request body was complete", path)
                raise _Refused(499, "CLIENT_LEFT", "the client left before its request body was complete")
            if len(body) > OFF_LOOP_BYTES:  # a long call from its body on (engine/courtesy.jac)
                core.CALLS.hold_collections(core.TURN.get())
            parsed, problem = (await checked_json(body)) if body else (None, "")
            if problem:
                raise _Refused(400, "INVALID_JSON", problem)
            caller = (scope.get("state") or {}).get("username")
            walker = path.removeprefix("/walker/") if path.startswith("/walker/") else None
            if walker is not None:
                unknown = self.unknown_fields(walker, caller, parsed)
                if unknown:
                    raise _Refused(400, "UNKNOWN_FIELD", unknown)
        except _Refused as refused:
            start, payload = _json_response(refused.status, refused.code, refused.message, refused.close)
            await send(start)
            await send({"type": "http.response.body", "body": payload})
            return

        replay = replaying({"type": "http.request", "body": body, "more_body": False}, receive)

        if walker is None:
            await self.app(scope, replay, send)
            return
        session_id = parsed.get("session_id") if isinstance(parsed, dict) else None
        if not (caller and isinstance(session_id, str)):
            await self.app(scope, replay, self.mapped(send))
            return
        key = (caller, session_id)
        watch = ClientWatch(receive)
        # The walker's thread gets a copy of this context: the walker sees `watch.left` (engine/cancel.jac).
        token = core.CLIENT_LEFT.set(watch.left)
        try:
            async with self.locks.hold_async(key):
                if watch.left.is_set():
                    logger.info("%s of %s: the client left while the call waited for its session; not run", walker, caller)
                    start, payload = _json_response(499, "CLIENT_LEFT", "the client left before the call ran; nothing was written")
                    await send(start)
                    await send({"type": "http.response.body", "body": payload})
                    return
                status = await self.serve(scope, body, walker, key, watch, watch.sending(send))
            if watch.left.is_set():
                logger.info("%s of %s: the client left before its answer; %s", walker, caller,
                            "the call stopped at a safe point, nothing of it was written" if status == 499
                            else f"the call had passed its last safe point and finished ({status})")
        finally:
            core.CLIENT_LEFT.reset(token)
            watch.stop()

    async def serve(self, scope: dict, body: bytes, walker: str, key: tuple, watch: ClientWatch, send: Any) -> int:
        """A walker call on session `key`, its lock held. A call that may create or delete a session
        changes the user's root (its directory shelf), which jaclang commits optimistically: such
        calls on different sessions would retry each other and could fail (a 500 after five
        attempts), or, before the retry existed, make a session twice or lose one. So the user's
        lock serialises the creation of a new session, a call of its own (`create_session`,
        committed at once), and `delete_session`; the call itself then runs on the session that
        now exists, beside the user's other calls. A call that fails after its session was made
        for it deletes it again if nothing was stored in it: a refused first call leaves no session.
        Returns the status answered."""
        (caller, session_id) = key
        replay = replaying({"type": "http.request", "body": body, "more_body": False}, watch.receive)
        answered: dict[str, int] = {}
        created = False
        if walker == "delete_session" or (walker == CREATE_WALKER and key not in self.known):
            async with self.locks.hold_async((caller,)):
                await self.app(scope, replay, self.mapped(send, answered))
        else:
            if walker in self.root_writers and walker != "delete_session":
                over = await self.over_quota(scope, caller, watch)
                if over:
                    start, payload = _json_response(403, "QUOTA_EXCEEDED", over)
                    await send(start)
                    await send({"type": "http.response.body", "body": payload})
                    return 403
            if walker in self.root_writers and key not in self.known:
                async with self.locks.hold_async((caller,)):
                    (start, payload) = await self.subcall(scope, CREATE_WALKER, {"session_id": session_id}, watch)
                if start["status"] >= 300:
                    await send(start)
                    await send({"type": "http.response.body", "body": payload})
                    return start["status"]
                created = _reported(payload).get("created") is True
                self.remember(key)
            await self.app(scope, replay, self.mapped(send, answered))
        if walker == "delete_session":
            self.known.pop(key, None)
            self.stored.pop(caller, None)
        elif answered.get("status", 500) < 300:
            self.remember(key)
            if caller in self.stored:  # at most what this call stored, until the total is read again
                (when, total) = self.stored[caller]
                self.stored[caller] = (when, total + len(body))
        elif created:
            # The client did not get the session it asked for: take back the empty one made for it
            # (even when the client has left: the call is ours now).
            from contextrender import core

            token = core.CLIENT_LEFT.set(None)
            try:
                async with self.locks.hold_async((caller,)):
                    await self.subcall(scope, "delete_session", {"session_id": session_id, "if_empty": True}, watch)
            finally:
                core.CLIENT_LEFT.reset(token)
            self.known.pop(key, None)
        return answered.get("status", 500)

    async def subcall(self, scope: dict, walker: str, fields: dict, watch: ClientWatch) -> tuple[dict, bytes]:
        """Call `walker` with `fields` as the request's caller (its login and headers), through the
        app the request goes to; its answer (the start message with the mapped status, the body)."""
        body = json.dumps(fields).encode()
        path = f"/walker/{walker}"
        headers = [(k, v) for (k, v) in scope.get("headers") or [] if k.lower() not in (b"content-length", b"transfer-encoding")]
        sub = dict(scope, path=path, raw_path=path.encode(), headers=headers + [(b"content-length", str(len(body)).encode())])
        answer: dict[str, Any] = {"chunks": []}

        async def capture(message: dict) -> None:
            if message["type"] == "http.response.start":
                answer["start"] = message
            elif message["type"] == "http.response.body":
                answer["chunks"].append(message.get("body", b""))

        await self.app(sub, replaying({"type": "http.request", "body": body, "more_body": False}, watch.receive),
                       self.mapped(capture))
        start = answer.get("start") or {"type": "http.response.start", "status": 500, "headers": []}
        return start, b"".join(answer["chunks"])

    async def over_quota(self, scope: dict, caller: str, watch: ClientWatch) -> str:
        """Why `caller` may store nothing more ("" while under the quota on stored bytes): their
        sessions' total (list_sessions, read again after STORED_REFRESH seconds) at the quota."""
        now = time.monotonic()
        cached = self.stored.get(caller)
        if cached is None or now - cached[0] > STORED_REFRESH:
            (start, payload) = await self.subcall(scope, "list_sessions", {}, watch)
            sessions = _reported_value(payload) if start["status"] < 300 else None
            if not isinstance(sessions, list):
                return ""  # not known: the call decides (it answers the same failure)
            cached = (now, sum(int(s.get("stored_bytes") or 0) for s in sessions if isinstance(s, dict)))
            self.stored[caller] = cached
            self.stored.move_to_end(caller)
            while len(self.stored) > MAX_KNOWN_SESSIONS:
                self.stored.popitem(last=False)
        if cached[1] < self.max_stored:
            return ""
        return (f"this user stores {cached[1]} bytes of events, the most allowed (CONTEXTRENDER_MAX_STORED_MB="
                f"{self.max_stored / 1024 / 1024:g}); nothing was written: delete sessions (delete_session) or raise the setting")

    def remember(self, key: tuple) -> None:
        """`key` is a session this process has seen exist (the least recently used are forgotten)."""
        self.known[key] = True
        self.known.move_to_end(key)
        while len(self.known) > MAX_KNOWN_SESSIONS:
            self.known.popitem(last=False)

    def check_route(self, path: str) -> None:
        if path == "/admin" or path.startswith("/admin/"):
            if not self.admin:
                raise _Refused(404, "NOT_FOUND", "the admin portal is off: set CONTEXTRENDER_ADMIN_PASSWORD to a strong password to turn it on")
        for prefix, why in REFUSED_PREFIXES.items():
            if path.startswith(prefix):
                raise _Refused(404, "NOT_FOUND", why)
        if path.startswith("/walker/") and "/" in path.removeprefix("/walker/").rstrip("/"):
            # jac-scale's /walker/<name>/<node_id> spawns the walker on any node id, another user's
            # included; every ContextRender walker starts at the caller's root.
            raise _Refused(404, "NOT_FOUND", "walkers are not addressed to node ids: POST /walker/<name> with the session_id in the body")

    async def read_body(self, scope: dict, receive: Any) -> bytes | None:
        """The whole body (within the limit, declared or chunked) before the app reads it. A client
        that pauses longer than the timeout mid-body, or takes ten times it overall, gets 408."""
        try:
            return await read_body(scope, receive, self.limit, self.timeout,
                                   "send fewer messages per call (append=true takes only new events) or raise CONTEXTRENDER_MAX_BODY_MB")
        except BodyRefused as refused:
            raise _Refused(refused.status, refused.code, refused.message, refused.close) from None

    def mapped(self, send: Any, answered: dict | None = None) -> Any:
        """`send` with jac-scale's 500 for a walker error replaced by the error's own status (the
        status sent goes in `answered`)."""
        state: dict[str, Any] = {}
        answered = {} if answered is None else answered

        async def mapped_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                answered["status"] = message["status"]
            if message["type"] == "http.response.start" and message["status"] == 500:
                state["start"], state["chunks"] = message, []
                return
            if "start" not in state:
                await send(message)
                return
            state["chunks"].append(message.get("body", b""))
            if message.get("more_body"):
                return
            raw = b"".join(state["chunks"])
            try:
                status, envelope = map_walker_error(json.loads(raw))
                raw = json.dumps(envelope).encode()
            except (ValueError, AttributeError):
                status = 500
            answered["status"] = status
            start = dict(state["start"], status=status)
            start["headers"] = [(k, v) for (k, v) in start["headers"] if k.lower() != b"content-length"]
            start["headers"].append((b"content-length", str(len(raw)).encode()))
            await send(start)
            await send({"type": "http.response.body", "body": raw})

        return mapped_send

    def unknown_fields(self, walker: str, caller: str | None, body: Any) -> str:
        """What to fix when the body names fields the walker does not have ("" when none)."""
        fields = self.fields_of(walker, caller)
        if fields is None or not isinstance(body, dict):
            return ""  # not JSON, or not an object: FastAPI answers 422
        unknown = sorted(set(body) - fields)
        if not unknown:
            return ""
        return f"{walker} has no field {', '.join(map(repr, unknown))}; its fields: {', '.join(sorted(fields))}"
