"""What the proxy needs of its backend (the in-process `Engine`, or a `Client` of a running
server) and of a protocol's format layer (chat completions, Anthropic Messages, Responses)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from contextrender import core

__all__ = ["Backend", "Exchange", "Format", "RoundReader", "RestoreProtocol", "StreamReader", "field", "sent_unchanged"]


class Backend(Protocol):
    """What the proxy needs from the engine: `Engine` and `Client` both have it."""

    def render(self, session_id: str, messages: list[dict], *, budget: int, selector: str = "", **params: Any) -> Any: ...

    def ingest(self, session_id: str, messages: list[dict], *, append: bool = False, at: int = -1, usage: dict | None = None) -> Any: ...

    def get_session(self, session_id: str) -> dict: ...

    def create_session(self, session_id: str, *, name: str = "") -> dict: ...

    def configure(self, session_id: str, **params: Any) -> Any: ...

    def restore(self, session_id: str, handle: str) -> Any: ...

    def search_results(self, session_id: str, query: str, *, limit: int = 5) -> Any: ...


def sent_unchanged(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`call(*args, **kwargs)` under the proxy's promise never to change a message it sends, nor
    anything in it (engine/messages.jac SENT_UNCHANGED; tests/test_proxy_bodies.py checks that
    a parsed history is never changed in place): an in-process engine's index keeps the proxy's
    own messages, and the next request's resent history, the same objects (the parsed prefix
    `Bodies` keeps, the normal forms and answers `reconcile` keeps), is compared by identity.
    It covers what a render returns too: the proxy builds its bodies around the rendered
    messages without changing one (copied where it adds to them), and an in-process engine
    hands it the index's own (adapters/local.py `_unshared`), not copies. A server backend
    parses what it is sent: the promise has nothing to keep there."""
    promised = core.SENT_UNCHANGED.set(True)
    try:
        return call(*args, **kwargs)
    finally:
        core.SENT_UNCHANGED.reset(promised)


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


class RoundReader(Protocol):
    """One streamed upstream answer during a request that may take restore rounds: `feed` gives
    the bytes to relay to the agent now, `close` what is left at the end; then `restore_round`
    says whether the answer was a restore round, `answer()` is it as the model gave it, and
    `usage` its usage as the protocol reported it."""

    restore_round: bool
    usage: Any

    def feed(self, chunk: bytes) -> list[bytes]: ...

    def close(self) -> list[bytes]: ...

    def answer(self) -> Any: ...


class RestoreProtocol(Protocol):
    """A protocol's restore rounds (proxy/restores.py does the I/O): when the restore tool may be
    offered, how it is added, how an answer tells a round from the agent's answer, and the turns a
    round appends. An answer is the protocol's own (`split` reads a whole one, `stream` a
    streamed one); its `restore_first` says whether its first tool call is a restore call, and
    `restore_calls` are the restore calls."""

    fmt: Format

    def declares(self, body: dict) -> bool:
        """Whether the request declares a tool of the restore tool's name itself."""
        ...

    def offers(self, body: dict, omitted: int, compacted: int) -> bool:
        """Whether this request can be given the restore tool (the render left a result out)."""
        ...

    def payload(self, body: dict, offered: bool, added: list) -> dict:
        """The body of one upstream call: the agent's request, the tool when `offered`, and the
        turns of the rounds so far (`added`)."""
        ...

    def normal(self, added: list) -> list[dict]:
        """The turns of rounds in the engine's normal form (to count their tokens)."""
        ...

    def split(self, body: bytes) -> Any:
        """A whole answer's restore calls (None when it is not an answer)."""
        ...

    def ask(self, call: Any) -> tuple[str, str]:
        """What a restore call asks for: `("handle", "r17")` or `("query", "words")` (tools.py
        `ask_of`; ValueError saying what to fix)."""
        ...

    def round_turns(self, answer: Any, contents: list[tuple[Any, bool]]) -> list:
        """The turns a round appends: the answer with its restore calls only, then each call's
        answer (`contents`: the restored content, or an error text and True)."""
        ...

    def strip(self, body: bytes) -> bytes | None:
        """A whole answer without its restore calls (None when it has none)."""
        ...

    def stream(self, may_restore: bool, carry: dict) -> RoundReader:
        """A reader of one streamed answer; `carry` is shared by the answers of one request (what
        the agent was sent already: a round's next answer continues the same response)."""
        ...

    def session_usage(self, usage: Any) -> dict:
        """A reported usage as the session records it."""
        ...


def field(report: Any, name: str) -> Any:
    """A field of an engine report: an object in-process, a dict from the server's client."""
    return report[name] if isinstance(report, dict) else getattr(report, name)
