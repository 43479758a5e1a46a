"""The streaming relay: an upstream answer relayed to the agent as it arrives, chunk by chunk, the
bytes untouched; for a conversation request a decoded copy is read on the way, and the answer is
recorded before the response's last frame is sent (so before the agent's next request).

A stream ends the way the upstream's did. One cut before its last event (no `[DONE]`, no
`message_stop`, no `response.completed`: the upstream closed the connection, or ended its body
early) reaches the agent as a failure: an error event in the protocol's shape when the stream is
plain text (every SDK raises on it), else (a compressed stream, or one the proxy does not read)
a broken connection, as the upstream's was. A cut answer is never recorded."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence

import httpx
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask
from starlette.types import Send

from contextrender.proxy.interfaces import Format
from contextrender.proxy.streams import Decoder

__all__ = ["Broken", "Pending", "cut_message", "passthrough", "raw", "relay", "streaming"]

log = logging.getLogger("contextrender.proxy")

HeaderValue = str | bytes


def raw(headers: Sequence[tuple[str, HeaderValue]]) -> list[tuple[bytes, bytes]]:
    """Headers as a response's `raw_headers` (kept in order, repeated names included): bytes as
    they are (the upstream's, relayed exactly), text as UTF-8 (a session name can be any text)."""
    return [(k.encode("latin-1"), v if isinstance(v, bytes) else v.encode("utf-8")) for (k, v) in headers]


class Broken(Exception):
    """Raised by a relayed stream's chunks to end the response with a broken connection (no last
    chunk), the way a cut upstream ended its own."""


class _Stream(StreamingResponse):
    """A StreamingResponse whose chunks may raise `Broken`: the body then stops without its end
    (the server closes the connection, the client reads an incomplete body), and the background
    tasks still run."""

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except Broken:
            return  # no final frame: the connection is closed unfinished
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class Pending:
    """The background tasks a stream queues as it ends (the answer's ingestion), run once its last
    byte is sent."""

    def __init__(self) -> None:
        self.tasks: list[BackgroundTask] = []

    def add(self, task: BackgroundTask | None) -> None:
        if task:
            self.tasks.append(task)

    async def run(self) -> None:
        for task in self.tasks:
            await task()


def streaming(chunks: AsyncIterator[bytes], status: int, headers: Sequence[tuple[str, HeaderValue]], pending: Pending) -> StreamingResponse:
    """A response that sends `chunks` as they come (ended unfinished if they raise `Broken`), then
    runs what `pending` holds."""
    response = _Stream(chunks, status_code=status, background=BackgroundTask(pending.run))
    response.raw_headers = raw(headers)
    return response


def passthrough(response: httpx.Response, headers: list[tuple[str, HeaderValue]]) -> StreamingResponse:
    """The upstream's bytes as they come, with its length (HEAD included): nothing is read. A body
    the upstream cut short is cut short here too."""
    length = response.headers.get("content-length")

    async def chunks() -> AsyncIterator[bytes]:
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            log.warning("upstream body ended early: %s", exc)
            raise Broken from exc
        finally:
            await response.aclose()

    relayed = _Stream(chunks(), status_code=response.status_code, background=BackgroundTask(response.aclose))
    relayed.raw_headers = raw(headers + ([("content-length", length)] if length is not None else []))
    return relayed


def cut_message(upstream: str, exc: Exception | None) -> str:
    """What the agent is told about a stream the upstream cut."""
    why = f": {exc}" if exc is not None and str(exc) else (f" ({type(exc).__name__})" if exc is not None else
                                                          " (its body ended without the stream's final event)")
    return f"upstream {upstream} ended the stream before its end{why}; the answer is incomplete"


def relay(
    response: httpx.Response, fmt: Format, on_answer: Callable[[dict | None, dict], BackgroundTask | None],
    headers: list[tuple[str, HeaderValue]], upstream: str,
) -> StreamingResponse:
    """An event stream relayed as it arrives while `fmt`'s reader reads a decoded copy; a complete
    answer (status 200) goes to `on_answer`. A stream the upstream cuts (its connection broken,
    or its body ended before the protocol's final event) ends as a failure the agent sees."""
    wants_answer = response.status_code == 200
    encoding = response.headers.get("content-encoding", "").strip().lower()
    decoder = Decoder(encoding)
    # An error event can be added to a plain stream only; a compressed one is broken off instead.
    plain = encoding in ("", "identity")
    stream = fmt.reader()
    pending = Pending()
    recorded = False

    def record() -> None:
        # The answer is recorded as soon as the protocol's final event is read, before the agent
        # gets it: an agent that closes the connection at that event (the SDKs stop reading there)
        # while the upstream's body has not ended yet must not lose it, and it is recorded before
        # the agent can send its next request.
        nonlocal recorded
        if not recorded:
            recorded = True
            pending.add(on_answer(stream.answer(), stream.usage))

    async def chunks() -> AsyncIterator[bytes]:
        failure: Exception | None = None
        try:
            async for chunk in response.aiter_raw():
                if wants_answer and decoder.ok:
                    stream.feed(decoder.feed(chunk))
                    if stream.done:
                        record()
                yield chunk
        except httpx.HTTPError as exc:  # headers are sent: the stream can only end as a failure
            failure = exc
        finally:
            await response.aclose()
        if wants_answer and decoder.ok:
            stream.feed(b"\n\n")
            if stream.done:
                record()
                return
            message = cut_message(upstream, failure)
            log.warning("%s", message)
            if plain:
                yield fmt.stream_error(message)
                return
            raise Broken
        if failure is not None:  # a stream the proxy does not read: broken off as it was
            log.warning("%s", cut_message(upstream, failure))
            raise Broken

    return streaming(chunks(), response.status_code, headers, pending)
