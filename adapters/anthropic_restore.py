"""Restore rounds on Anthropic Messages (proxy/interfaces.py `Rounds`; the I/O is proxy/restores.py).

The restore tool is offered as a Messages tool (`input_schema`) after the agent's own tools. The
rule is chat completions' (restore_loop.py): **an answer's first `tool_use` block decides.** A
restore call first is a round: the proxy answers it with a `tool_result` turn and asks again with
the answer appended as an assistant turn, its `thinking` / `redacted_thinking` blocks exactly as
the model sent them (text, signature and all: the API checks them) and its restore calls only
(the agent's calls are decided again once the model has seen what it asked for). An agent's call
first, or no call, is the agent's answer: restore calls in it are removed, and `stop_reason`
"tool_use" becomes "end_turn" when no call is left. The request's `cache_control` breakpoints go
upstream untouched at every round.

Not offered when the request forbids tools (`tool_choice` "none"), forces one tool (`tool_choice`
"tool": the model could not call another), or ends with an assistant turn (a prefill: the answer
continues it, a round could not).

A stream is relayed event by event; events are held back while the answer has shown nothing but
its start and thinking (it may still open with a restore call), and from its first restore call on.
Text before a restore call has reached the agent: the next answer continues the same message (its
`message_start` and `ping` are not sent again, its blocks are numbered after those sent).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from contextrender_adapters import anthropic
from contextrender_adapters.core import RESTORE_TOOL, content_text, restore_tool
from contextrender_adapters.restore_loop import _frames

__all__ = ["MESSAGES_ROUNDS", "MessagesRounds", "tool_definition"]


def tool_definition() -> dict:
    """The restore tool as a Messages tool: the chat-completions function's name, text and schema."""
    function = restore_tool()["function"]
    return {"name": function["name"], "description": function["description"], "input_schema": function["parameters"]}


@dataclass
class Answer:
    """An answer's content blocks, as the model sent them, and its restore calls."""

    blocks: list[dict]
    restore_calls: list[dict]
    restore_first: bool


def _answer(blocks: list[dict]) -> Answer:
    uses = [b for b in blocks if b.get("type") == "tool_use"]
    return Answer(blocks, [b for b in uses if b.get("name") == RESTORE_TOOL], bool(uses) and uses[0].get("name") == RESTORE_TOOL)


class MessagesRounds:
    fmt = anthropic.FORMAT

    def declares(self, body: dict) -> bool:
        tools = body.get("tools") if isinstance(body.get("tools"), list) else []
        return any(isinstance(t, dict) and t.get("name") == RESTORE_TOOL for t in tools)

    def offers(self, body: dict, omitted: int, compacted: int) -> bool:
        choice = body.get("tool_choice")
        kind = choice.get("type") if isinstance(choice, dict) else None
        turns = body.get("messages") or []
        prefill = bool(turns) and isinstance(turns[-1], dict) and turns[-1].get("role") == "assistant"
        return bool(omitted or compacted) and kind not in ("none", "tool") and not prefill \
            and isinstance(body.get("tools", []), list)

    def payload(self, body: dict, offered: bool, added: list) -> dict:
        out = dict(body, messages=list(body["messages"]) + added)
        if offered:
            out["tools"] = list(body.get("tools") or []) + [tool_definition()]
        return out

    def split(self, body: bytes) -> Answer | None:
        try:
            answer = json.loads(body)
        except ValueError:
            return None
        content = answer.get("content") if isinstance(answer, dict) else None
        if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
            return None
        return _answer(content)

    def handle(self, call: dict) -> str:
        given = call.get("input")
        if not isinstance(given, dict) or not isinstance(given.get("handle"), str):
            raise ValueError(f'the input must be an object with a string "handle", such as {{"handle": "r17"}} (got {json.dumps(given)})')
        return given["handle"].strip()

    def round_turns(self, answer: Answer, contents: list[tuple[Any, bool]]) -> list[dict]:
        # Thinking and text as sent (empty text blocks are refused by the API), restore calls only.
        kept = [b for b in answer.blocks if (b.get("type") != "tool_use" or b in answer.restore_calls)
                and not (b.get("type") == "text" and not b.get("text"))]
        results = []
        for (call, (content, failed)) in zip(answer.restore_calls, contents):
            result: dict[str, Any] = {"type": "tool_result", "tool_use_id": call["id"],
                                      "content": content if isinstance(content, (str, list)) else content_text(content)}
            if failed:
                result["is_error"] = True
            results.append(result)
        return [{"role": "assistant", "content": kept}, {"role": "user", "content": results}]

    def strip(self, body: bytes) -> bytes | None:
        try:
            answer = json.loads(body)
            content = answer["content"]
        except (ValueError, KeyError, TypeError):
            return None
        kept = [b for b in content if not (isinstance(b, dict) and b.get("type") == "tool_use" and b.get("name") == RESTORE_TOOL)]
        if len(kept) == len(content):
            return None
        answer["content"] = kept
        if answer.get("stop_reason") == "tool_use" and not any(b.get("type") == "tool_use" for b in kept):
            answer["stop_reason"] = "end_turn"
        return json.dumps(answer, ensure_ascii=False).encode()

    def stream(self, may_restore: bool, carry: dict) -> StreamRound:
        return StreamRound(may_restore, carry)

    def session_usage(self, usage: Any) -> dict:
        return anthropic._usage(usage)

    def stream_error(self, message: str) -> bytes:
        error = {"type": "error", "error": {"type": "api_error", "message": f"ContextRender proxy: {message}"}}
        return b"event: error\ndata: " + json.dumps(error).encode() + b"\n\n"


MESSAGES_ROUNDS = MessagesRounds()


# ---------------------------------------------------------------- streamed answers


@dataclass
class _Event:
    raw: bytes
    data: dict | None

    @property
    def kind(self) -> str:
        return str((self.data or {}).get("type") or "")


def _parse(raw: bytes) -> _Event:
    payloads = [line.strip()[5:].strip() for line in raw.splitlines() if line.strip().startswith(b"data:")]
    try:
        data = json.loads(b"\n".join(payloads)) if payloads else None
    except ValueError:
        data = None
    return _Event(raw, data if isinstance(data, dict) else None)


@dataclass
class StreamRound:
    """One streamed Messages answer (proxy/interfaces.py `RoundReader`). `carry` holds, for the
    answers of one request, whether the agent got the message's start (`started`) and how many
    content blocks it got (`blocks`)."""

    may_restore: bool
    carry: dict
    _buffer: bytes = b""
    _phase: str = "undecided"  # undecided | text | agent | restore
    _held: list[_Event] = field(default_factory=list)
    _blocks: dict[int, dict] = field(default_factory=dict)
    _json: dict[int, str] = field(default_factory=dict)
    _withheld: set[int] = field(default_factory=set)
    _sent: set[int] = field(default_factory=set)
    usage: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Whether this answer continues a message the agent already got the start of.
        self._continues = bool(self.carry.get("started"))

    @property
    def restore_round(self) -> bool:
        return self._phase == "restore"

    def answer(self) -> Answer:
        return _answer([self._blocks[i] for i in sorted(self._blocks)])

    def feed(self, chunk: bytes) -> list[bytes]:
        frames, self._buffer = _frames(self._buffer + chunk)
        return [raw for frame in frames for raw in self._event(_parse(frame))]

    def close(self) -> list[bytes]:
        out: list[bytes] = []
        if self._buffer.strip():
            out.extend(self._event(_parse(self._buffer)))
        self._buffer = b""
        if self._phase != "restore":
            out.extend(self._flush())
        if self._phase == "restore":
            self.carry["blocks"] = self.carry.get("blocks", 0) + len(self._sent)
        return out

    def _event(self, event: _Event) -> list[bytes]:
        self._record(event)
        self._held.append(event)
        if self._phase == "restore":
            return []
        deciding = [i for i in sorted(self._blocks) if self._blocks[i].get("type") == "tool_use"
                    and (self.may_restore or i not in self._withheld)]
        if self._phase in ("undecided", "text") and deciding:
            if self._blocks[deciding[0]].get("name") == RESTORE_TOOL:
                self._phase = "restore"
                return []
            self._phase = "agent"
        if self._phase == "undecided" and self._shows_text(event):
            self._phase = "text"
        if self._phase == "undecided" and event.kind not in ("message_delta", "message_stop", "error"):
            return []  # only the start and thinking so far: it may still open with a restore call
        return self._flush()

    @staticmethod
    def _shows_text(event: _Event) -> bool:
        data = event.data or {}
        if event.kind == "content_block_start":
            block = data.get("content_block") or {}
            return block.get("type") not in ("thinking", "redacted_thinking", "text", "tool_use") or bool(block.get("text"))
        delta = data.get("delta") or {}
        return event.kind == "content_block_delta" and delta.get("type") == "text_delta" and bool(delta.get("text"))

    def _record(self, event: _Event) -> None:
        data = event.data or {}
        kind = event.kind
        index = data.get("index")
        if kind == "message_start":
            self.usage = dict((data.get("message") or {}).get("usage") or {})
        elif kind == "content_block_start" and isinstance(index, int):
            block = dict(data.get("content_block") or {})
            self._blocks[index] = block
            if block.get("type") == "tool_use" and block.get("name") == RESTORE_TOOL:
                self._withheld.add(index)
        elif kind == "content_block_delta" and index in self._blocks:
            (block, delta) = (self._blocks[index], data.get("delta") or {})
            step = delta.get("type")
            if step == "text_delta":
                block["text"] = block.get("text", "") + str(delta.get("text") or "")
            elif step == "thinking_delta":
                block["thinking"] = block.get("thinking", "") + str(delta.get("thinking") or "")
            elif step == "signature_delta":
                block["signature"] = delta.get("signature")
            elif step == "input_json_delta":
                self._json[index] = self._json.get(index, "") + str(delta.get("partial_json") or "")
            elif step == "citations_delta":
                block["citations"] = (block.get("citations") or []) + [delta.get("citation")]
        elif kind == "content_block_stop" and index in self._json:
            text = self._json.pop(index)
            try:
                self._blocks[index]["input"] = json.loads(text or "{}")
            except ValueError:
                self._blocks[index]["input"] = text  # the handle check names it
        elif kind == "message_delta":
            self.usage.update({k: v for (k, v) in (data.get("usage") or {}).items() if v is not None})

    def _flush(self) -> list[bytes]:
        out = [self._for_agent(event) for event in self._held]
        self._held = []
        return [raw for raw in out if raw]

    def _for_agent(self, event: _Event) -> bytes:
        """The event as the agent gets it: its bytes unchanged, unless it belongs to a restore call
        (removed), starts a continued message again (removed), is numbered after a removed block
        or a previous answer's blocks (renumbered), or ends an answer whose only calls were restore
        calls (`stop_reason` "end_turn")."""
        data = event.data
        if data is None:
            return event.raw
        kind = event.kind
        if kind in ("message_start", "ping"):
            if self._continues:
                return b""
            self.carry["started"] = True
            return event.raw
        index = data.get("index")
        changed = False
        if isinstance(index, int) and kind.startswith("content_block"):
            if index in self._withheld:
                return b""
            self._sent.add(index)
            shifted = self.carry.get("blocks", 0) + index - len([w for w in self._withheld if w < index])
            if shifted != index:
                data = dict(data, index=shifted)
                changed = True
        if kind == "message_delta" and (data.get("delta") or {}).get("stop_reason") == "tool_use" and not any(
                b.get("type") == "tool_use" and i not in self._withheld for (i, b) in self._blocks.items()):
            data = dict(data, delta=dict(data["delta"], stop_reason="end_turn"))
            changed = True
        if not changed:
            return event.raw
        return f"event: {kind}\ndata: ".encode() + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"
