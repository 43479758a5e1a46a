"""The proxy's upstream client: an `httpx.AsyncClient` whose transport sends with aiohttp (its HTTP
parser and writer in C, on asyncio directly) instead of httpcore's pool (h11's parser in Python,
anyio's cancel scopes around every read and write): about half the CPU of an upstream call
(docs/performance.md, "The upstream call on aiohttp"). The rest of the proxy keeps httpx's types
(`httpx.Request`, `httpx.Response`) and exceptions: aiohttp's are mapped to httpx's classes, so
that a timeout is still a `TimeoutException` (504) and any other failure an `HTTPError` (502).

What the upstream receives is what httpx sent: the request's own headers, byte for byte, and
nothing added (aiohttp's default Accept, Accept-Encoding, User-Agent and Content-Type are turned
off; a request with a header that is not UTF-8, which aiohttp's writer cannot send as it came,
or with `Expect`, whose body aiohttp would hold back, goes through httpx's own transport); the answer is not decompressed (httpx's `Response` decodes what it reads
as before); no cookie is kept; redirects are not followed. The client's timeouts (connect, read,
pool), its TLS settings (`verify`, `cert`, SSL_CERT_FILE with `trust_env`), its limits (the
number of connections; idle ones kept `keepalive_expiry` seconds) and the proxies its environment
names (HTTP(S)_PROXY, NO_PROXY: httpx's mounts, each with a transport of this kind) hold as they
did. httpx's `max_keepalive_connections` has no counterpart: aiohttp keeps every idle connection
until it expires."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import httpx
from yarl import URL  # aiohttp's own URL type (a dependency of aiohttp)

__all__ = ["AiohttpTransport", "UpstreamClient"]

# Headers aiohttp adds to a request that lacks them: httpx adds none to the proxy's requests.
_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")


@contextlib.contextmanager
def _as_httpx(request: httpx.Request) -> Iterator[None]:
    """aiohttp's exceptions raised as httpx's (the class httpx's own transport raises for the same
    failure; the message kept)."""
    try:
        yield
    except aiohttp.ConnectionTimeoutError as exc:
        raise httpx.ConnectTimeout(str(exc) or "connection timed out", request=request) from exc
    except (aiohttp.SocketTimeoutError, aiohttp.ServerTimeoutError) as exc:
        raise httpx.ReadTimeout(str(exc) or "read timed out", request=request) from exc
    except (aiohttp.ClientProxyConnectionError, aiohttp.ClientHttpProxyError) as exc:
        raise httpx.ProxyError(str(exc), request=request) from exc
    except aiohttp.ClientConnectorError as exc:
        raise httpx.ConnectError(str(exc), request=request) from exc
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientResponseError) as exc:
        raise httpx.RemoteProtocolError(str(exc) or type(exc).__name__, request=request) from exc
    except (aiohttp.NonHttpUrlClientError, aiohttp.InvalidURL) as exc:
        raise httpx.UnsupportedProtocol(str(exc), request=request) from exc
    except (aiohttp.ClientError, OSError) as exc:
        raise httpx.ReadError(str(exc) or type(exc).__name__, request=request) from exc


class _Body(httpx.AsyncByteStream):
    """An answer's body as it arrives (each part as aiohttp reads it); closing it gives the
    connection back to the pool, or closes it if the body was not read to its end."""

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _as_httpx(self._request):
            async for part in self._response.content.iter_any():
                yield part

    async def aclose(self) -> None:
        self._response.release()


def _aiohttp_headers(request: httpx.Request) -> list[tuple[str, str]] | None:
    """The request's headers as aiohttp takes them (text it writes as UTF-8), or None if aiohttp
    would not send the request as httpx does: a header that is not UTF-8, or `Expect` (given
    `Expect: 100-continue`, aiohttp holds the body back until the upstream answers 100 Continue,
    which an upstream that ignores the header never does; httpx sends it at once)."""
    try:
        headers = [(name.decode(), value.decode()) for name, value in request.headers.raw]
    except UnicodeDecodeError:
        return None
    return None if "expect" in request.headers else headers


class AiohttpTransport(httpx.AsyncBaseTransport):
    """httpx's transport interface over an `aiohttp.ClientSession` (made at the first request, in
    the running loop), with httpx's own transport for the requests aiohttp cannot send unchanged."""

    def __init__(self, verify: ssl.SSLContext | str | bool = True, cert: Any = None, trust_env: bool = True,
                 limits: httpx.Limits = httpx.Limits(), proxy: httpx.Proxy | None = None, **kwargs: Any) -> None:
        self._ssl = httpx.create_ssl_context(verify=verify, cert=cert, trust_env=trust_env)
        self._limits = limits
        self._proxy = proxy
        self._session: aiohttp.ClientSession | None = None
        self._fallback = httpx.AsyncHTTPTransport(verify=self._ssl, limits=limits, proxy=proxy, **kwargs)

    def _open(self) -> aiohttp.ClientSession:
        expiry = self._limits.keepalive_expiry
        connector = aiohttp.TCPConnector(limit=self._limits.max_connections or 0, limit_per_host=0, ssl=self._ssl,
                                         **({} if expiry is None else {"keepalive_timeout": expiry}))
        return aiohttp.ClientSession(connector=connector, skip_auto_headers=_AUTO_HEADERS, auto_decompress=False,
                                     cookie_jar=aiohttp.DummyCookieJar(), timeout=aiohttp.ClientTimeout(total=None))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        headers = _aiohttp_headers(request)
        if headers is None:
            return await self._fallback.handle_async_request(request)
        if self._session is None:
            self._session = self._open()
        timeout = request.extensions.get("timeout", {})
        proxy = self._proxy
        url = URL(str(request.url), encoded=True)
        if request.url.userinfo:  # sent as httpx's auth made it (the Authorization header), not from the URL
            url = url.with_user(None)
        with _as_httpx(request):
            response = await self._session.request(
                request.method, url, headers=headers, data=await request.aread() or None,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=None, connect=timeout.get("pool"), sock_connect=timeout.get("connect"),
                                              sock_read=timeout.get("read")),
                proxy=None if proxy is None else str(proxy.url),
                proxy_auth=None if proxy is None or proxy.auth is None else aiohttp.BasicAuth(*proxy.auth),
                proxy_headers=None if proxy is None else dict(proxy.headers),
            )
        version = response.version
        return httpx.Response(
            response.status, headers=list(response.raw_headers), stream=_Body(response, request),
            extensions={"http_version": f"HTTP/{version.major}.{version.minor}".encode() if version else b"HTTP/1.1",
                        "reason_phrase": (response.reason or "").encode("latin-1", "replace")},
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
        await self._fallback.aclose()


class UpstreamClient(httpx.AsyncClient):
    """`httpx.AsyncClient` on `AiohttpTransport`: for the direct route and for each proxy the
    environment names (httpx builds its mounts from HTTP(S)_PROXY and NO_PROXY as for its own
    transport)."""

    def _init_transport(self, verify: Any = True, cert: Any = None, trust_env: bool = True, http1: bool = True,
                        http2: bool = False, limits: httpx.Limits = httpx.Limits(), transport: Any = None,
                        **kwargs: Any) -> httpx.AsyncBaseTransport:
        return transport if transport is not None else AiohttpTransport(verify, cert, trust_env, limits)

    def _init_proxy_transport(self, proxy: httpx.Proxy, verify: Any = True, cert: Any = None, trust_env: bool = True,
                              http1: bool = True, http2: bool = False, limits: httpx.Limits = httpx.Limits(),
                              **kwargs: Any) -> httpx.AsyncBaseTransport:
        return AiohttpTransport(verify, cert, trust_env, limits, proxy)
