"""What ContextRender adds to `jac start`'s HTTP server (a jaclang plugin: the `jac` entry point
`server` in pyproject.toml).

- Errors that say what to fix: a walker that raises one of ContextRender's errors answers with
  its HTTP status (400, 404, 409) and message instead of jac-scale's generic 500; other failures
  stay 500, with the traceback in the server log and never in the response.
- A request-body limit (CONTEXTRENDER_MAX_BODY_MB, default 32): larger bodies get 413; a body that
  names a field the walker does not have gets 400 (jac-scale would drop it silently).
- No public JWT secret: the server refuses to start with jac-scale's built-in test secret or a
  short one, unless CONTEXTRENDER_DEV=1 (scripts/serve.sh generates and keeps a strong one).

jac-scale builds its FastAPI app in its server class; this module is a jaclang plugin whose
server class is jac-scale's with the two additions. jaclang loads the plugins of the `jac` entry
point group when it is imported, and the last plugin registered answers first: importing
jac-scale's plugin here registers it before this one, whatever order the entry points come in.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from typing import Any

import jac_scale.plugin  # noqa: F401  (registers jac-scale's server class hook before ours)
from jaclang.jac0core.runtime import hookimpl

logger = logging.getLogger("contextrender.server")

PUBLIC_DEFAULT_SECRET = "supersecretkey_for_testing_only!"
MIN_SECRET_LENGTH = 32
DEFAULT_MAX_BODY_MB = 32

# A traceback ends with the exception: "graph.errors.InvalidRequest: message" (a message may
# run over several lines).
_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w+): ")


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
    statuses = _error_statuses()
    # The exception that ended the walker: the first unindented line after the frames of the
    # last traceback (an error raised while handling another comes last).
    last = str(details or "").rpartition("Traceback (most recent call last):")[2]
    match = next((_ERROR_LINE.match(line) for line in last.splitlines() if line and not line[0].isspace()), None)
    status = statuses.get(match.group(1)) if match else None
    if status is None or status >= 500:
        if details:
            logger.error("walker failed: %s\n%s", error.get("message"), details)
        return 500, body
    error["code"] = _error_code(match.group(1))
    body["error"] = error
    if isinstance(body.get("meta"), dict) and isinstance(body["meta"].get("extra"), dict):
        body["meta"]["extra"]["http_status"] = status
    return status, body


def max_body_bytes() -> int:
    return int(float(os.environ.get("CONTEXTRENDER_MAX_BODY_MB", DEFAULT_MAX_BODY_MB)) * 1024 * 1024)


def _json_response(status: int, code: str, message: str) -> tuple[dict, bytes]:
    body = json.dumps({"ok": False, "type": "error", "data": None, "error": {"code": code, "message": message}})
    start = {
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
    }
    return start, body.encode()


class WalkerErrors:
    """ASGI middleware for `/walker/` requests: the body limit, unknown field names (jac-scale
    drops them silently, so a misspelt `selectr` would quietly use the default), and the error
    statuses. `fields_of(name, caller)` gives a walker's request fields (None: not ours to check,
    such as a walker that needs a login the request lacks: it answers 401 itself)."""

    def __init__(self, app: Any, limit: int | None = None, fields_of: Any = None) -> None:
        self.app = app
        self.limit = max_body_bytes() if limit is None else limit
        self.fields_of = fields_of or (lambda name, caller: None)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/walker/"):
            await self.app(scope, receive, send)
            return
        too_large = f"request body exceeds {self.limit} bytes; send fewer messages per call (append=true takes only new events) or raise CONTEXTRENDER_MAX_BODY_MB"
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._send_error(send, 413, "BODY_TOO_LARGE", too_large)
            return
        # The whole body first (within the limit, declared or chunked), then the app reads it.
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.limit:
                await self._send_error(send, 413, "BODY_TOO_LARGE", too_large)
                return
            if not message.get("more_body"):
                break
        # jac-scale's login middleware (outside this one) has put the caller in the scope's state.
        caller = (scope.get("state") or {}).get("username")
        unknown = self.unknown_fields(scope["path"].removeprefix("/walker/").split("/")[0], caller, bytes(body))
        if unknown:
            await self._send_error(send, 400, "UNKNOWN_FIELD", unknown)
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        state: dict[str, Any] = {}

        async def mapped_send(message: dict) -> None:
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
            start = dict(state["start"], status=status)
            start["headers"] = [(k, v) for (k, v) in start["headers"] if k.lower() != b"content-length"]
            start["headers"].append((b"content-length", str(len(raw)).encode()))
            await send(start)
            await send({"type": "http.response.body", "body": raw})

        await self.app(scope, replay, mapped_send)

    def unknown_fields(self, walker: str, caller: str | None, body: bytes) -> str:
        """What to fix when the body names fields the walker does not have ("" when none)."""
        fields = self.fields_of(walker, caller)
        if fields is None:
            return ""
        try:
            names = json.loads(body) if body else {}
        except ValueError:
            return ""  # not JSON: FastAPI answers 422
        unknown = sorted(set(names) - fields) if isinstance(names, dict) else []
        if not unknown:
            return ""
        return f"{walker} has no field {', '.join(map(repr, unknown))}; its fields: {', '.join(sorted(fields))}"

    @staticmethod
    async def _send_error(send: Any, status: int, code: str, message: str) -> None:
        start, body = _json_response(status, code, message)
        await send(start)
        await send({"type": "http.response.body", "body": body})


def check_jwt_secret(secret: str) -> None:
    """Refuse a public or weak JWT secret outside dev mode."""
    if secret != PUBLIC_DEFAULT_SECRET and len(secret) >= MIN_SECRET_LENGTH:
        return
    problem = "is jac-scale's public default" if secret == PUBLIC_DEFAULT_SECRET else f"is shorter than {MIN_SECRET_LENGTH} characters"
    if os.environ.get("CONTEXTRENDER_DEV") == "1":
        logger.warning("JWT secret %s: acceptable only because CONTEXTRENDER_DEV=1", problem)
        return
    raise SystemExit(
        f"ContextRender refuses to start: the JWT secret {problem}, so anyone could forge tokens. "
        "Set CONTEXTRENDER_JWT_SECRET to a random string of 32+ characters (scripts/serve.sh makes one), "
        "or set CONTEXTRENDER_DEV=1 for a local test server."
    )


def server_class() -> type:
    from jac_scale.config_loader import get_scale_config
    from jac_scale.serve import JacAPIServer
    from starlette.middleware import Middleware

    class ContextRenderServer(JacAPIServer):
        # Jac compiles an archetype's `postinit` to the dataclass `__post_init__`.
        def __post_init__(self) -> None:
            check_jwt_secret(get_scale_config().get_jwt_config()["secret"])
            super().__post_init__()
            # Innermost, inside jac-scale's CORS and login middleware: a request without a token
            # gets 401 before its fields are checked, and every answer gets the CORS headers.
            self.server.app.user_middleware.append(Middleware(WalkerErrors, fields_of=self.request_fields))

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
