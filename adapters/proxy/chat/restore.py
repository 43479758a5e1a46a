"""The proxy's restore loop for chat completions, without its I/O: when to offer the restore tool,
how to read a model's answer (whole or streamed) to tell a restore round from the agent's answer,
and the messages of a round. `proxy/restores.py` sends the requests and relays the bytes.

The rule for every answer, streamed or not: **its first tool call decides.**
- First call `contextrender_restore` (the tool offered): a restore round. The proxy answers every
  restore call from the store, drops the answer's other calls (the model decides them again once
  it has seen what it asked for: a call of the agent's cannot be sent back upstream unanswered),
  and asks the upstream again with the round appended.
- First call one of the agent's tools, or no call at all: the agent's answer. Restore calls in it
  are removed (in a stream, the frames that carry them are withheld; calls after them are
  renumbered, since SDKs place streamed calls by index) and not answered.

A stream is relayed frame by frame as it arrives; frames are held back only while the answer has
shown nothing but a role or empty text (it may still open with a restore call), and from its
first restore call on (to the end of a round). Text that came before a restore call has already
reached the agent: the next answer continues the same response.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from contextrender.core import RESTORE_TOOL, restore_tool
from contextrender.proxy.chat.wire import CHAT, chat_usage
from contextrender.proxy.rounds import sse_frames
from contextrender.tools import ask_of_call, tool_error

__all__ = ["CHAT_ROUNDS", "RESTORE_TOOL", "AnswerCalls", "StreamRound", "declares_restore", "offers_tool",
           "round_messages", "split_answer", "strip_restore_calls", "tool_error", "with_tool"]


def _function_name(call: Any) -> str:
    return str(((call or {}).get("function") or {}).get("name") or "") if isinstance(call, dict) else ""


def declares_restore(body: dict) -> bool:
    """Whether the request already has a tool (or a legacy function) named `contextrender_restore`."""
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    functions = body.get("functions") if isinstance(body.get("functions"), list) else []
    return any(_function_name(t) == RESTORE_TOOL for t in tools) or any(
        isinstance(f, dict) and f.get("name") == RESTORE_TOOL for f in functions
    )


def offers_tool(body: dict, omitted: int, compacted: int) -> bool:
    """Whether the request gets the restore tool: the render omitted or compacted a result, and
    the request neither forbids tools (`tool_choice: "none"`), nor asks for several choices (`n` >
    1: a round needs one answer), nor uses the legacy `functions` field (not to be mixed with
    `tools`), nor sends `tools` that are not a list."""
    return bool(omitted or compacted) and body.get("tool_choice") != "none" and body.get("n") in (None, 1) \
        and "functions" not in body and isinstance(body.get("tools", []), list)


def with_tool(body: dict, offered: bool) -> dict:
    """The request body for one upstream call: the agent's own tools (if any), plus the restore tool
    when offered."""
    out = dict(body)
    if offered:
        out["tools"] = list(body.get("tools") or []) + [restore_tool()]
    return out


@dataclass
class AnswerCalls:
    """An answer's text and its restore calls."""

    content: str | None
    restore_calls: list[dict]
    # The answer's first call is a restore call: a restore round (when the tool was offered).
    restore_first: bool


def split_answer(message: dict) -> AnswerCalls:
    calls = [c for c in (message.get("tool_calls") or []) if isinstance(c, dict)]
    content = message.get("content")
    return AnswerCalls(content if isinstance(content, str) else None,
                       [c for c in calls if _function_name(c) == RESTORE_TOOL],
                       bool(calls) and _function_name(calls[0]) == RESTORE_TOOL)


def round_messages(answer: AnswerCalls, contents: list[Any]) -> list[dict]:
    """The round appended to the next upstream request: the assistant message with its text and
    its restore calls only (in request form), then one tool message per call with its content
    (the stored result, or a tool error)."""
    calls = [
        {"id": c.get("id"), "type": "function",
         "function": {"name": RESTORE_TOOL, "arguments": str((c.get("function") or {}).get("arguments") or "")}}
        for c in answer.restore_calls
    ]
    return [{"role": "assistant", "content": answer.content or None, "tool_calls": calls}] + [
        {"role": "tool", "tool_call_id": call["id"], "content": content} for (call, content) in zip(calls, contents)
    ]


def strip_restore_calls(body: bytes) -> bytes | None:
    """A chat-completions JSON answer without its restore calls (None when it has none). With no
    call left, `tool_calls` goes and `finish_reason` "tool_calls" becomes "stop"."""
    try:
        answer = json.loads(body)
        choice = answer["choices"][0]
        message = choice["message"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    calls = message.get("tool_calls") or []
    kept = [c for c in calls if _function_name(c) != RESTORE_TOOL]
    if len(kept) == len(calls):
        return None
    if kept:
        message["tool_calls"] = kept
    else:
        message.pop("tool_calls", None)
        if choice.get("finish_reason") == "tool_calls":
            choice["finish_reason"] = "stop"
    return json.dumps(answer, ensure_ascii=False).encode()


# ---------------------------------------------------------------- streamed answers


@dataclass
class _Frame:
    raw: bytes
    data: dict | None = None
    done: bool = False

    def choice(self) -> dict | None:
        choices = (self.data or {}).get("choices") if isinstance(self.data, dict) else None
        if not isinstance(choices, list):
            return None
        return next((c for c in choices if isinstance(c, dict) and c.get("index", 0) == 0), None)

    def delta(self) -> dict:
        choice = self.choice()
        delta = choice.get("delta") if choice else None
        return delta if isinstance(delta, dict) else {}


def _parse(raw: bytes) -> _Frame:
    payloads = [line.strip()[5:].strip() for line in raw.splitlines() if line.strip().startswith(b"data:")]
    if not payloads:
        return _Frame(raw)
    payload = b"\n".join(payloads)
    if payload == b"[DONE]":
        return _Frame(raw, done=True)
    try:
        data = json.loads(payload)
    except ValueError:
        return _Frame(raw)
    return _Frame(raw, data if isinstance(data, dict) else None)


@dataclass
class StreamRound:
    """One streamed upstream answer, read frame by frame: `feed` returns the bytes to relay to the
    agent now, `close` what is left at its end; then `restore_round` says whether it was a restore
    round and `answer()` is the answer as the model gave it (text, and every call)."""

    # Whether the restore tool was offered for this answer (else restore calls are only withheld).
    may_restore: bool
    _buffer: bytes = b""
    _phase: str = "undecided"  # undecided | text | agent | restore
    _held: list[_Frame] = field(default_factory=list)
    _texts: list[str] = field(default_factory=list)
    _calls: dict[int, dict] = field(default_factory=dict)
    _withheld: set[int] = field(default_factory=set)
    usage: dict | None = None

    @property
    def restore_round(self) -> bool:
        return self._phase == "restore"

    def answer(self) -> AnswerCalls:
        calls = [self._calls[i] for i in sorted(self._calls)]
        return split_answer({"content": "".join(self._texts) or None, "tool_calls": calls})

    def feed(self, chunk: bytes) -> list[bytes]:
        frames, self._buffer = sse_frames(self._buffer + chunk)
        out: list[bytes] = []
        for raw in frames:
            out.extend(self._frame(_parse(raw)))
        return out

    def close(self) -> list[bytes]:
        """What is left for the agent when the upstream's stream has ended."""
        out: list[bytes] = []
        if self._buffer:
            out.extend(self._frame(_parse(self._buffer)))
            self._buffer = b""
        if self._phase != "restore":
            out.extend(self._flush())
        return out

    def _frame(self, frame: _Frame) -> list[bytes]:
        delta = frame.delta()
        if isinstance(frame.data, dict) and isinstance(frame.data.get("usage"), dict):
            self.usage = frame.data["usage"]
        text = delta.get("content") if isinstance(delta.get("content"), str) else ""
        if text:
            self._texts.append(text)
        parts = [p for p in (delta.get("tool_calls") or []) if isinstance(p, dict)]
        for part in parts:
            self._record(part)
        self._held.append(frame)
        if self._phase == "restore":
            return []
        # Without the tool offered, restore calls are only withheld: the first other call decides.
        deciding = [i for i in sorted(self._calls) if self.may_restore or i not in self._withheld]
        if self._phase in ("undecided", "text") and deciding:
            name = _function_name(self._calls[deciding[0]])
            if name == RESTORE_TOOL:
                self._phase = "restore"  # held to the end: a round, not the agent's answer
                return []
            if name and not RESTORE_TOOL.startswith(name):
                self._phase = "agent"
        if self._phase == "undecided" and (text or delta.get("refusal")):
            self._phase = "text"
        if self._phase == "undecided" and not frame.done and not self._finishes(frame):
            return []  # nothing the agent needs yet: it may still open with a restore call
        return self._flush()

    def _flush(self) -> list[bytes]:
        out = [self._for_agent(frame) for frame in self._held]
        self._held = []
        return [raw for raw in out if raw]

    @staticmethod
    def _finishes(frame: _Frame) -> bool:
        choice = frame.choice()
        return bool(choice and choice.get("finish_reason")) or bool(isinstance(frame.data, dict) and frame.data.get("usage"))

    def _record(self, part: dict) -> None:
        index = part.get("index", 0)
        call = self._calls.setdefault(index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        call["id"] = part.get("id") or call["id"]
        function = part.get("function") or {}
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""
        if _function_name(call) == RESTORE_TOOL:
            self._withheld.add(index)

    def _for_agent(self, frame: _Frame) -> bytes:
        """The frame as the agent gets it: its bytes unchanged, unless it carries parts of restore
        calls (removed), calls numbered after one (renumbered), or the finish of an answer whose
        only calls were restore calls (finish_reason "stop"); b"" when nothing is left of it."""
        choice = frame.choice()
        if not self._withheld or choice is None:
            return frame.raw
        delta = frame.delta()
        parts = delta.get("tool_calls")
        changed = False
        if isinstance(parts, list) and parts:
            kept = []
            for part in parts:
                index = part.get("index", 0) if isinstance(part, dict) else 0
                if index in self._withheld:
                    changed = True
                    continue
                shift = len([w for w in self._withheld if w < index])
                kept.append(dict(part, index=index - shift) if shift else part)
                changed = changed or bool(shift)
            if kept:
                delta["tool_calls"] = kept
            else:
                delta.pop("tool_calls")
                if not any(v for (k, v) in delta.items() if k != "role") and not choice.get("finish_reason"):
                    return b""
        if choice.get("finish_reason") == "tool_calls" and not (set(self._calls) - self._withheld):
            choice["finish_reason"] = "stop"
            changed = True
        if not changed:
            return frame.raw
        ending = b"\r\n\r\n" if frame.raw.endswith(b"\r\n\r\n") else b"\n\n"
        return b"data: " + json.dumps(frame.data, ensure_ascii=False).encode() + ending


# ---------------------------------------------------------------- the protocol's rounds


class ChatRounds:
    """Chat completions' restore rounds (proxy/interfaces.py `RestoreProtocol`), from the functions above."""

    fmt = CHAT

    def declares(self, body: dict) -> bool:
        return declares_restore(body)

    def offers(self, body: dict, omitted: int, compacted: int) -> bool:
        return offers_tool(body, omitted, compacted)

    def payload(self, body: dict, offered: bool, added: list) -> dict:
        return dict(with_tool(body, offered), messages=list(body["messages"]) + added)

    def normal(self, added: list) -> list[dict]:
        return added

    def split(self, body: bytes) -> AnswerCalls | None:
        message = self.fmt.answer(body)[0]
        return split_answer(message) if message else None

    def ask(self, call: dict) -> tuple[str, str]:
        return ask_of_call(call)

    def round_turns(self, answer: AnswerCalls, contents: list[tuple[Any, bool]]) -> list[dict]:
        return round_messages(answer, [content for (content, _) in contents])

    def strip(self, body: bytes) -> bytes | None:
        return strip_restore_calls(body)

    def stream(self, may_restore: bool, carry: dict) -> StreamRound:
        return StreamRound(may_restore=may_restore)

    def session_usage(self, usage: Any) -> dict:
        return chat_usage(usage)


CHAT_ROUNDS = ChatRounds()
