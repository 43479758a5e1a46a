"""Restore rounds on OpenAI Responses (proxy/interfaces.py `RestoreProtocol`; the I/O is proxy/restores.py).

The restore tool is offered as a Responses function tool after the agent's own tools. The rule is
chat completions' (chat/restore.py): **an answer's first `function_call` item decides.** A restore
call first is a round: the answer's output items go back upstream as input, as the model sent them
(`reasoning` items with their encrypted content, `message` items) with its restore calls only, each
answered by a `function_call_output` item, and the upstream is asked again. An agent's call first,
or none, is the agent's answer: restore calls in it are removed from `output`.

Not offered when the request forbids tools (`tool_choice` "none") or forces one (`tool_choice` an
object naming a function, or `allowed_tools` in mode "required" that leave the restore tool out:
the model could not call it).

A stream is relayed event by event; events are held back while the answer has shown nothing but
its start and reasoning (it may still open with a restore call), and from its first restore call
on. Text before a restore call has reached the agent: the next answer continues the same response
(its `response.created` / `in_progress` are not sent again, its items are numbered after those
sent, `response.completed` lists them all under the first response's id, and the events'
`sequence_number` keeps counting).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from contextrender.proxy.responses import wire as responses
from contextrender.core import RESTORE_TOOL, content_text, restore_tool
from contextrender.proxy.rounds import Answer, Event, EventRound, EventRounds, reserialised
from contextrender.proxy.formats import openai_usage
from contextrender.tools import ask_of_call

__all__ = ["RESPONSES_ROUNDS", "ResponsesRounds", "tool_definition"]

_START = ("response.created", "response.in_progress", "response.queued")
_END = ("response.completed", "response.incomplete", "response.failed", "error")


def tool_definition() -> dict:
    """The restore tool as a Responses function tool: the chat-completions function's name, text
    and schema (strict: every property is required and no other is allowed)."""
    function = restore_tool()["function"]
    return {"type": "function", "name": function["name"], "description": function["description"],
            "parameters": function["parameters"], "strict": True}


def _restore(item: Any) -> bool:
    return isinstance(item, dict) and item.get("type") == "function_call" and item.get("name") == RESTORE_TOOL


# ---------------------------------------------------------------- streamed answers


@dataclass
class StreamRound(EventRound):
    """One streamed Responses answer. `carry` holds, for the answers of one request, the first
    response's id once the agent got its start (`id`), the output items the agent got (`items`),
    and the next `sequence_number` (`sequence`)."""

    _sent: dict[int, dict] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._continues = "id" in self.carry

    def _is_call(self, part: dict) -> bool:
        return part.get("type") == "function_call"

    def _is_restore(self, part: dict) -> bool:
        return _restore(part)

    def _ends(self, event: Event) -> bool:
        return event.kind in _END

    def _shows_text(self, event: Event) -> bool:
        data = event.data or {}
        if event.kind == "response.output_item.added":
            return (data.get("item") or {}).get("type") not in ("reasoning", "message", "function_call")
        return event.kind in ("response.output_text.delta", "response.refusal.delta") and bool(data.get("delta"))

    def _was_round(self) -> None:
        self.carry["items"] = list(self.carry.get("items", [])) + [self._sent[i] for i in sorted(self._sent)]

    def _record(self, event: Event) -> None:
        data = event.data or {}
        index = data.get("output_index")
        if event.kind in ("response.output_item.added", "response.output_item.done") and isinstance(index, int):
            item = data.get("item") if isinstance(data.get("item"), dict) else {}
            self._parts[index] = item
            if _restore(item):
                self._withheld.add(index)
        elif event.kind in _END:
            response = data.get("response") if isinstance(data.get("response"), dict) else {}
            self.usage = response.get("usage")
            output = response.get("output")
            if isinstance(output, list):  # the items whole, as the model gave them
                self._parts = {i: item for (i, item) in enumerate(output) if isinstance(item, dict)}

    def _for_agent(self, event: Event) -> bytes:
        """The event as the agent gets it: its bytes unchanged, unless it belongs to a restore call
        (removed), starts a continued response again (removed), is numbered after a removed item
        or a previous answer's items, or ends a continued response (renumbered, and the
        response's output is every item the agent got)."""
        data = event.data
        if data is None:
            return event.raw
        kind = event.kind
        changed = False
        if kind in _START:
            if self._continues:
                return b""
            self.carry.setdefault("id", (data.get("response") or {}).get("id"))
        index = data.get("output_index")
        if isinstance(index, int):
            if index in self._withheld:
                return b""
            if kind == "response.output_item.done" and isinstance(data.get("item"), dict):
                self._sent[index] = data["item"]
            shifted = self._shift(index, len(self.carry.get("items", [])))
            if shifted != index:
                data = dict(data, output_index=shifted)
                changed = True
        if kind in _END and isinstance(data.get("response"), dict) and (self._withheld or self._continues):
            response = data["response"]
            output = [i for i in response.get("output") or [] if not _restore(i)]
            data = dict(data, response=dict(response, id=self.carry.get("id") or response.get("id"),
                                            output=list(self.carry.get("items", [])) + output))
            changed = True
        sequence = self.carry.get("sequence", 0)
        self.carry["sequence"] = sequence + 1
        if "sequence_number" in data and data["sequence_number"] != sequence:
            data = dict(data, sequence_number=sequence)
            changed = True
        return reserialised(kind, data) if changed else event.raw


# ---------------------------------------------------------------- the rounds


class ResponsesRounds(EventRounds):
    fmt = responses.FORMAT
    turns = "input"
    parts = "output"
    reader = StreamRound

    def tool(self) -> dict:
        return tool_definition()

    def is_call(self, part: dict) -> bool:
        return part.get("type") == "function_call"

    def is_restore(self, part: Any) -> bool:
        return _restore(part)

    def offers(self, body: dict, omitted: int, compacted: int) -> bool:
        choice = body.get("tool_choice")
        forced = isinstance(choice, dict) and (choice.get("type") == "function" or (
            choice.get("type") == "allowed_tools" and choice.get("mode") == "required"))
        return bool(omitted or compacted) and choice != "none" and not forced and isinstance(body.get("input"), list) \
            and isinstance(body.get("tools", []), list)

    def normal(self, added: list) -> list[dict]:
        return responses.to_normal({"input": added})[0]

    def ask(self, call: dict) -> tuple[str, str]:
        return ask_of_call({"function": {"arguments": call.get("arguments") or ""}})

    def round_turns(self, answer: Answer, contents: list[tuple[Any, bool]]) -> list[dict]:
        kept = [i for i in answer.parts if i.get("type") != "function_call" or i in answer.restore_calls]
        outputs = [{"type": "function_call_output", "call_id": call["call_id"],
                    "output": content if isinstance(content, str) else content_text(content)}
                   for (call, (content, _)) in zip(answer.restore_calls, contents)]
        return kept + outputs

    def session_usage(self, usage: Any) -> dict:
        return openai_usage(usage, "input_tokens", "output_tokens")


RESPONSES_ROUNDS = ResponsesRounds()
