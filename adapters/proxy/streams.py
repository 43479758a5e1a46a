"""Reading the assistant's answer out of an upstream chat-completions response: a JSON body or
an SSE stream, possibly compressed. The proxy relays the bytes untouched and reads a copy; the
answer comes back as the upstream sent it (the proxy puts it in its stored normal form)."""

from __future__ import annotations

import json
import zlib
from typing import Any

__all__ = ["Decoder", "StreamAnswer", "body_answer"]


class Decoder:
    """Decodes a (possibly compressed) upstream body so the answer can be read; the bytes sent
    to the client are never touched."""

    def __init__(self, encoding: str) -> None:
        encoding = encoding.strip().lower()
        self.ok = encoding in ("", "identity", "gzip", "deflate")
        self._z = None
        if encoding == "gzip":
            self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif encoding == "deflate":
            self._z = zlib.decompressobj()

    def feed(self, chunk: bytes) -> bytes:
        return self._z.decompress(chunk) if self._z else chunk


class StreamAnswer:
    """Rebuilds the assistant message from chat-completions SSE chunks (choice 0): `answer()`
    gives it once the stream is complete and has one choice."""

    def __init__(self) -> None:
        self._buffer = b""
        self.message: dict[str, Any] = {"role": "assistant"}
        self._texts: dict[str, list[str]] = {}
        self._calls: dict[int, dict] = {}
        self.choices: set[int] = set()
        # The last chunk's `usage` (sent with `stream_options.include_usage`), as reported.
        self.reported_usage: Any = None
        self.done = False
        self.broken = False

    def feed(self, data: bytes) -> None:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            try:
                chunk = json.loads(payload)
                for choice in chunk.get("choices") or []:
                    self._choice(choice)
                if chunk.get("usage"):
                    self.reported_usage = chunk["usage"]
            except (ValueError, AttributeError, TypeError):
                self.broken = True

    def _choice(self, choice: dict) -> None:
        self.choices.add(choice.get("index", 0))
        if choice.get("index", 0) != 0:
            return
        delta = choice.get("delta") or {}
        for key, value in delta.items():
            if key == "tool_calls":
                for part in value or []:
                    call = self._calls.setdefault(
                        part.get("index", 0), {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                    )
                    call["id"] = part.get("id") or call["id"]
                    call["type"] = part.get("type") or call["type"]
                    function = part.get("function") or {}
                    call["function"]["name"] += function.get("name") or ""
                    call["function"]["arguments"] += function.get("arguments") or ""
            elif key == "role":
                self.message["role"] = value or "assistant"
            elif isinstance(value, str):
                self._texts.setdefault(key, []).append(value)

    def answer(self) -> dict | None:
        if self.broken or len(self.choices) != 1 or not (self._texts or self._calls):
            return None
        message = dict(self.message)
        for key, parts in self._texts.items():
            message[key] = "".join(parts)
        message.setdefault("content", None)
        if self._calls:
            message["tool_calls"] = [self._calls[i] for i in sorted(self._calls)]
        return message


def body_answer(body: bytes) -> dict | None:
    """The assistant message of a chat-completions JSON answer (one choice), as sent."""
    try:
        choices = json.loads(body).get("choices") or []
    except (ValueError, AttributeError):
        return None
    if len(choices) != 1 or not isinstance(choices[0].get("message"), dict):
        return None
    return choices[0]["message"]
