"""What ContextRender adds to `jac start`'s HTTP server (a jaclang plugin: the `jac` entry point
`server` in pyproject.toml).

- Errors that say what to fix: a walker that raises one of ContextRender's errors answers with
  its HTTP status (400, 404, 409) and message instead of jac-scale's generic 500; other failures
  stay 500, with the traceback in the server log and never in the response.
- Request bodies: at most CONTEXTRENDER_MAX_BODY_MB (default 32; 413), arriving without a pause
  longer than CONTEXTRENDER_BODY_TIMEOUT seconds (default 30) and within ten times that (408);
  JSON without NaN/Infinity or lone surrogates and at most 64 deep (400 naming the field); a walker body
  that names a field the walker does not have gets 400 (jac-scale would drop it silently).
- One request at a time per session: calls on one (user, session_id) wait for each other, from
  reading the body to the last byte of the answer, so jaclang's commit is inside; different
  sessions run in parallel. The lock is per process (README, "Security").
- Only the caller's own graph: jac-scale's `POST /walker/<name>/<node_id>` routes (a walker spawned
  on any node id, another user's included) and `POST /function/<name>` routes (module functions
  such as `jobj`) are not served.
- No public secrets: the server refuses to start with jac-scale's built-in JWT secret or a weak
  one, and its admin portal is off unless CONTEXTRENDER_ADMIN_PASSWORD sets a strong password
  (jac-scale would create `admin` / `changeme`). CONTEXTRENDER_DEV=1 allows weak ones locally.
- CONTEXTRENDER_HOST: the interface to listen on (jac-scale always binds 0.0.0.0).

jac-scale builds its FastAPI app in its server class; this module is a jaclang plugin whose
server class is jac-scale's with these additions. jaclang loads the plugins of the `jac` entry
point group when it is imported, and the last plugin registered answers first: importing
jac-scale's plugin here registers it before this one, whatever order the entry points come in.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import gc
import json
import logging
import math
import os
import re
import secrets
import time
from typing import Any

import jac_scale.plugin  # noqa: F401  (registers jac-scale's server class hook before ours)
from jaclang.jac0core.runtime import hookimpl

from contextrender_adapters.locks import KeyedLocks

logger = logging.getLogger("contextrender.server")

PUBLIC_DEFAULT_SECRET = "supersecretkey_for_testing_only!"
MIN_SECRET_LENGTH = 32
# A secret's estimated entropy (length x the Shannon entropy of its characters) and its distinct
# characters: 48 random url-safe bytes score ~350 bits, 32 hex digits ~115, one letter repeated 0.
MIN_SECRET_BITS = 96
MIN_SECRET_DISTINCT = 10
MIN_ADMIN_PASSWORD_LENGTH = 16
MIN_ADMIN_PASSWORD_BITS = 60
MIN_ADMIN_PASSWORD_DISTINCT = 8
# jac-scale's built-in passwords (admin account, Prometheus scraping) and other first guesses.
WEAK_PASSWORDS = {"changeme", "adminpassword123", "admin", "password", "administrator", "secret"}
DEFAULT_MAX_BODY_MB = 32
DEFAULT_BODY_TIMEOUT = 30.0
# Sessions the per-session lock remembers as existing (the least recently used are forgotten).
MAX_KNOWN_SESSIONS = 100_000
# Route prefixes that are not ContextRender's: module functions, the client-app error log.
REFUSED_PREFIXES = {"/function/": "ContextRender serves no /function routes; its endpoints are POST /walker/<name>",
                    "/cl/": "ContextRender serves no client app"}

# A traceback ends with the exception: "graph.errors.InvalidRequest: message" (a message may
# run over several lines).
_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w+): ")


# ---------------------------------------------------------------- error statuses


def _error_statuses() -> dict[str, int]:
    """HTTP status of each ContextRender error class, by class name."""
    # Imported here: this module loads while jaclang itself is being imported (a plugin).
    from contextrender_adapters.core import ContextRenderError

    statuses = {ContextRenderError.__name__: ContextRenderError.status}
    pending = list(ContextRenderError.__subclasses__())
    while pending:
        cls = pending.pop()
        statuses[cls.__name__] = cls.status
        pending.extend(cls.__subclasses__())
    return statuses


def _error_code(name: str) -> str:
    """InvalidRequest -> INVALID_REQUEST."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()


def map_walker_error(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """The status and envelope for a failed walker call (jac-scale answers 500 for every error)."""
    error = body.get("error") or {}
    details = error.pop("details", None)
    if not details and str(error.get("message") or "").lower().startswith(("writeconflict", "write_conflict")):
        # jaclang gave up replaying a commit that kept conflicting with concurrent ones: nothing was
        # written (it says 409; jac-scale answers 500).
        name, status = "WriteConflict", 409
        error["message"] = f"{error.get('message')}: nothing was written; retry the request"
    else:
        # The exception that ended the walker: the first unindented line after the frames of the
        # last traceback (an error raised while handling another comes last).
        last = str(details or "").rpartition("Traceback (most recent call last):")[2]
        match = next((_ERROR_LINE.match(line) for line in last.splitlines() if line and not line[0].isspace()), None)
        name = match.group(1) if match else ""
        status = _error_statuses().get(name)
    if status is None or status >= 500:
        if details:
            logger.error("walker failed: %s\n%s", error.get("message"), details)
        return 500, body
    error["code"] = _error_code(name)
    body["error"] = error
    if isinstance(body.get("meta"), dict) and isinstance(body["meta"].get("extra"), dict):
        body["meta"]["extra"]["http_status"] = status
    return status, body


# ---------------------------------------------------------------- settings


def max_body_bytes() -> int:
    return int(float(os.environ.get("CONTEXTRENDER_MAX_BODY_MB", DEFAULT_MAX_BODY_MB)) * 1024 * 1024)


def body_timeout() -> float:
    return float(os.environ.get("CONTEXTRENDER_BODY_TIMEOUT", DEFAULT_BODY_TIMEOUT))


def strength_problem(value: str, min_length: int, min_bits: float, min_distinct: int) -> str:
    """Why `value` is too weak to be a secret ("" when it is not): too short, too few distinct
    characters, or too little estimated entropy (a repeated pattern)."""
    if len(value) < min_length:
        return f"is shorter than {min_length} characters"
    counts = collections.Counter(value)
    if len(counts) < min_distinct:
        return f"has only {len(counts)} distinct characters (at least {min_distinct} needed)"
    bits = -len(value) * sum(n / len(value) * math.log2(n / len(value)) for n in counts.values())
    if bits < min_bits:
        return f"has about {bits:.0f} bits of entropy (at least {min_bits} needed: use random characters)"
    return ""


def require_strong(what: str, value: str, advice: str, length: int, bits: float, distinct: int) -> None:
    """Refuse to start with a public or weak secret (CONTEXTRENDER_DEV=1: a warning instead)."""
    public = value == PUBLIC_DEFAULT_SECRET or value.lower() in WEAK_PASSWORDS
    problem = "is a well-known default" if public else strength_problem(value, length, bits, distinct)
    if not problem:
        return
    if os.environ.get("CONTEXTRENDER_DEV") == "1":
        logger.warning("%s %s: acceptable only because CONTEXTRENDER_DEV=1", what, problem)
        return
    raise SystemExit(f"ContextRender refuses to start: {what} {problem}. {advice}")


def check_jwt_secret(secret: str) -> None:
    require_strong(
        "the JWT secret", secret,
        "Anyone could forge tokens: set CONTEXTRENDER_JWT_SECRET to a random string of 32+ characters "
        "(scripts/serve.sh makes one: python -c 'import secrets; print(secrets.token_urlsafe(48))'), "
        "or set CONTEXTRENDER_DEV=1 for a local test server.",
        MIN_SECRET_LENGTH, MIN_SECRET_BITS, MIN_SECRET_DISTINCT,
    )


def admin_password() -> str | None:
    """CONTEXTRENDER_ADMIN_PASSWORD when it is strong (None: the admin portal stays off)."""
    password = os.environ.get("CONTEXTRENDER_ADMIN_PASSWORD") or None
    if password is not None:
        require_strong(
            "CONTEXTRENDER_ADMIN_PASSWORD", password,
            "The admin portal lists every user and reads any user's graph: give it a random password "
            "of 16+ characters, or unset CONTEXTRENDER_ADMIN_PASSWORD to keep the portal off.",
            MIN_ADMIN_PASSWORD_LENGTH, MIN_ADMIN_PASSWORD_BITS, MIN_ADMIN_PASSWORD_DISTINCT,
        )
    return password


def check_monitoring_password(monitoring: dict[str, Any]) -> None:
    """jac-scale's /metrics (off by default) takes Basic auth with a built-in default password."""
    if monitoring.get("enabled") and monitoring.get("prometheus_admin_password"):
        require_strong(
            "[plugins.scale.monitoring] prometheus_admin_password", str(monitoring["prometheus_admin_password"]),
            "Set a random password of 16+ characters, or leave monitoring off.",
            MIN_ADMIN_PASSWORD_LENGTH, MIN_ADMIN_PASSWORD_BITS, MIN_ADMIN_PASSWORD_DISTINCT,
        )


# ---------------------------------------------------------------- request checks


def json_problem(body: bytes) -> tuple[Any, str]:
    """(the parsed body, why it is refused or ""): NaN/Infinity, lone UTF-16 surrogates (from
    `\\udc80` escapes) or nesting deeper than the engine's MAX_DEPTH anywhere in the body, by the
    engine's own rules for a message, so that no route (jac-scale's included) fails on them. A body
    that is not JSON parses to None with no problem: the route answers it (FastAPI's 422)."""
    from contextrender_adapters.core import MAX_DEPTH, InvalidRequest, check_message

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


def _json_response(status: int, code: str, message: str, close: bool = False) -> tuple[dict, bytes]:
    body = json.dumps({"ok": False, "type": "error", "data": None, "error": {"code": code, "message": message}})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    start = {"type": "http.response.start", "status": status, "headers": headers + ([(b"connection", b"close")] if close else [])}
    return start, body.encode()


class _Refused(Exception):
    def __init__(self, status: int, code: str, message: str, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.close = status, code, message, close


class RequestGuard:
    """ASGI middleware, inside jac-scale's CORS and login middleware (a request without a token
    gets 401 before its fields are checked; every answer gets the CORS headers).

    Every HTTP request: refused routes, the admin portal when it is off, the body limit and read
    timeout, the JSON checks. `/walker/` requests also: unknown fields, the per-session lock and
    the error statuses. `fields_of(name, caller)` gives a walker's request fields (None: not ours
    to check, such as a walker that needs a login the request lacks: it answers 401 itself)."""

    def __init__(self, app: Any, limit: int | None = None, fields_of: Any = None, admin: bool = False,
                 timeout: float | None = None, root_writers: set[str] | frozenset = frozenset()) -> None:
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

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        try:
            self.check_route(path)
            body = await self.read_body(scope, receive)
            if body is None:
                return  # the client left
            parsed, problem = json_problem(body) if body else (None, "")
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

        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        if walker is None:
            await self.app(scope, replay, send)
            return
        session_id = parsed.get("session_id") if isinstance(parsed, dict) else None
        if not (caller and isinstance(session_id, str)):
            await self.app(scope, replay, self.mapped(send))
            return
        key = (caller, session_id)
        answered: dict[str, int] = {}
        async with self.locks.hold_async(key):
            # A call that may create or delete a session changes the user's root, which jaclang
            # commits optimistically: such calls on different sessions retry each other and can
            # fail (a 500 after five attempts). They wait for each other, per user; calls on a
            # session this process has seen answered do not.
            if walker in self.root_writers and (walker == "delete_session" or key not in self.known):
                async with self.locks.hold_async((caller,)):
                    await self.app(scope, replay, self.mapped(send, answered))
            else:
                await self.app(scope, replay, self.mapped(send, answered))
            if walker == "delete_session":
                self.known.pop(key, None)
            elif answered.get("status", 500) < 300:
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
        too_large = (f"request body exceeds {self.limit} bytes; send fewer messages per call "
                     "(append=true takes only new events) or raise CONTEXTRENDER_MAX_BODY_MB")
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            raise _Refused(413, "BODY_TOO_LARGE", too_large)
        body = bytearray()
        deadline = time.monotonic() + 10 * self.timeout
        while True:
            wait = min(self.timeout, deadline - time.monotonic())
            try:
                message = await asyncio.wait_for(receive(), timeout=max(wait, 0.0))
            except TimeoutError:
                raise _Refused(408, "BODY_TIMEOUT", f"the request body did not arrive within {self.timeout:g} s of silence "
                               f"({10 * self.timeout:g} s in all); send it whole (CONTEXTRENDER_BODY_TIMEOUT)", close=True) from None
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > self.limit:
                raise _Refused(413, "BODY_TOO_LARGE", too_large, close=True)
            if not message.get("more_body"):
                return bytes(body)

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


# ---------------------------------------------------------------- the server class


def server_class() -> type:
    from jac_scale.config_loader import get_scale_config
    from jac_scale.serve import JacAPIServer
    from starlette.middleware import Middleware

    class ContextRenderServer(JacAPIServer):
        # Jac compiles an archetype's `postinit` to the dataclass `__post_init__`.
        def __post_init__(self) -> None:
            config = get_scale_config()
            check_jwt_secret(config.get_jwt_config()["secret"])
            check_monitoring_password(config.get_monitoring_config())
            self.admin_password = admin_password()
            # jac-scale reads these when it registers the admin routes: off, or on with the
            # operator's password in place of its `changeme`.
            settings = config.load().setdefault("admin", {})
            settings["enabled"] = self.admin_password is not None
            if self.admin_password is not None:
                settings.update(default_password=self.admin_password, require_password_reset=False)
            super().__post_init__()
            # Walkers that create their session (`create`), and delete_session.
            root_writers = {name for (name, cls) in self.get_walkers().items() if getattr(cls, "create", False)}
            self.server.app.user_middleware.append(Middleware(
                RequestGuard, fields_of=self.request_fields, admin=self.admin_password is not None,
                root_writers=root_writers | {"delete_session"},
            ))
            host = os.environ.get("CONTEXTRENDER_HOST") or config.get_server_config().get("host") or "0.0.0.0"
            run_server = self.server.run_server

            def serve(*args: Any, **kwargs: Any) -> Any:
                # Load the models now, then move everything loaded so far out of the garbage
                # collector's full walks (it lives as long as the process): otherwise one of the
                # first requests pays for a walk of the whole start-up heap (about 1.6 s here).
                from contextrender_adapters import core

                core.warm_up()
                gc.collect()
                gc.freeze()
                return run_server(*args, **{**kwargs, "host": host})

            self.server.run_server = serve

        def register_admin_endpoints(self) -> None:
            super().register_admin_endpoints()
            self.settle_admin_account()

        def settle_admin_account(self) -> None:
            """The admin account's password is CONTEXTRENDER_ADMIN_PASSWORD, set again at every
            start; with the portal off, an account an older start left with jac-scale's default
            password gets a random one (set the variable to use the account again)."""
            username = get_scale_config().get_admin_config().get("username", "admin")
            users = self.user_manager
            account = users.find_user_by_identity(username)
            if account is None:
                return
            user_id = account.get("user_id", "")
            if self.admin_password is not None:
                if users.authenticate(username, self.admin_password) is None:
                    users.reset_password_by_user_id(user_id, self.admin_password)
                    logger.warning("admin account %r: password set from CONTEXTRENDER_ADMIN_PASSWORD", username)
                users.set_requires_password_reset(user_id, False)
            elif users.authenticate(username, "changeme") is not None:
                users.reset_password_by_user_id(user_id, secrets.token_urlsafe(32))
                logger.warning("admin account %r had jac-scale's default password: replaced by a random one", username)

        def _register_endpoints(self) -> None:
            super()._register_endpoints()
            # Not served (RequestGuard answers these paths with a 404 that says why): jac-scale's
            # POST /walker/<name>/{nd} (a walker spawned on any node id, another user's included),
            # POST /function/<name> for the module's functions (`jobj` among them), the client-app
            # routes, and the admin routes while the portal is off.
            refused = tuple(REFUSED_PREFIXES) + (() if self.admin_password is not None else ("/admin",))
            self.server._endpoints[:] = [e for e in self.server._endpoints
                                         if not e.path.startswith(refused) and not e.path.endswith("/{nd}")]

        def request_fields(self, walker: str, caller: str | None) -> set[str] | None:
            """The fields a request to `walker` may name (its `has` fields); None for no such walker,
            or one that needs a login the caller has not got (the walker answers 401)."""
            cls = self.get_walkers().get(walker)
            if cls is None or (caller is None and self.introspector.is_auth_required_for_walker(walker)):
                return None
            # `reports` is every walker's output, not something a request sets.
            return {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_") and f.name != "reports"}

    return ContextRenderServer


class ServerPlugin:
    @staticmethod
    @hookimpl
    def get_api_server_class() -> type:
        return server_class()
