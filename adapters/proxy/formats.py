"""What the protocols' format layers share: server-sent events read incrementally, the usage
counters the engine records, and the canonical form of an answer's parts."""

from __future__ import annotations

import json
from typing import Any

from contextrender.core import content_text

__all__ = ["EventReader", "arguments", "cut_arguments", "openai_usage", "origins_of", "plain", "usage_counts"]


def usage_counts(uncached: Any = None, cache_read: Any = None, cache_write: Any = None, output: Any = None) -> dict:
    """A provider's reported usage as the engine records it (walkers.ingest.USAGE_KEYS): the
    input split into uncached tokens and tokens read from or written to the prompt cache; the
    counts a provider did not report are left out."""
    counts = {
        "input_tokens": uncached, "cache_read_input_tokens": cache_read,
        "cache_creation_input_tokens": cache_write, "output_tokens": output,
    }
    return {k: v for (k, v) in counts.items() if isinstance(v, int) and not isinstance(v, bool) and v >= 0}


def openai_usage(usage: Any, total: str, output: str) -> dict:
    """OpenAI's usage report (its `total` input counter includes the cached tokens, given in
    `<total>_details.cached_tokens`) as the engine records it."""
    if not isinstance(usage, dict):
        return {}
    details = usage.get(f"{total}_details")
    cached = (details.get("cached_tokens") if isinstance(details, dict) else None) or 0
    whole = usage.get(total)
    if not isinstance(whole, int) or not isinstance(cached, int):
        return usage_counts(output=usage.get(output))
    return usage_counts(whole - cached, cached, None, usage.get(output))


def plain(value: Any, drop: frozenset[str] = frozenset()) -> Any:
    """`value` with null fields left out, and the keys in `drop`, at every depth. SDKs echo an
    answer's parts with the optional fields they model set to null; the engine compares messages
    exactly, so stored answers and their echoes are kept in this form."""
    if isinstance(value, dict):
        return {k: plain(v, drop) for (k, v) in value.items() if v is not None and k not in drop}
    if isinstance(value, list):
        return [plain(v, drop) for v in value]
    return value


def arguments(value: Any) -> str:
    """A tool call's input as the JSON string of a chat-completions call (one spelling for every
    copy, so an echoed call equals the stored one)."""
    return json.dumps(value, ensure_ascii=False)


def cut_arguments(message: dict, sent: dict | None) -> dict[str, str]:
    """The calls of a rendered assistant message whose arguments the render cut (a call over
    results of a folded turn, `folded_call_room`), by id, with the arguments as rendered: a format
    layer rebuilding the client's own call parts sends these instead, so the request stays within B."""
    given = {c.get("id"): c for c in (sent or {}).get("tool_calls") or []}
    cut: dict[str, str] = {}
    for call in message.get("tool_calls") or []:
        original = given.get(call.get("id"))
        shown = (call.get("function") or {}).get("arguments")
        if original is not None and shown != (original.get("function") or {}).get("arguments"):
            cut[call["id"]] = shown
    return cut


class EventReader:
    """Splits an event stream (`event:` and `data:` lines, a blank line ends an event) into
    (event name, data) pairs as chunks arrive."""

    def __init__(self) -> None:
        self._buffer = b""
        self._event = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[tuple[str, str]]:
        """The events completed by `chunk`, in order."""
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        events: list[tuple[str, str]] = []
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8", "replace")
            if not line:
                if self._data or self._event:
                    events.append((self._event, "\n".join(self._data)))
                self._event, self._data = "", []
                continue
            if line.startswith(":"):
                continue  # a comment (keep-alive)
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                self._event = value
            elif field == "data":
                self._data.append(value)
        return events

    def close(self) -> list[tuple[str, str]]:
        """Events left when the stream ended without a final blank line."""
        return self.feed(b"\n\n") if self._buffer or self._data or self._event else []


def origins_of(rendered: list[dict], prepared: list[dict], known: list[bool]) -> list[int | None]:
    """For each rendered message, the position in `prepared` (the list the engine was given) of
    the message it shows, or None (the fold marker, a summary, a cut text). Only positions with
    `known` True are candidates. Results and calls are found by their ids; other messages by role
    and content, latest first: the history after a fold is the end of the conversation in order,
    so matching from the end gives each shown message its own position even when equal texts
    recur (one agent's reminders), whose copies may differ in what the normal form leaves out."""
    by_result: dict[str, int] = {}
    by_call: dict[str, int] = {}
    # Candidates by role and text (cheap to compute); equal content is checked on lookup.
    by_text: dict[tuple[str, str], list[int]] = {}
    for (i, message) in enumerate(prepared):
        if not known[i]:
            continue
        if message.get("role") == "tool":
            by_result[message.get("tool_call_id")] = i
            continue
        for call in message.get("tool_calls") or []:
            by_call[call["id"]] = i
        by_text.setdefault((message.get("role"), content_text(message.get("content"))), []).append(i)
    found: list[int | None] = [None] * len(rendered)
    cursor = len(prepared)
    for r in range(len(rendered) - 1, -1, -1):
        message = rendered[r]
        calls = message.get("tool_calls") or []
        if message.get("role") == "tool":
            i = by_result.get(message.get("tool_call_id"))
        elif calls:
            i = by_call.get(calls[0]["id"])
        else:
            same = by_text.get((message.get("role"), content_text(message.get("content"))), [])
            i = next((j for j in reversed(same) if j < cursor and prepared[j].get("content") == message.get("content")), None)
        if i is not None:
            found[r] = i
            cursor = i
    return found
