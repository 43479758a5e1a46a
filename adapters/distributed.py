"""Several `jac start` processes on one store (jac-scale's MongoDB and Redis): what keeps them from
racing each other. Nothing here runs without Redis (docs/scale-out.md).

- One request at a time per session across processes: a lease in Redis keyed by (user,
  session_id), taken inside the server's own per-process lock (adapters/server.py RequestGuard)
  and held to the last byte of the answer, jaclang's commit included. The lease expires
  CONTEXTRENDER_LOCK_LEASE seconds (default 10) after its last renewal; the holder renews it
  every third of that while its request runs, so a slow request keeps it and a process killed
  with kill -9 holds it at most one lease. A request that cannot get the lease within
  CONTEXTRENDER_LOCK_WAIT seconds (default 60), or finds Redis unreachable, gets 503 and writes
  nothing.
- Calls that may add or remove a session under the user's root take a second lease, per user
  (the same rule as the per-process lock: the first call of a session, and `delete_session`).
  Which sessions exist is kept in Redis, so a session one process created is known to all.
- Cache coherence: every call that opens a session's index writes a random stamp on the Session
  node (engine/index.jac, CONTEXTRENDER_SESSION_STAMPS=1); an index another process cached
  carries an older stamp, and is rebuilt from the store on its next call.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from contextrender_adapters.request_guard import replaying

logger = logging.getLogger("contextrender.distributed")

DEFAULT_LEASE = 10.0
DEFAULT_WAIT = 60.0
PREFIX = "contextrender:"
# Set the key's expiry only while it still holds our token; delete it only then.
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"


def redis_url() -> str | None:
    """Redis as jac-scale is configured with it (REDIS_URL, or jac.toml's [plugins.scale.database]
    redis_url); None when the server runs alone."""
    from jac_scale.config_loader import get_scale_config

    return get_scale_config().get_database_config().get("redis_url") or None


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw.strip() else default
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise SystemExit(f"{name} must be a positive number of seconds (got {raw!r})")
    return value


def _key(kind: str, *parts: str) -> str:
    # User names and session ids are free text (up to 256 characters): hash them into the key.
    digest = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:40]
    return f"{PREFIX}{kind}:{digest}"


class LeaseUnavailable(Exception):
    """The lease was not had in time, or Redis could not be reached."""


class RedisLeases:
    """Leases in Redis: `hold(key)` waits for the key (polling), holds it with a renewed expiry,
    and releases it only if it is still its own (an expired lease another holder took is left)."""

    def __init__(self, url: str, lease: float | None = None, wait: float | None = None) -> None:
        import redis.asyncio

        self.redis = redis.asyncio.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        self.lease = _seconds("CONTEXTRENDER_LOCK_LEASE", DEFAULT_LEASE) if lease is None else lease
        self.wait = _seconds("CONTEXTRENDER_LOCK_WAIT", DEFAULT_WAIT) if wait is None else wait

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        import redis

        token = secrets.token_hex(16)
        lease_ms = max(int(self.lease * 1000), 1)
        deadline = time.monotonic() + self.wait
        pause = 0.002
        try:
            while not await self.redis.set(key, token, nx=True, px=lease_ms):
                if time.monotonic() > deadline:
                    raise LeaseUnavailable(f"the session is busy: another request held it for more than {self.wait:g} s "
                                           "(CONTEXTRENDER_LOCK_WAIT); nothing was written, retry")
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.05)
        except redis.RedisError as err:
            raise LeaseUnavailable(f"the lock store (Redis) is unreachable: {err}; nothing was written, retry") from err
        renewer = asyncio.create_task(self._renew(key, token, lease_ms))
        try:
            yield
        finally:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
            try:
                await self.redis.eval(_RELEASE, 1, key, token)
            except redis.RedisError as err:
                logger.error("could not release lease %s (it expires in %g s): %s", key, self.lease, err)

    async def _renew(self, key: str, token: str, lease_ms: int) -> None:
        import redis

        while True:
            await asyncio.sleep(self.lease / 3)
            try:
                if not await self.redis.eval(_RENEW, 1, key, token, lease_ms):
                    logger.error("lease %s expired while its request ran (longer than CONTEXTRENDER_LOCK_LEASE "
                                 "between renewals): another process may now write the session", key)
                    return
            except redis.RedisError as err:
                logger.error("could not renew lease %s: %s", key, err)

    async def known(self, user: str, session_id: str) -> bool:
        """Whether the user's session is known to exist (False when Redis cannot say: the caller
        then takes the user's lease, the safe side)."""
        import redis

        try:
            return bool(await self.redis.sismember(_key("sessions", user), session_id))
        except redis.RedisError as err:
            logger.error("could not read the known sessions: %s", err)
            return False

    async def remember(self, user: str, session_id: str, exists: bool) -> None:
        import redis

        try:
            if exists:
                await self.redis.sadd(_key("sessions", user), session_id)
            else:
                await self.redis.srem(_key("sessions", user), session_id)
        except redis.RedisError as err:
            logger.error("could not record the known sessions: %s", err)


def _refuse(message: str) -> tuple[dict, bytes]:
    body = json.dumps({"ok": False, "type": "error", "data": None,
                       "error": {"code": "SESSION_BUSY", "message": message}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"retry-after", b"1")]
    return {"type": "http.response.start", "status": 503, "headers": headers}, body


class SessionLeases:
    """ASGI middleware inside RequestGuard (which has read and checked the whole body, and holds
    this process's lock of the session): a walker call on a (user, session_id) holds that
    session's lease in Redis while it runs, and the user's lease too when it may add or remove a
    session (`root_writers` on a session not known to exist, and `delete_session`)."""

    def __init__(self, app: Any, leases: RedisLeases, root_writers: set[str] | frozenset = frozenset()) -> None:
        self.app = app
        self.leases = leases
        self.root_writers = root_writers

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/walker/"):
            await self.app(scope, receive, send)
            return
        caller = (scope.get("state") or {}).get("username")
        # RequestGuard hands the body on whole, in one message.
        message = await receive()
        try:
            body = json.loads(message.get("body") or b"null")
        except ValueError:
            body = None
        session_id = body.get("session_id") if isinstance(body, dict) else None
        replay = replaying(message, receive)

        if not (caller and isinstance(session_id, str)):
            await self.app(scope, replay, send)
            return
        walker = path.removeprefix("/walker/")
        status: dict[str, int] = {}

        async def watched(event: dict) -> None:
            if event["type"] == "http.response.start":
                status["code"] = event["status"]
            await send(event)

        try:
            async with self.leases.hold(_key("session", caller, session_id)):
                if walker == "delete_session":
                    async with self.leases.hold(_key("user", caller)):
                        await self.app(scope, replay, watched)
                    await self.leases.remember(caller, session_id, exists=False)
                elif walker in self.root_writers and not await self.leases.known(caller, session_id):
                    async with self.leases.hold(_key("user", caller)):
                        await self.app(scope, replay, watched)
                    if status.get("code", 500) < 300:
                        await self.leases.remember(caller, session_id, exists=True)
                else:
                    await self.app(scope, replay, watched)
        except LeaseUnavailable as err:
            if "code" in status:
                raise  # the answer has started: too late to refuse
            logger.warning("refused %s on a session of %s: %s", walker, caller, err)
            start, payload = _refuse(str(err))
            await send(start)
            await send({"type": "http.response.body", "body": payload})


def install(app: Any, root_writers: set[str]) -> bool:
    """With Redis configured: add SessionLeases inside the middleware already on `app` (after
    RequestGuard) and turn on the session stamps. Without Redis: nothing (one process: its own
    locks suffice). Returns whether it installed."""
    from starlette.middleware import Middleware

    url = redis_url()
    if not url:
        return False
    leases = RedisLeases(url)
    app.user_middleware.append(Middleware(SessionLeases, leases=leases, root_writers=root_writers))
    os.environ["CONTEXTRENDER_SESSION_STAMPS"] = "1"
    logger.info("several processes on one store: per-session leases in Redis (lease %g s, wait %g s), session stamps on",
                leases.lease, leases.wait)
    return True
