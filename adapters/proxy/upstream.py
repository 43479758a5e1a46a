"""Forwarding to the upstream, and its errors: the URL a path goes to, the headers forwarded and
relayed (filtered here only), the upstream's failures as the agent sees them (504 after
`upstream_timeout` seconds of silence, 502 when it fails or cuts a whole answer short), and the
watch that cancels the upstream call when the client leaves."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.background import BackgroundTask

from contextrender.proxy.interfaces import Format
from contextrender.proxy.relay import passthrough, raw, relay
from contextrender.proxy.streams import Decoder

__all__ = ["ClientGone", "Upstream", "error", "unless_gone"]

log = logging.getLogger("contextrender.proxy")
# httpx's own line per request ("HTTP Request: ..."), kept where the proxy calls the transport itself.
_httpx_log = logging.getLogger("httpx")

# ContextRender's own request headers: read by the proxy, never forwarded.
OWN_HEADERS = "x-contextrender-"
# Hop-by-hop headers (RFC 9110 7.6.1) and the ones the HTTP layer recomputes.
_REQUEST_SKIP = {
    "host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
    "upgrade", "proxy-authorization", "proxy-connection",
}
_RESPONSE_SKIP = {"content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}
# Upstream URLs kept parsed, by path (requests without a query: the protocols' paths, a few others).
_PARSED_URLS = 64


def error(fmt: Format, status: int, message: str, kind: str, headers: Sequence[tuple[str, str]] = ()) -> JSONResponse:
    """An error in the protocol's own shape (`headers` added as UTF-8: a session name is any text)."""
    response = JSONResponse(fmt.error(status, message, kind), status_code=status)
    response.raw_headers += raw(headers)
    return response


class ClientGone(Exception):
    """The client disconnected while the proxy waited for the upstream."""


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (its body is read: `receive` then waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(gone: asyncio.Future, work: Any) -> Any:
    """`work`'s result, or ClientGone (with `work` cancelled: httpx closes its connection) if the
    client leaves first."""
    task = asyncio.ensure_future(work)
    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise ClientGone


async def _read_all(response: httpx.Response) -> bytes:
    return b"".join([chunk async for chunk in response.aiter_raw()])


class Upstream:
    """The upstream at `base` (a base URL, `/v1` included), called through `client` (set when the
    app starts)."""

    def __init__(self, base: str, timeout: float, client: httpx.AsyncClient | None = None) -> None:
        self.base = base.rstrip("/")
        self.timeout = timeout
        self.client = client
        self._parsed: dict[str, httpx.URL] = {}

    def url(self, path: str, query: str) -> httpx.URL:
        """The upstream URL of a request to `path`, parsed (httpx parses a URL given as text at each
        request: a third of building the request); kept for the first few paths without a query."""
        parsed = None if query else self._parsed.get(path)
        if parsed is None:
            rest = path[3:] if path == "/v1" or path.startswith("/v1/") else path
            parsed = httpx.URL(self.base + rest + (f"?{query}" if query else ""))
            if not query and len(self._parsed) < _PARSED_URLS:
                self._parsed[path] = parsed
        return parsed

    async def send(self, request: httpx.Request, stream: bool = False) -> httpx.Response:
        """`client.send(request, stream=stream)`, made through the client's transport for the URL
        (the pool, or the proxy its environment names), with the client's timeout: what
        `AsyncClient.send` adds around that call (the cookies of answers kept in the client, the
        auth and redirect flows, event hooks) is nothing the proxy uses (it sends each request as it
        built it, follows no redirect and sends no stored cookie), and it was a sixth of the CPU of
        an upstream call (docs/performance.md, "the HTTP side again"). httpx's log line is kept. A
        URL with a user name or password (Basic auth), or a client given auth or hooks, goes
        through `client.send`."""
        client = self.client
        if request.url.userinfo or client.auth is not None or any(client.event_hooks.values()):
            return await client.send(request, stream=stream)
        request.extensions.setdefault("timeout", client.timeout.as_dict())
        response = await client._transport_for_url(request.url).handle_async_request(request)
        response.request = request
        if _httpx_log.isEnabledFor(logging.INFO):
            _httpx_log.info('HTTP Request: %s %s "%s %d %s"', request.method, request.url, response.http_version,
                            response.status_code, response.reason_phrase)
        if not stream:
            try:
                await response.aread()
            except BaseException:
                await response.aclose()
                raise
        return response

    @staticmethod
    def request_headers(request: Request, identity: bool = False) -> list[tuple[bytes, bytes]]:
        """The agent's headers as forwarded, byte for byte: without hop-by-hop ones and
        ContextRender's own; `identity`: asking for the answer uncompressed (the proxy reads it
        whole)."""
        sent = [(k, v) for (k, v) in request.headers.raw
                if k.lower().decode("latin-1") not in _REQUEST_SKIP and not k.lower().startswith(OWN_HEADERS.encode())
                and not (identity and k.lower() == b"accept-encoding")]
        return sent + [(b"accept-encoding", b"identity")] if identity else sent

    @staticmethod
    def response_headers(response: httpx.Response, decoded: bool = False) -> list[tuple[str, bytes]]:
        """The upstream's headers as relayed, byte for byte: without hop-by-hop ones (and without
        content-encoding when the body relayed is `decoded`)."""
        return [(k.decode("latin-1"), v) for (k, v) in response.headers.raw
                if k.lower().decode("latin-1") not in _RESPONSE_SKIP and not (decoded and k.lower() == b"content-encoding")]

    def failed(self, exc: Exception, fmt: Format, headers: Sequence[tuple[str, str]] = (), cut: bool = False) -> Response:
        """The answer to an upstream call that failed: 504 if it fell silent, else 502 (`cut`: it
        closed a whole answer before the end; `headers` go with a 502 the upstream never
        answered)."""
        if isinstance(exc, httpx.TimeoutException):
            log.warning("upstream %s timed out: %s", self.base, type(exc).__name__)
            return error(fmt, 504, f"ContextRender proxy: upstream {self.base} sent nothing for {self.timeout:g} s "
                                   "(--upstream-timeout)", "upstream_timeout")
        if cut:
            log.warning("upstream %s closed its answer early: %s", self.base, exc)
            return error(fmt, 502, f"ContextRender proxy: upstream {self.base} closed its answer before the end: {exc}", "upstream_error")
        log.warning("upstream %s unreachable: %s", self.base, exc)
        return error(fmt, 502, f"ContextRender proxy: upstream {self.base} failed: {exc}", "upstream_error", headers)

    @staticmethod
    async def watched(request: Request, work: Callable[[asyncio.Future], Awaitable[Response]], left: str) -> Response:
        """`work(gone)`, where `gone` completes when the client leaves: then the upstream call is
        cancelled, `left` logged, and the answer is 499."""
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            return await work(gone)
        except ClientGone:
            log.info("%s; upstream call cancelled", left)
            return Response(status_code=499)
        finally:
            gone.cancel()

    async def forward(
        self, request: Request, body: bytes, fmt: Format,
        on_answer: Callable[[dict | None, dict], BackgroundTask | None] | None = None,
        headers: Sequence[tuple[str, str]] = (),
    ) -> Response:
        """The upstream's answer to `body`, with `headers` added; a complete answer goes to
        `on_answer` (None: relayed without reading it). Until the answer streams, a client that
        leaves cancels the upstream call (then StreamingResponse does: it cancels the relay)."""
        return await self.watched(request, lambda gone: self._forward(request, body, fmt, on_answer, headers, gone),
                                  f"client left before the upstream answered {request.url.path}")

    async def _forward(
        self, request: Request, body: bytes, fmt: Format,
        on_answer: Callable[[dict | None, dict], BackgroundTask | None] | None,
        headers: Sequence[tuple[str, str]], gone: asyncio.Future,
    ) -> Response:
        # A bare httpx.Request: the client's default headers (User-Agent, Accept-Encoding) would
        # otherwise be added to what the agent sent.
        upstream_request = httpx.Request(
            request.method, self.url(request.url.path, request.url.query), headers=self.request_headers(request), content=body,
        )
        try:
            response = await unless_gone(gone, self.send(upstream_request, stream=True))
        except httpx.HTTPError as exc:
            return self.failed(exc, fmt, headers)
        out_headers = self.response_headers(response) + list(headers)
        if on_answer is None:
            return passthrough(response, out_headers)
        if "text/event-stream" in response.headers.get("content-type", ""):
            return relay(response, fmt, on_answer, out_headers, self.base)
        try:
            whole = await unless_gone(gone, _read_all(response))
        except httpx.HTTPError as exc:
            return self.failed(exc, fmt, cut=True)
        finally:
            await response.aclose()
        task = None  # an answer in JSON: read whole to ingest it
        decoder = Decoder(response.headers.get("content-encoding", ""))
        if response.status_code == 200 and decoder.ok:
            task = on_answer(*fmt.answer(decoder.feed(whole)))
        plain = Response(whole, status_code=response.status_code, background=task)
        plain.raw_headers = raw(out_headers) + [(b"content-length", str(len(whole)).encode())]
        return plain
