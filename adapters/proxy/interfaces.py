"""What the proxy needs of its backend (the in-process `Engine`, or a `Client` of a running
server) and of a protocol's format layer (chat completions, Anthropic Messages, Responses)."""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Backend", "Exchange", "Format", "StreamReader", "field"]


class Backend(Protocol):
    """What the proxy needs from the engine: `Engine` and `Client` both have it."""

    def render(self, session_id: str, messages: list[dict], *, budget: int, selector: str = "", **params: Any) -> Any: ...

    def ingest(self, session_id: str, messages: list[dict], *, append: bool = False, at: int = -1, usage: dict | None = None) -> Any: ...

    def get_session(self, session_id: str) -> dict: ...

    def configure(self, session_id: str, **params: Any) -> Any: ...

    def restore(self, session_id: str, handle: str) -> Any: ...


class Exchange(Protocol):
    """One conversation request of a protocol, parsed by its format layer."""

    # The conversation in the engine's normal form (chat-completions messages), system first.
    messages: list[dict]
    model: str
    # The request's tool definitions (counted in the input estimate), or None.
    tools: Any
    # Why the request cannot be managed ("" when it can): forwarded as is, with a warning.
    unmanaged: str

    def build(self, rendered: list[dict], prepared: list[dict], previous: Any) -> tuple[dict, Any]:
        """The request body to forward, around the `rendered` history (`prepared` is the message
        list the engine was given, position for position `messages`), and what to remember
        for the session's next request (`previous` is what the last one remembered)."""
        ...


class StreamReader(Protocol):
    """Reads a streamed answer as it is relayed."""

    done: bool
    usage: dict

    def feed(self, data: bytes) -> None: ...

    def answer(self) -> dict | None:
        """The answer in normal form (None when it cannot be rebuilt)."""
        ...


class Format(Protocol):
    """A protocol's format layer."""

    def parse(self, body: dict) -> Exchange | None:
        """None: not a conversation this layer reads (forwarded as is; the upstream judges it)."""
        ...

    def answer(self, body: bytes) -> tuple[dict | None, dict]:
        """A whole (non-streamed) answer: the message in normal form, and the usage reported."""
        ...

    def reader(self) -> StreamReader: ...

    def error(self, status: int, message: str, kind: str) -> dict:
        """An error body in the protocol's shape."""
        ...

    def stream_error(self, message: str) -> bytes:
        """An error event in the protocol's shape, for a stream whose status is sent: the
        protocol's SDKs raise on it."""
        ...


def field(report: Any, name: str) -> Any:
    """A field of an engine report: an object in-process, a dict from the server's client."""
    return report[name] if isinstance(report, dict) else getattr(report, name)
