"""Restore rounds on Anthropic Messages (proxy/interfaces.py `RestoreProtocol`; the I/O is proxy/restores.py).

The restore tool is offered as a Messages tool (`input_schema`) after the agent's own tools. The
rule is chat completions' (chat/restore.py): **an answer's first `tool_use` block decides.** A
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

from contextrender.proxy.messages import wire as anthropic
from contextrender.core import RESTORE_TOOL, content_text, restore_tool
from contextrender.proxy.rounds import Answer, Event, EventRound, EventRounds, reserialised
from contextrender.tools import ask_of

__all__ = ["MESSAGES_ROUNDS", "MessagesRounds", "tool_definition"]


def tool_definition() -> dict:
    """The restore tool as a Messages tool: the chat-completions function's name, text and schema."""
    function = restore_tool()["function"]
    return {"name": function["name"], "description": function["description"], "input_schema": function["parameters"]}


def _is_restore(block: Any) -> bool:
    return isinstance(block, dict) and block.get("type") == "tool_use" and block.get("name") == RESTORE_TOOL


# ---------------------------------------------------------------- streamed answers


@dataclass
class StreamRound(EventRound):
    """One streamed Messages answer. `carry` holds, for the answers of one request, whether the
    agent got the message's start (`started`) and how many content blocks it got (`blocks`)."""

    usage: dict = field(default_factory=dict)
    _json: dict[int, str] = field(default_factory=dict)
    _sent: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        # Whether this answer continues a message the agent already got the start of.
        self._continues = bool(self.carry.get("started"))

    def _is_call(self, part: dict) -> bool:
        return part.get("type") == "tool_use"

    def _is_restore(self, part: dict) -> bool:
        return _is_restore(part)

    def _ends(self, event: Event) -> bool:
        return event.kind in ("message_delta", "message_stop", "error")

    def _shows_text(self, event: Event) -> bool:
        data = event.data or {}
        if event.kind == "content_block_start":
            block = data.get("content_block") or {}
            return block.get("type") not in ("thinking", "redacted_thinking", "text", "tool_use") or bool(block.get("text"))
        delta = data.get("delta") or {}
        return event.kind == "content_block_delta" and delta.get("type") == "text_delta" and bool(delta.get("text"))

    def _was_round(self) -> None:
        self.carry["blocks"] = self.carry.get("blocks", 0) + len(self._sent)

    def _record(self, event: Event) -> None:
        data = event.data or {}
        kind = event.kind
        index = data.get("index")
        if kind == "message_start":
            self.usage = dict((data.get("message") or {}).get("usage") or {})
        elif kind == "content_block_start" and isinstance(index, int):
            block = dict(data.get("content_block") or {})
            self._parts[index] = block
            if _is_restore(block):
                self._withheld.add(index)
        elif kind == "content_block_delta" and index in self._parts:
            (block, delta) = (self._parts[index], data.get("delta") or {})
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
                self._parts[index]["input"] = json.loads(text or "{}")
            except ValueError:
                self._parts[index]["input"] = text  # the handle check names it
        elif kind == "message_delta":
            self.usage.update({k: v for (k, v) in (data.get("usage") or {}).items() if v is not None})

    def _for_agent(self, event: Event) -> bytes:
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
            shifted = self._shift(index, self.carry.get("blocks", 0))
            if shifted != index:
                data = dict(data, index=shifted)
                changed = True
        if kind == "message_delta" and (data.get("delta") or {}).get("stop_reason") == "tool_use" and not any(
                self._is_call(b) and i not in self._withheld for (i, b) in self._parts.items()):
            data = dict(data, delta=dict(data["delta"], stop_reason="end_turn"))
            changed = True
        return reserialised(kind, data) if changed else event.raw


# ---------------------------------------------------------------- the rounds


class MessagesRounds(EventRounds):
    fmt = anthropic.FORMAT
    turns = "messages"
    parts = "content"
    reader = StreamRound

    def tool(self) -> dict:
        return tool_definition()

    def is_call(self, part: dict) -> bool:
        return part.get("type") == "tool_use"

    def is_restore(self, part: Any) -> bool:
        return _is_restore(part)

    def stripped(self, answer: dict) -> None:
        if answer.get("stop_reason") == "tool_use" and not any(b.get("type") == "tool_use" for b in answer["content"]):
            answer["stop_reason"] = "end_turn"

    def offers(self, body: dict, omitted: int, compacted: int) -> bool:
        choice = body.get("tool_choice")
        kind = choice.get("type") if isinstance(choice, dict) else None
        turns = body.get("messages") or []
        prefill = bool(turns) and isinstance(turns[-1], dict) and turns[-1].get("role") == "assistant"
        return bool(omitted or compacted) and kind not in ("none", "tool") and not prefill \
            and isinstance(body.get("tools", []), list)

    def normal(self, added: list) -> list[dict]:
        return anthropic.to_normal({"messages": added})[0]

    def ask(self, call: dict) -> tuple[str, str]:
        given = call.get("input")
        ask = ask_of(given)
        if ask is None:
            raise ValueError(f'the input must be an object with a string "handle", such as {{"handle": "r17"}}, '
                             f'or a "query" to search for one (got {json.dumps(given)})')
        return ask

    def round_turns(self, answer: Answer, contents: list[tuple[Any, bool]]) -> list[dict]:
        # Thinking and text as sent (empty text blocks are refused by the API), restore calls only.
        kept = [b for b in answer.parts if (b.get("type") != "tool_use" or b in answer.restore_calls)
                and not (b.get("type") == "text" and not b.get("text"))]
        results = []
        for (call, (content, failed)) in zip(answer.restore_calls, contents):
            result: dict[str, Any] = {"type": "tool_result", "tool_use_id": call["id"],
                                      "content": content if isinstance(content, (str, list)) else content_text(content)}
            if failed:
                result["is_error"] = True
            results.append(result)
        return [{"role": "assistant", "content": kept}, {"role": "user", "content": results}]

    def session_usage(self, usage: Any) -> dict:
        return anthropic._usage(usage)


MESSAGES_ROUNDS = MessagesRounds()
