"""What the protocols' restore rounds share: usage summed over an answer's calls (`add_usage`) and a
stream cut into server-sent events (`sse_frames`), for all three; and, for the two event-stream
protocols (Anthropic Messages, Responses): an answer's parts (content blocks, output items) and its restore calls, and a streamed answer read
event by event (`EventRound`), held back while it may still open with a restore call, decided by
its first call, and the `RestoreProtocol` methods that differ only in where a request keeps its turns and an
answer its parts (`EventRounds`). Each protocol's module says which parts are calls, what shows
text, and how an event reaches the agent (`messages/restore.py`, `responses/restore.py`); chat completions' rounds are `chat/restore.py`."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Answer", "Event", "EventRound", "EventRounds", "add_usage", "answer_of", "parse_event", "parts_of", "reserialised",
           "sse_frames"]


def add_usage(total: dict, usage: Any) -> None:
    """Add an answer's token counts (its top-level integer counters, in the protocol's names:
    prompt/completion/total for chat completions, input/output and the cache's for Messages and
    Responses) to `total`."""
    if not isinstance(usage, dict):
        return
    for (key, value) in usage.items():
        if isinstance(value, int) and not isinstance(value, bool):
            total[key] = total.get(key, 0) + value


def sse_frames(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Complete server-sent events in `buffer` (each with its blank-line terminator) and the rest."""
    out: list[bytes] = []
    start = 0
    while True:
        ends = [(buffer.find(sep, start), sep) for sep in (b"\n\n", b"\r\n\r\n")]
        ends = [(at, sep) for (at, sep) in ends if at >= 0]
        if not ends:
            return out, buffer[start:]
        (at, sep) = min(ends)
        out.append(buffer[start:at + len(sep)])
        start = at + len(sep)


@dataclass
class Answer:
    """An answer's parts as the model sent them, and its restore calls."""

    parts: list[dict]
    restore_calls: list[dict]
    # The answer's first call is a restore call: a restore round (when the tool was offered).
    restore_first: bool


def answer_of(parts: list[dict], is_call: Callable[[dict], bool], is_restore: Callable[[dict], bool]) -> Answer:
    calls = [p for p in parts if is_call(p)]
    return Answer(parts, [c for c in calls if is_restore(c)], bool(calls) and is_restore(calls[0]))


def parts_of(body: bytes, key: str) -> list[dict] | None:
    """The parts a whole JSON answer lists under `key` (None when it is no such answer)."""
    try:
        answer = json.loads(body)
    except ValueError:
        return None
    parts = answer.get(key) if isinstance(answer, dict) else None
    return parts if isinstance(parts, list) and all(isinstance(p, dict) for p in parts) else None


class EventRounds:
    """The parts of a protocol's `RestoreProtocol` (proxy/interfaces.py) that the two event-stream protocols
    share. A subclass names where a request keeps its turns (`turns`: "messages", "input") and an
    answer its parts (`parts`: "content", "output"), its restore tool (`tool`), which parts are
    calls and restore calls, and its stream reader (`reader`)."""

    turns: str
    parts: str
    reader: type[EventRound]

    def tool(self) -> dict: raise NotImplementedError

    def is_call(self, part: dict) -> bool: raise NotImplementedError

    def is_restore(self, part: Any) -> bool: raise NotImplementedError

    def stripped(self, answer: dict) -> None:
        """A hook: the whole answer once its restore calls are removed (to fix what names them)."""

    def declares(self, body: dict) -> bool:
        tools = body.get("tools") if isinstance(body.get("tools"), list) else []
        return any(isinstance(t, dict) and t.get("name") == self.tool()["name"] for t in tools)

    def payload(self, body: dict, offered: bool, added: list) -> dict:
        out = dict(body, **{self.turns: list(body[self.turns]) + added})
        if offered:
            out["tools"] = list(body.get("tools") or []) + [self.tool()]
        return out

    def answer(self, parts: list[dict]) -> Answer:
        return answer_of(parts, self.is_call, self.is_restore)

    def split(self, body: bytes) -> Answer | None:
        parts = parts_of(body, self.parts)
        return self.answer(parts) if parts is not None else None

    def strip(self, body: bytes) -> bytes | None:
        try:
            answer = json.loads(body)
            parts = answer[self.parts]
        except (ValueError, KeyError, TypeError):
            return None
        kept = [p for p in parts if not self.is_restore(p)]
        if len(kept) == len(parts):
            return None
        answer[self.parts] = kept
        self.stripped(answer)
        return json.dumps(answer, ensure_ascii=False).encode()

    def stream(self, may_restore: bool, carry: dict) -> EventRound:
        return self.reader(may_restore, carry)


@dataclass
class Event:
    raw: bytes
    data: dict | None

    @property
    def kind(self) -> str:
        return str((self.data or {}).get("type") or "")


def parse_event(raw: bytes) -> Event:
    payloads = [line.strip()[5:].strip() for line in raw.splitlines() if line.strip().startswith(b"data:")]
    try:
        data = json.loads(b"\n".join(payloads)) if payloads else None
    except ValueError:
        data = None
    return Event(raw, data if isinstance(data, dict) else None)


def reserialised(kind: str, data: dict) -> bytes:
    """An event the proxy changed, as the agent gets it."""
    return f"event: {kind}\ndata: ".encode() + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


@dataclass
class EventRound:
    """One streamed answer (proxy/interfaces.py `RoundReader`): `feed` gives the events to relay
    now, `close` the rest. `carry` is shared by the answers of one request (what the agent got)."""

    may_restore: bool
    carry: dict
    _buffer: bytes = b""
    _phase: str = "undecided"  # undecided | text | agent | restore
    _held: list[Event] = field(default_factory=list)
    # The answer's parts by index, and the indices of its restore calls.
    _parts: dict[int, dict] = field(default_factory=dict)
    _withheld: set[int] = field(default_factory=set)
    usage: Any = None

    # What the protocol's module defines.
    def _is_call(self, part: dict) -> bool: raise NotImplementedError

    def _is_restore(self, part: dict) -> bool: raise NotImplementedError

    def _ends(self, event: Event) -> bool: raise NotImplementedError

    def _shows_text(self, event: Event) -> bool: raise NotImplementedError

    def _record(self, event: Event) -> None: raise NotImplementedError

    def _for_agent(self, event: Event) -> bytes: raise NotImplementedError

    def _was_round(self) -> None:
        """The answer was a round: what the agent got of it goes into `carry`."""
        raise NotImplementedError

    @property
    def restore_round(self) -> bool:
        return self._phase == "restore"

    def answer(self) -> Answer:
        return answer_of([self._parts[i] for i in sorted(self._parts)], self._is_call, self._is_restore)

    def feed(self, chunk: bytes) -> list[bytes]:
        frames, self._buffer = sse_frames(self._buffer + chunk)
        return [raw for frame in frames for raw in self._event(parse_event(frame))]

    def close(self) -> list[bytes]:
        out: list[bytes] = []
        if self._buffer.strip():
            out.extend(self._event(parse_event(self._buffer)))
        self._buffer = b""
        if self._phase == "restore":
            self._was_round()
        else:
            out.extend(self._flush())
        return out

    def _event(self, event: Event) -> list[bytes]:
        self._record(event)
        self._held.append(event)
        if self._phase == "restore":
            return []
        # Without the tool offered, restore calls are only withheld: the first other call decides.
        deciding = [i for i in sorted(self._parts) if self._is_call(self._parts[i]) and (self.may_restore or i not in self._withheld)]
        if self._phase in ("undecided", "text") and deciding:
            if self._is_restore(self._parts[deciding[0]]):
                self._phase = "restore"  # held to the end: a round, not the agent's answer
                return []
            self._phase = "agent"
        if self._phase == "undecided" and self._shows_text(event):
            self._phase = "text"
        if self._phase == "undecided" and not self._ends(event):
            return []  # only the start and reasoning so far: it may still open with a restore call
        return self._flush()

    def _flush(self) -> list[bytes]:
        out = [self._for_agent(event) for event in self._held]
        self._held = []
        return [raw for raw in out if raw]

    def _shift(self, index: int, before: int) -> int:
        """A part's index as the agent numbers it: after the `before` parts it got from earlier
        answers, less the restore calls withheld before it."""
        return before + index - len([w for w in self._withheld if w < index])
