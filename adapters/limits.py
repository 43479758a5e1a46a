"""What bounds one client, on the server and the proxy alike: the request body (its size and the
time it may take to arrive), the time a connection may take to send its request headers, and the
connections one client address may hold open at once.

- `read_body`: the whole body, read before the app sees it; a declared Content-Length over the
  limit is refused at once (413, nothing read), a body that grows past it as soon as it does
  (413, connection closed), a body that pauses longer than the read timeout mid-way or takes ten
  times it in all gets 408.
- `GuardedHTTP`: uvicorn's HTTP protocol (httptools where installed, else h11, as uvicorn's
  "auto") with a header read timeout (CONTEXTRENDER_HEADER_TIMEOUT, default 20 s: a connection
  whose request line and headers are not complete that long after it opened, or after its last
  answer, gets 408 and is closed) and a cap on the connections one client address holds open
  (CONTEXTRENDER_MAX_CONNECTIONS_PER_CLIENT, default 64: one more is answered 429 with
  Retry-After and closed). A slowloris client (many sockets, headers a byte at a time) holds
  neither the sockets nor the server for longer than the header timeout. These act below the
  ASGI app (an app sees a request only once its headers are complete), so they are a protocol
  class: `uvicorn_settings()` for a uvicorn the project starts itself (the proxy),
  `use_guarded_http()` for one jac-scale starts (the server).
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import os
from typing import Any

from contextrender.settings import positive_number

__all__ = ["BodyRefused", "DEFAULT_BODY_TIMEOUT", "DEFAULT_MAX_BODY_MB", "GuardedHTTP", "body_timeout",
           "header_timeout", "max_body_bytes", "max_connections_per_client", "read_body", "use_guarded_http",
           "uvicorn_settings"]

DEFAULT_MAX_BODY_MB = 32
DEFAULT_BODY_TIMEOUT = 30.0
DEFAULT_HEADER_TIMEOUT = 20.0
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 64
# Seconds a stopping proxy gives the requests in flight before it cancels them.
DEFAULT_SHUTDOWN_GRACE = 3


def max_body_bytes() -> int:
    return int(positive_number("CONTEXTRENDER_MAX_BODY_MB", DEFAULT_MAX_BODY_MB, unit="MB") * 1024 * 1024)


def body_timeout() -> float:
    return positive_number("CONTEXTRENDER_BODY_TIMEOUT", DEFAULT_BODY_TIMEOUT, unit="seconds")


def header_timeout() -> float:
    return positive_number("CONTEXTRENDER_HEADER_TIMEOUT", DEFAULT_HEADER_TIMEOUT, unit="seconds")


def max_connections_per_client() -> int:
    return int(positive_number("CONTEXTRENDER_MAX_CONNECTIONS_PER_CLIENT", DEFAULT_MAX_CONNECTIONS_PER_CLIENT, at_least=1))


# Names of this machine that are not addresses.
LOOPBACK_NAMES = {"localhost", "localhost.", "ip6-localhost"}


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 with or without brackets) is this machine."""
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def replaying(message: dict, receive: Any) -> Any:
    """An ASGI `receive` that answers the body `message` (read whole before the app) once, then
    whatever the server sends next (a disconnect)."""
    replayed = False

    async def replay() -> dict:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return message

    return replay


class BodyRefused(Exception):
    """A request refused while (or instead of) reading its body: the status, a code, what to fix,
    and whether the connection must be closed (the rest of the body was not read)."""

    def __init__(self, status: int, code: str, message: str, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.close = status, code, message, close


async def read_body(scope: dict, receive: Any, limit: int, timeout: float, advice: str) -> bytes | None:
    """The whole body of an HTTP request, at most `limit` bytes (declared or chunked), each part
    arriving within `timeout` seconds of the last and all within ten times it; None if the
    client left first. `advice`: what the 413's message tells the client to do.

    The parts are joined once at the end (a body in one part is that part, not copied): grown in a
    bytearray and copied out, a 220 kB body cost about 0.1 ms of copies and page faults. One
    timeout watches the whole read, moved at each part (a `wait_for` per part made one each)."""
    too_large = f"request body exceeds {limit} bytes; {advice}"
    declared = dict(scope.get("headers") or []).get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyRefused(413, "BODY_TOO_LARGE", too_large, close=True)
    parts: list[bytes] = []
    size = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10 * timeout
    try:
        async with asyncio.timeout(None) as watch:
            while True:
                watch.reschedule(min(loop.time() + timeout, deadline))
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                part = message.get("body", b"")
                parts.append(part)
                size += len(part)
                if size > limit:
                    raise BodyRefused(413, "BODY_TOO_LARGE", too_large, close=True)
                if not message.get("more_body"):
                    return b"".join(parts)
    except TimeoutError:
        raise BodyRefused(408, "BODY_TIMEOUT", f"the request body did not arrive within {timeout:g} s of silence "
                          f"({10 * timeout:g} s in all); send it whole (CONTEXTRENDER_BODY_TIMEOUT)", close=True) from None


def _base_protocol() -> type:
    """The protocol class uvicorn's "auto" picks: httptools where installed, else h11."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return AutoHTTPProtocol


def _raw_answer(status: str, message: str, extra: bytes = b"") -> bytes:
    body = message.encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n").encode() + extra + b"\r\n" + body


class GuardedHTTP(_base_protocol()):  # type: ignore[misc]
    """uvicorn's HTTP protocol with the header read timeout and the per-client connection cap
    (`configure` reads the settings; at the first connection if nothing did before)."""

    settings: tuple[float, int] | None = None

    @staticmethod
    def configure() -> tuple[float, int]:
        """Read the settings (ValueError naming a malformed one): at start, not at a connection."""
        GuardedHTTP.settings = (header_timeout(), max_connections_per_client())
        return GuardedHTTP.settings

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        (self._header_timeout, cap) = GuardedHTTP.settings or GuardedHTTP.configure()
        self._address = self.client[0] if self.client else ""
        # Open connections by client address, per server (its state; one event loop: no lock).
        self._open = self.server_state.__dict__.setdefault("open_by_client", collections.Counter())
        self._open[self._address] += 1
        self._counted = True
        self._header_timer: asyncio.TimerHandle | None = None
        if self._open[self._address] > cap:
            self.logger.warning("%s holds %d connections (CONTEXTRENDER_MAX_CONNECTIONS_PER_CLIENT=%d): one more refused",
                                self._address, self._open[self._address] - 1, cap)
            transport.write(_raw_answer("429 Too Many Requests", f"this client already holds {cap} open connections; close some "
                                        "or raise CONTEXTRENDER_MAX_CONNECTIONS_PER_CLIENT\n", b"retry-after: 1\r\n"))
            transport.close()
            return
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._waiting_for = self.cycle  # the headers are in when a new cycle starts
        self._header_timer = self.loop.call_later(self._header_timeout, self._headers_late)

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.cycle is not self._waiting_for or self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return  # a request began (its body has its own timeout: read_body), or one is being answered
        self.transport.write(_raw_answer("408 Request Timeout", f"the request headers did not arrive within {self._header_timeout:g} s "
                                         "(CONTEXTRENDER_HEADER_TIMEOUT)\n"))
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # The next request's headers (uvicorn's keep-alive timer stops at its first byte); unless the
        # next request came before this response ended and uvicorn has just started it: its own end
        # arms the timer.
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if getattr(self, "_counted", False):
            self._counted = False
            self._open[self._address] -= 1
            if self._open[self._address] <= 0:
                del self._open[self._address]
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)


def uvicorn_settings() -> dict[str, Any]:
    """uvicorn.run's settings for a server that bounds slow clients and stops within a few
    seconds of SIGTERM (requests still in flight then are cancelled)."""
    GuardedHTTP.configure()
    return {"http": GuardedHTTP, "timeout_graceful_shutdown": DEFAULT_SHUTDOWN_GRACE}


def use_guarded_http() -> None:
    """Make GuardedHTTP uvicorn's "auto" protocol in this process: for a uvicorn built by another
    package (jac-scale builds its uvicorn.Config itself, with no way to pass `http=`)."""
    from uvicorn import config

    GuardedHTTP.configure()
    config.HTTP_PROTOCOLS["auto"] = f"{__name__}:GuardedHTTP"
