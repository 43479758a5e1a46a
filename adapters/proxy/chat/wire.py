"""The chat-completions format layer (`POST /v1/chat/completions`): its messages are the
engine's normal form already; answers are read by `streams.py`."""

from __future__ import annotations

import json
from typing import Any

from contextrender.core import normal_form
from contextrender.proxy.formats import openai_usage
from contextrender.proxy.streams import StreamAnswer, body_answer

__all__ = ["CHAT", "chat_usage"]


def chat_usage(usage: Any) -> dict:
    """A chat-completions usage report as the engine records it."""
    return openai_usage(usage, "prompt_tokens", "completion_tokens")


class _ChatStream(StreamAnswer):
    """streams.StreamAnswer with what the format layers give: the answer in normal form and the
    usage of the last chunk (sent with `stream_options.include_usage`)."""

    @property
    def usage(self) -> dict:
        return chat_usage(self.reported_usage)

    def answer(self) -> dict | None:
        answer = super().answer()
        return normal_form(answer) if answer else None


class _ChatExchange:
    def __init__(self, body: dict) -> None:
        self.body = body
        self.messages: list[dict] = body["messages"]
        self.model = str(body.get("model") or "")
        self.tools = body.get("tools")
        self.unmanaged = ""

    def build(self, rendered: list[dict], prepared: list[dict], previous: Any) -> tuple[dict, Any]:
        return dict(self.body, messages=rendered), None


class _Chat:
    """The chat-completions format layer."""

    def parse(self, body: dict) -> _ChatExchange | None:
        return _ChatExchange(body) if isinstance(body.get("messages"), list) else None

    def answer(self, body: bytes) -> tuple[dict | None, dict]:
        message = body_answer(body)
        try:
            usage = chat_usage(json.loads(body).get("usage"))
        except (ValueError, AttributeError):
            usage = {}
        return (normal_form(message) if message else None), usage

    def reader(self) -> _ChatStream:
        return _ChatStream()

    def error(self, status: int, message: str, kind: str) -> dict:
        return {"error": {"message": message, "type": kind, "code": status}}

    def stream_error(self, message: str) -> bytes:
        # The openai SDK raises APIError on a chunk with an `error` object.
        error = {"message": f"ContextRender proxy: {message}", "type": "upstream_error"}
        return b"data: " + json.dumps({"error": error}, ensure_ascii=False).encode() + b"\n\n"


CHAT = _Chat()
