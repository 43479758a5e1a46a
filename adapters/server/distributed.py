"""Several `jac start` processes on one store (jac-scale's MongoDB and Redis): what keeps them from
racing each other. Nothing here runs without Redis (docs/scale-out.md).

- One request at a time per session across processes: a lease in Redis keyed by (user,
  session_id), taken inside the server's own per-process lock (adapters/server/app.py RequestGuard)
  and held to the last byte of the answer, jaclang's commit included. The lease expires
  CONTEXTRENDER_LOCK_LEASE seconds (default 10) after its last renewal; the holder renews it
  every third of that while its request runs, so a slow request keeps it and a process killed
  with kill -9 holds it at most one lease. A request that cannot get the lease within
  CONTEXTRENDER_LOCK_WAIT seconds (default 60), or finds Redis unreachable, gets 503 and writes
  nothing.
- Calls that may add or remove a session under the user's root take a second lease, per user
  (the same rule as the per-process lock: the first call of a session, and `delete_session`).
  Which sessions exist is kept in Redis, so a session one process created is known to all.
- A call killed mid-way: a call marks the session (`<lease key>:open`) while it runs and clears the
  mark when it ends. jac-scale commits to MongoDB, then updates its Redis copies of the nodes; a
  process killed between the two leaves stale copies (an old tail, an old stamp). The next call
  on the session finds the mark and drops jac-scale's cached nodes first (MongoDB keeps them all).
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

from contextrender.limits import replaying
from contextrender.settings import start_setting

logger = logging.getLogger("contextrender.distributed")

DEFAULT_LEASE = 10.0
DEFAULT_WAIT = 60.0
PREFIX = "contextrender:"
# How long the mark of a call whose process died stays, waiting for the session's next call.
MARK_SECONDS = 7 * 24 * 3600
# jac-scale's copies of nodes in Redis (L2): jaclang's storage_key, "anchor:<node id>".
CACHED_NODES = "anchor:*"
# Set the key's expiry only while it still holds our token; delete it only then.
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"


def redis_url() -> str | None:
    """Redis as jac-scale is configured with it (REDIS_URL, or jac.toml's [plugins.scale.database]
    redis_url); None when the server runs alone."""
    from jac_scale.config_loader import get_scale_config

    return get_scale_config().get_database_config().get("redis_url") or None


def session_key(user: str, session_id: str) -> str:
    """The Redis key of a session's lease (its call's mark is this plus ":open")."""
    return _key("session", user, session_id)


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
        self.lease = start_setting("CONTEXTRENDER_LOCK_LEASE", DEFAULT_LEASE, unit="seconds") if lease is None else lease
        self.wait = start_setting("CONTEXTRENDER_LOCK_WAIT", DEFAULT_WAIT, unit="seconds") if wait is None else wait

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

    async def open_call(self, key: str, token: str) -> bool:
        """Mark a call on the lease `key` (held) as running, until `close_call`. True when the
        previous call's mark was still there: its process died inside it, maybe between
        jac-scale's MongoDB commit and its Redis cache update."""
        import redis

        try:
            return await self.redis.set(f"{key}:open", token, ex=MARK_SECONDS, get=True) is not None
        except redis.RedisError as err:
            raise LeaseUnavailable(f"the lock store (Redis) is unreachable: {err}; nothing was written, retry") from err

    async def close_call(self, key: str, token: str) -> None:
        import redis

        try:
            await self.redis.eval(_RELEASE, 1, f"{key}:open", token)
        except redis.RedisError as err:
            logger.error("could not clear the mark of a call on %s (the next call will drop the node cache): %s", key, err)

    async def drop_cached_nodes(self) -> int:
        """Delete jac-scale's Redis copies of nodes (its L2 cache; MongoDB keeps every node), so
        that the next reads load them from MongoDB. Returns how many were dropped."""
        dropped = 0
        batch: list[bytes] = []
        async for name in self.redis.scan_iter(match=CACHED_NODES, count=1000):
            batch.append(name)
            if len(batch) >= 1000:
                dropped += await self.redis.unlink(*batch)
                batch = []
        if batch:
            dropped += await self.redis.unlink(*batch)
        return dropped

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

        lease = session_key(caller, session_id)
        try:
            async with self.leases.hold(lease):
                token = secrets.token_hex(16)
                if await self.leases.open_call(lease, token):
                    # The previous call on this session never finished: its process died, maybe
                    # after its MongoDB commit and before its Redis copies were updated. Stale
                    # copies would show this call an old tail (docs/scale-out.md): drop them.
                    dropped = await self.leases.drop_cached_nodes()
                    logger.warning("the previous call on a session of %s died unfinished: dropped %d cached nodes "
                                   "(read again from MongoDB)", caller, dropped)
                try:
                    await self._call(scope, replay, watched, walker, caller, session_id, status)
                finally:
                    await self.leases.close_call(lease, token)
        except LeaseUnavailable as err:
            if "code" in status:
                raise  # the answer has started: too late to refuse
            logger.warning("refused %s on a session of %s: %s", walker, caller, err)
            start, payload = _refuse(str(err))
            await send(start)
            await send({"type": "http.response.body", "body": payload})

    async def _call(self, scope: dict, replay: Any, watched: Any, walker: str, caller: str, session_id: str,
                    status: dict) -> None:
        """The walker call, under the user's lease too when it may add or remove a session."""
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
