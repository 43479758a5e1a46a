"""The accounts the server keeps, made safe for many users, through jac-scale's own extension point
for them (the `get_user_manager` hook: `ServerPlugin` in plugin.py answers it with `UserManager`,
jac-scale's user manager with these changes):

- Tokens end. Every token carries an id (`jti`) and the time of the login it descends from
  (`auth_time`). A password change (`PUT /user/password`) or reset revokes every token of the
  user issued before it; `POST /user/logout` revokes the token it is sent with (`{"all": true}`:
  every token of the user); `POST /user/refresh-token` needs a valid, unexpired, unrevoked token,
  and the token it mints keeps the login's `auth_time` and expires no later than
  CONTEXTRENDER_TOKEN_MAX_DAYS (default 30) after that login: then only a new login gives a
  token. The revocations are kept in `tokens.db` (SQLite) beside jac-scale's `users.db`, so
  they hold across restarts and for every server process on the store.
- Passwords have at least CONTEXTRENDER_MIN_PASSWORD_LENGTH characters (default 12): at
  registration, change and reset (400 naming the setting).
- Password hashing (bcrypt, a second of one core each here) runs at most on all cores but one at
  a time (`hash_one_core_short`): bcrypt lets go of the interpreter, so thirty registrations at
  once ran thirty hashes on the two cores and every other call of the process waited seconds for
  a core (docs/performance.md, "Issue 30, sixth round"). A storm of registrations now queues.
- Failed logins are throttled (`LoginThrottle`, ASGI middleware on `POST /user/login`): after
  CONTEXTRENDER_LOGIN_FAILURES failures (default 5) for one identity, or ten times that from
  one client address, within 15 minutes, further attempts get 429 with `Retry-After` (1 s,
  doubling at each further failure, at most 15 minutes) until it passes; a successful login
  clears the identity's count. Counted per process.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import sqlite3
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from contextrender.limits import replaying
from contextrender.settings import start_setting

__all__ = ["LoginThrottle", "TokenLedger", "logout_route", "min_password_length", "password_problem", "user_manager_class"]

logger = logging.getLogger("contextrender.server")

DEFAULT_MIN_PASSWORD_LENGTH = 12
DEFAULT_TOKEN_MAX_DAYS = 30.0
DEFAULT_LOGIN_FAILURES = 5
FAILURE_WINDOW = 15 * 60.0
MAX_RETRY_AFTER = 15 * 60.0


def min_password_length() -> int:
    return int(start_setting("CONTEXTRENDER_MIN_PASSWORD_LENGTH", DEFAULT_MIN_PASSWORD_LENGTH, unit="characters"))


def token_max_seconds() -> float:
    return start_setting("CONTEXTRENDER_TOKEN_MAX_DAYS", DEFAULT_TOKEN_MAX_DAYS, unit="days") * 86400


def password_problem(password: Any) -> str:
    """Why a new password is refused ("" when it is not)."""
    least = min_password_length()
    if not isinstance(password, str) or len(password) < least:
        return (f"the password must have at least {least} characters (got {len(password) if isinstance(password, str) else 0}); "
                "CONTEXTRENDER_MIN_PASSWORD_LENGTH sets the minimum")
    return ""


class TokenLedger:
    """Revoked tokens (by id, until they expire anyway) and, per user, the time before which every
    token of theirs is revoked; in SQLite at `path` (WAL: several processes share it)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.local = threading.local()
        with self.db() as db:
            db.execute("CREATE TABLE IF NOT EXISTS revoked (jti TEXT PRIMARY KEY, expires REAL NOT NULL)")
            db.execute("CREATE TABLE IF NOT EXISTS cutoff (user_id TEXT PRIMARY KEY, not_before REAL NOT NULL)")

    def db(self) -> sqlite3.Connection:
        connection = getattr(self.local, "db", None)
        if connection is None:
            connection = sqlite3.connect(self.path, timeout=30, isolation_level=None)
            connection.execute("PRAGMA journal_mode=WAL")
            self.local.db = connection
        return connection

    def revoke(self, jti: str, expires: float) -> None:
        db = self.db()
        db.execute("INSERT OR REPLACE INTO revoked VALUES (?, ?)", (jti, expires))
        db.execute("DELETE FROM revoked WHERE expires < ?", (time.time(),))

    def revoke_user(self, user_id: str, before: float | None = None) -> None:
        """Every token of `user_id` issued up to now (`before`) is revoked."""
        self.db().execute("INSERT OR REPLACE INTO cutoff VALUES (?, ?)", (user_id, time.time() if before is None else before))

    def refused(self, claims: dict) -> bool:
        """Whether a token with these (verified) claims was revoked."""
        db = self.db()
        jti = claims.get("jti")
        if jti and db.execute("SELECT 1 FROM revoked WHERE jti = ?", (jti,)).fetchone():
            return True
        row = db.execute("SELECT not_before FROM cutoff WHERE user_id = ?", (claims.get("user_id", ""),)).fetchone()
        return row is not None and float(claims.get("iat", 0)) <= row[0]


def hash_one_core_short(storage: type, hashes: int | None = None) -> None:
    """`storage`'s password hashing and check (jac-scale's `IdentityStorage` static methods, which
    its stores call by that class's name, so a subclass cannot take them over) made to run at most
    `hashes` at a time in the process (default: the cores but one, at least one). Once per class."""
    if getattr(storage, "hashes_bounded", False):
        return
    slots = threading.BoundedSemaphore(hashes or max(1, (os.cpu_count() or 1) - 1))
    for name in ("hash_password", "verify_password"):
        def bounded(*args: Any, _hash: Any = getattr(storage, name)) -> Any:
            with slots:
                return _hash(*args)
        setattr(storage, name, staticmethod(bounded))
    storage.hashes_bounded = True


def user_manager_class() -> type:
    """jac-scale's user manager with ContextRender's token and password rules."""
    import jwt
    from jac_scale import user_manager as scale
    from jac_scale.identity_storage import IdentityStorage

    hash_one_core_short(IdentityStorage)

    class UserManager(scale.JacScaleUserManager):
        def __post_init__(self) -> None:
            super().__post_init__()
            base = os.environ.get("JAC_DATA_PATH", self.base_path)
            self.ledger = TokenLedger(Path(base) / ".jac" / "data" / "tokens.db")
            self.max_seconds = token_max_seconds()

        # -- tokens

        def mint(self, user_id: str, auth_time: float, include_role: bool = True) -> str:
            now = datetime.now(UTC)
            expires = min(now + timedelta(days=scale.JWT_EXP_DELTA_DAYS), datetime.fromtimestamp(auth_time + self.max_seconds, UTC))
            payload: dict[str, Any] = {"user_id": user_id, "exp": expires, "iat": now.timestamp(), "auth_time": auth_time,
                                       "jti": secrets.token_urlsafe(16)}
            role = self.get_user_role(user_id) if include_role else None
            if role:
                payload["role"] = role
            return jwt.encode(payload, scale.JWT_SECRET, algorithm=scale.JWT_ALGORITHM)

        def create_jwt_token(self, user_id: str, include_role: bool = True) -> str:
            return self.mint(user_id, time.time(), include_role)

        def claims(self, token: str) -> dict | None:
            """The claims of a valid, unexpired, unrevoked login token (None otherwise)."""
            try:
                decoded = jwt.decode(token, scale.JWT_SECRET, algorithms=[scale.JWT_ALGORITHM])
            except Exception:  # noqa: BLE001 - any invalid token is simply not one
                return None
            if decoded.get("type") == "api_key" or not decoded.get("user_id") or self.ledger.refused(decoded):
                return None
            return decoded

        def validate_jwt_token(self, token: str) -> str | None:
            decoded = self.claims(token)
            return decoded["user_id"] if decoded else None

        def refresh_jwt_token(self, token: str) -> str | None:
            decoded = self.claims(token)
            if decoded is None:
                return None
            auth_time = float(decoded.get("auth_time", decoded.get("iat", 0)))
            if time.time() >= auth_time + self.max_seconds - 1:
                return None  # past the login's absolute lifetime: log in again
            return self.mint(decoded["user_id"], auth_time)

        def logout(self, token: str, everywhere: bool = False) -> bool:
            decoded = self.claims(token)
            if decoded is None:
                return False
            if everywhere or not decoded.get("jti"):
                self.ledger.revoke_user(decoded["user_id"])
            else:
                self.ledger.revoke(decoded["jti"], float(decoded.get("exp", time.time() + self.max_seconds)))
            return True

        # -- passwords

        def create_user_with_identities(self, identities: list, credential: dict, profile: dict | None = None) -> dict:
            problem = password_problem((credential or {}).get("password")) if (credential or {}).get("type", "password") == "password" else ""
            if problem:
                return {"error": problem, "code": "WEAK_PASSWORD"}
            return super().create_user_with_identities(identities, credential, profile)

        def update_password(self, user_id: str, current_password: str, new_password: str) -> dict:
            problem = password_problem(new_password)
            if problem:
                return {"error": problem, "code": "WEAK_PASSWORD"}
            result = super().update_password(user_id, current_password, new_password)
            if "error" not in result:
                self.ledger.revoke_user(user_id)
            return result

        def reset_password_by_user_id(self, user_id: str, new_password: str) -> dict:
            result = super().reset_password_by_user_id(user_id, new_password)
            if "error" not in result:
                self.ledger.revoke_user(user_id)
            return result

    return UserManager


def _envelope(ok: bool, data: Any = None, code: str = "", message: str = "") -> dict:
    if ok:
        return {"ok": True, "type": "response", "data": data, "error": None}
    return {"ok": False, "type": "error", "data": None, "error": {"code": code, "message": message}}


def logout_route(users: Any) -> Any:
    """`POST /user/logout` (body `{"all": true}` optional): revokes the bearer token it is sent with,
    or every token of its user."""
    async def logout(request: Request) -> JSONResponse:
        authorization = request.headers.get("authorization", "")
        token = authorization[7:] if authorization.startswith("Bearer ") else ""
        try:
            raw = await request.body()
            everywhere = bool(raw) and json.loads(raw).get("all") is True
        except (ValueError, AttributeError):
            return JSONResponse(_envelope(False, code="INVALID_REQUEST", message='the body is optional: {"all": true} to log out everywhere'),
                                status_code=400)
        if not token or not users.logout(token, everywhere):
            return JSONResponse(_envelope(False, code="UNAUTHORIZED", message="send the token to revoke as Authorization: Bearer <token>"),
                                status_code=401)
        return JSONResponse(_envelope(True, {"revoked": "all" if everywhere else "token"}))

    return logout


class LoginThrottle:
    """ASGI middleware: `POST /user/login` answered 429 with Retry-After while the identity (or the
    client address) has failed too often; a failure is a 401 answer, a success clears the identity."""

    def __init__(self, app: Any, failures: int | None = None) -> None:
        self.app = app
        self.limit = failures or int(start_setting("CONTEXTRENDER_LOGIN_FAILURES", DEFAULT_LOGIN_FAILURES, at_least=1))
        # key -> (failures in the window, time of the last one)
        self.failed: dict[tuple[str, str], tuple[int, float]] = {}

    def wait(self, key: tuple[str, str], limit: int, now: float) -> float:
        (count, last) = self.failed.get(key, (0, 0.0))
        if now - last > FAILURE_WINDOW:
            self.failed.pop(key, None)
            return 0.0
        if count < limit:
            return 0.0
        return max(0.0, last + min(2.0 ** (count - limit), MAX_RETRY_AFTER) - now)

    def record(self, key: tuple[str, str], now: float) -> None:
        (count, last) = self.failed.get(key, (0, 0.0))
        self.failed[key] = ((0 if now - last > FAILURE_WINDOW else count) + 1, now)
        if len(self.failed) > 100_000:  # forget the oldest
            for stale in sorted(self.failed, key=lambda k: self.failed[k][1])[:10_000]:
                del self.failed[stale]

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/user/login" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        message = await receive()  # the request guard read the body whole: one message
        try:
            identity = str(((json.loads(message.get("body") or b"{}") or {}).get("identity") or {}).get("value", "")).lower()
        except (ValueError, AttributeError):
            identity = ""
        client = (scope.get("client") or ("", 0))[0]
        keys = [(("identity", identity), self.limit)] if identity else []
        keys.append((("client", client), 10 * self.limit))
        now = time.time()
        wait = max(self.wait(key, limit, now) for (key, limit) in keys)
        if wait > 0:
            retry = str(math.ceil(wait))
            message_text = f"too many failed logins for this account or from this address: try again in {retry} s"
            body = json.dumps(_envelope(False, code="TOO_MANY_ATTEMPTS", message=message_text)).encode()
            await send({"type": "http.response.start", "status": 429, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"retry-after", retry.encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        status: dict[str, int] = {}

        async def watched(out: dict) -> None:
            if out["type"] == "http.response.start":
                status["code"] = out["status"]
            await send(out)

        await self.app(scope, replaying(message, receive), watched)
        if status.get("code") == 401:
            for (key, _) in keys:
                self.record(key, time.time())
            logger.info("failed login for %r from %s", identity[:64], client)
        elif status.get("code") == 200 and identity:
            self.failed.pop(("identity", identity), None)
