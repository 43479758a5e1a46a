"""The proxy's upstream client on aiohttp (adapters/proxy/transport.py): the bytes the upstream
receives are httpx's own transport's, the answer is relayed as it arrives and as it came
(compressed stays compressed), failures are httpx's exceptions (a timeout 504, anything else 502),
connections are reused, the environment's proxy is used, and the client closes its session."""

from __future__ import annotations

import asyncio
import gzip
import socket

import httpx
import pytest

from contextrender.proxy import create_app
from contextrender.proxy.transport import AiohttpTransport, UpstreamClient
from contextrender.proxy.upstream import Upstream
from contextrender.testing.fake_upstream import LoopbackServer

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


class RawUpstream:
    """A loopback server that records the bytes of each request and answers with `answer`'s parts
    (each written after `gate`, if given, is set), counting its connections."""

    def __init__(self, *answer: bytes, gate: asyncio.Event | None = None, hang: bool = False, close: bool = False) -> None:
        self.answer = answer or (OK,)
        self.gate = gate
        self.hang = hang
        self.close = close
        self.received: list[bytes] = []
        self.connections = 0

    async def __aenter__(self) -> RawUpstream:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                self.received.append(head + await reader.readexactly(length))
                if self.hang:
                    await asyncio.sleep(30)
                for number, part in enumerate(self.answer):
                    if number and self.gate is not None:
                        await self.gate.wait()
                    writer.write(part)
                    await writer.drain()
                if self.close:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def run(coroutine):
    """`coroutine` run to its end, failing after 60 s (a request aiohttp holds back waits for ever:
    no read timeout runs until its body is sent)."""
    async def bounded():
        async with asyncio.timeout(60):
            return await coroutine
    return asyncio.run(bounded())


def test_the_upstream_receives_the_bytes_httpxs_own_transport_sends():
    requests = [
        ("POST", "/v1/chat/completions?q=a%2Fb", [(b"Content-Type", b"application/json"), (b"Authorization", b"Bearer k"),
                                                   (b"x-name", "caf\u00e9 \u4f1a\u8bdd".encode())], b'{"a": 1}'),
        ("GET", "/v1/models", [(b"accept", b"*/*")], b""),
        ("POST", "/v1/messages", [(b"x-latin", b"caf\xe9")], b"{}"),  # not UTF-8: sent by httpx's transport
        # aiohttp would wait for a 100 Continue this upstream never sends: sent by httpx's transport
        ("POST", "/v1/responses", [(b"Expect", b"100-continue")], b"{}"),
    ]

    async def main() -> None:
        async with RawUpstream() as upstream:  # one server: the same Host header for both
            for transport in (AiohttpTransport(), httpx.AsyncHTTPTransport()):
                for method, path, headers, body in requests:
                    request = httpx.Request(method, upstream.url + path, headers=headers, content=body,
                                            extensions={"timeout": httpx.Timeout(5.0).as_dict()})
                    response = await transport.handle_async_request(request)
                    await response.aread()
                    await response.aclose()
                await transport.aclose()
        assert len(upstream.received) == 2 * len(requests)
        assert upstream.received[:len(requests)] == upstream.received[len(requests):]

    run(main())


def test_an_answer_streams_as_it_arrives_and_comes_back_as_it_came():
    gzipped = gzip.compress(b'{"answer": "yes"}')
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-encoding: gzip\r\ntransfer-encoding: chunked\r\n\r\n"

    async def main() -> None:
        gate = asyncio.Event()
        async with RawUpstream(head + b"%x\r\n%s\r\n" % (5, gzipped[:5]), b"%x\r\n%s\r\n0\r\n\r\n" % (len(gzipped) - 5, gzipped[5:]),
                               gate=gate) as upstream:
            async with UpstreamClient() as client:
                upstream_ = Upstream(upstream.url + "/v1", 5.0, client)
                response = await upstream_.send(httpx.Request("POST", upstream_.url("/v1/chat/completions", ""), content=b"{}"),
                                                stream=True)
                parts = response.aiter_raw()
                first = await anext(parts)  # before the upstream sends the rest
                gate.set()
                rest = b"".join([part async for part in parts])
                await response.aclose()
                assert first + rest == gzipped and first == gzipped[:5]
                assert response.headers["content-encoding"] == "gzip"
                whole = await upstream_.send(httpx.Request("POST", upstream_.url("/v1/chat/completions", ""), content=b"{}"))
                assert whole.content == b'{"answer": "yes"}'  # httpx decodes what it reads, as before
            assert upstream.connections == 1  # the connection was reused

    run(main())


def test_failures_are_httpxs_exceptions():
    async def main() -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            closed = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/x"
        async with UpstreamClient(timeout=httpx.Timeout(0.3)) as client:
            transport = client._transport_for_url(httpx.URL(closed))
            request = httpx.Request("POST", closed, content=b"{}", extensions={"timeout": client.timeout.as_dict()})
            with pytest.raises(httpx.ConnectError):
                await transport.handle_async_request(request)
            async with RawUpstream(hang=True) as upstream:
                request = httpx.Request("POST", upstream.url, content=b"{}", extensions={"timeout": client.timeout.as_dict()})
                with pytest.raises(httpx.ReadTimeout):
                    await transport.handle_async_request(request)
            async with RawUpstream(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"cut", close=True) as upstream:
                request = httpx.Request("POST", upstream.url, content=b"{}", extensions={"timeout": client.timeout.as_dict()})
                response = await transport.handle_async_request(request)
                with pytest.raises(httpx.HTTPError) as cut:  # the answer closed before its end: 502
                    await response.aread()
                assert not isinstance(cut.value, httpx.TimeoutException)
            async with RawUpstream(b"", close=True) as upstream:  # closed without an answer: 502
                request = httpx.Request("POST", upstream.url, content=b"{}", extensions={"timeout": client.timeout.as_dict()})
                with pytest.raises(httpx.HTTPError) as closed:
                    await transport.handle_async_request(request)
                assert not isinstance(closed.value, httpx.TimeoutException)

    run(main())


def test_the_environments_proxy_is_used(monkeypatch):
    async def main() -> None:
        async with RawUpstream() as proxy:
            monkeypatch.setenv("HTTP_PROXY", proxy.url)
            monkeypatch.delenv("NO_PROXY", raising=False)
            monkeypatch.delenv("no_proxy", raising=False)
            async with UpstreamClient() as client:
                transport = client._transport_for_url(httpx.URL("http://upstream.invalid/v1/x"))
                assert isinstance(transport, AiohttpTransport) and transport is not client._transport
                response = await transport.handle_async_request(httpx.Request("POST", "http://upstream.invalid/v1/x", content=b"{}"))
                await response.aread()
            assert proxy.received[0].startswith(b"POST http://upstream.invalid/v1/x HTTP/1.1\r\n")

    run(main())


def test_the_proxy_calls_its_upstream_on_aiohttp_and_closes_the_session_when_it_stops(upstream):
    app = create_app(KeepNothing(), upstream.base_url, 600)
    with LoopbackServer(app) as server:
        answer = httpx.post(f"{server.url}/v1/models/x", timeout=30)
        client = app.state.proxy.upstream.client
        assert isinstance(client, UpstreamClient) and isinstance(client._transport, AiohttpTransport)
    assert answer.status_code in (200, 404)
    assert client._transport._session is not None and client._transport._session.closed


class KeepNothing:
    def render(self, *args, **kwargs):
        raise AssertionError("no conversation request here")
