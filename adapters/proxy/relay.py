"""The streaming relay: an upstream answer relayed to the agent as it arrives, chunk by chunk, the
bytes untouched; for a conversation request a decoded copy is read on the way, and the answer is
recorded before the response's last frame is sent (so before the agent's next request)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence

import httpx
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from contextrender_adapters.proxy.interfaces import Format
from contextrender_adapters.streams import Decoder

__all__ = ["Pending", "passthrough", "raw", "relay", "streaming"]

log = logging.getLogger("contextrender.proxy")


def raw(headers: Sequence[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    """Headers as a response's `raw_headers` (kept in order, repeated names included)."""
    return [(k.encode("latin-1"), v.encode("latin-1")) for (k, v) in headers]


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


def streaming(chunks: AsyncIterator[bytes], status: int, headers: Sequence[tuple[str, str]], pending: Pending) -> StreamingResponse:
    """A response that sends `chunks` as they come, then runs what `pending` holds."""
    response = StreamingResponse(chunks, status_code=status, background=BackgroundTask(pending.run))
    response.raw_headers = raw(headers)
    return response


def passthrough(response: httpx.Response, headers: list[tuple[str, str]]) -> StreamingResponse:
    """The upstream's bytes as they come, with its length (HEAD included): nothing is read."""
    length = response.headers.get("content-length")
    relayed = StreamingResponse(response.aiter_raw(), status_code=response.status_code, background=BackgroundTask(response.aclose))
    relayed.raw_headers = raw(headers + ([("content-length", length)] if length is not None else []))
    return relayed


def relay(
    response: httpx.Response, fmt: Format, on_answer: Callable[[dict | None, dict], BackgroundTask | None],
    headers: list[tuple[str, str]], upstream: str,
) -> StreamingResponse:
    """An event stream relayed as it arrives while `fmt`'s reader reads a decoded copy; a complete
    answer (status 200) goes to `on_answer`. An upstream that fails once the headers are sent can
    only end the stream early."""
    wants_answer = response.status_code == 200
    decoder = Decoder(response.headers.get("content-encoding", ""))
    stream = fmt.reader()
    pending = Pending()

    async def chunks() -> AsyncIterator[bytes]:
        try:
            async for chunk in response.aiter_raw():
                yield chunk
                if wants_answer and decoder.ok:
                    stream.feed(decoder.feed(chunk))
        except httpx.HTTPError as exc:  # headers are sent: the stream can only end early
            log.warning("upstream %s stream ended early: %s", upstream, exc)
        finally:
            await response.aclose()
        # Runs before the response's last frame is sent: the answer is recorded before the
        # agent can send its next request.
        if wants_answer and decoder.ok:
            stream.feed(b"\n\n")
            if stream.done:
                pending.add(on_answer(stream.answer(), stream.usage))

    return streaming(chunks(), response.status_code, headers, pending)
