"""The protocols the proxy manages, one row each: the path a request comes on, its format layer (what
it sends and reads: `wire.py`) and its restore rounds (`restore.py`), each in its own folder
(chat/, messages/, responses/). A new protocol is a folder and a row here."""

from __future__ import annotations

from dataclasses import dataclass

from contextrender.proxy.chat.restore import CHAT_ROUNDS
from contextrender.proxy.chat.wire import CHAT
from contextrender.proxy.interfaces import Format, RestoreProtocol
from contextrender.proxy.messages.restore import MESSAGES_ROUNDS
from contextrender.proxy.messages.wire import FORMAT as MESSAGES
from contextrender.proxy.responses.restore import RESPONSES_ROUNDS
from contextrender.proxy.responses.wire import FORMAT as RESPONSES

__all__ = ["PROTOCOLS", "Protocol", "format_of_path", "format_of_request"]


@dataclass(frozen=True)
class Protocol:
    name: str
    path: str
    format: Format
    rounds: RestoreProtocol
    # What a request of this protocol must hold (the 400's message when it does not).
    needs: str
    # The key of a request's history in its body (what an agent re-sends and adds to).
    history: str


PROTOCOLS = (
    Protocol("chat", "/v1/chat/completions", CHAT, CHAT_ROUNDS,
             "a chat completions request is a JSON object with `messages`, a list of messages", "messages"),
    Protocol("messages", "/v1/messages", MESSAGES, MESSAGES_ROUNDS,
             "a Messages request is a JSON object with `messages`, a list of turns", "messages"),
    Protocol("responses", "/v1/responses", RESPONSES, RESPONSES_ROUNDS,
             "a Responses request is a JSON object with `input`, a string or a list of items (objects)", "input"),
)


def format_of_path(path: str) -> Format:
    """The format whose errors a passthrough path answers with: a managed protocol's sub-path (Anthropic's
    `/v1/messages/count_tokens`, batches) gets that protocol's; anything else chat completions'."""
    return next((p.format for p in PROTOCOLS if path.startswith(p.path + "/")), CHAT)


def format_of_request(path: str) -> Format:
    """The format whose errors a request on `path` gets: a managed protocol's, else `format_of_path`'s."""
    return next((p.format for p in PROTOCOLS if path == p.path), None) or format_of_path(path)
