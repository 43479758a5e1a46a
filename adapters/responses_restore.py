"""Restore rounds on OpenAI Responses (proxy/interfaces.py `Rounds`; the I/O is proxy/restores.py).

The restore tool is offered as a Responses function tool after the agent's own tools. The rule is
chat completions' (restore_loop.py): **an answer's first `function_call` item decides.** A restore
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

from contextrender_adapters import responses
from contextrender_adapters.core import RESTORE_TOOL, content_text, restore_tool
from contextrender_adapters.formats import openai_usage
from contextrender_adapters.restore_loop import _frames

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


@dataclass
class Answer:
    """An answer's output items, as the model sent them, and its restore calls."""

    items: list[dict]
    restore_calls: list[dict]
    restore_first: bool


def _answer(items: list[dict]) -> Answer:
    calls = [i for i in items if i.get("type") == "function_call"]
    return Answer(items, [i for i in calls if _restore(i)], bool(calls) and _restore(calls[0]))


class ResponsesRounds:
    fmt = responses.FORMAT

    def declares(self, body: dict) -> bool:
        tools = body.get("tools") if isinstance(body.get("tools"), list) else []
        return any(isinstance(t, dict) and t.get("name") == RESTORE_TOOL for t in tools)

    def offers(self, body: dict, omitted: int, compacted: int) -> bool:
        choice = body.get("tool_choice")
        forced = isinstance(choice, dict) and (choice.get("type") == "function" or (
            choice.get("type") == "allowed_tools" and choice.get("mode") == "required"))
        return bool(omitted or compacted) and choice != "none" and not forced and isinstance(body.get("input"), list) \
            and isinstance(body.get("tools", []), list)

    def payload(self, body: dict, offered: bool, added: list) -> dict:
        out = dict(body, input=list(body["input"]) + added)
        if offered:
            out["tools"] = list(body.get("tools") or []) + [tool_definition()]
        return out

    def split(self, body: bytes) -> Answer | None:
        try:
            answer = json.loads(body)
        except ValueError:
            return None
        output = answer.get("output") if isinstance(answer, dict) else None
        if not isinstance(output, list) or not all(isinstance(i, dict) for i in output):
            return None
        return _answer(output)

    def handle(self, call: dict) -> str:
        arguments = call.get("arguments") or ""
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict) or not isinstance(parsed.get("handle"), str):
            raise ValueError(f'the arguments must be a JSON object with a string "handle", such as {{"handle": "r17"}} (got {arguments!r})')
        return parsed["handle"].strip()

    def round_turns(self, answer: Answer, contents: list[tuple[Any, bool]]) -> list[dict]:
        kept = [i for i in answer.items if i.get("type") != "function_call" or i in answer.restore_calls]
        outputs = [{"type": "function_call_output", "call_id": call["call_id"],
                    "output": content if isinstance(content, str) else content_text(content)}
                   for (call, (content, _)) in zip(answer.restore_calls, contents)]
        return kept + outputs

    def strip(self, body: bytes) -> bytes | None:
        try:
            answer = json.loads(body)
            output = answer["output"]
        except (ValueError, KeyError, TypeError):
            return None
        kept = [i for i in output if not _restore(i)]
        if len(kept) == len(output):
            return None
        answer["output"] = kept
        return json.dumps(answer, ensure_ascii=False).encode()

    def stream(self, may_restore: bool, carry: dict) -> StreamRound:
        return StreamRound(may_restore, carry)

    def session_usage(self, usage: Any) -> dict:
        return openai_usage(usage, "input_tokens", "output_tokens")

    def stream_error(self, message: str) -> bytes:
        error = {"type": "error", "code": "upstream_error", "message": f"ContextRender proxy: {message}", "param": None,
                 "sequence_number": 0}
        return b"event: error\ndata: " + json.dumps(error).encode() + b"\n\n"


RESPONSES_ROUNDS = ResponsesRounds()


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
    """One streamed Responses answer (proxy/interfaces.py `RoundReader`). `carry` holds, for the
    answers of one request, the first response's id once the agent got its start (`id`), the
    output items the agent got (`items`), and the next `sequence_number` (`sequence`)."""

    may_restore: bool
    carry: dict
    _buffer: bytes = b""
    _phase: str = "undecided"  # undecided | text | agent | restore
    _held: list[_Event] = field(default_factory=list)
    _items: dict[int, dict] = field(default_factory=dict)
    _withheld: set[int] = field(default_factory=set)
    _sent: dict[int, dict] = field(default_factory=dict)
    usage: Any = None

    def __post_init__(self) -> None:
        self._continues = "id" in self.carry

    @property
    def restore_round(self) -> bool:
        return self._phase == "restore"

    def answer(self) -> Answer:
        return _answer([self._items[i] for i in sorted(self._items)])

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
        else:
            self.carry["items"] = list(self.carry.get("items", [])) + [self._sent[i] for i in sorted(self._sent)]
        return out

    def _event(self, event: _Event) -> list[bytes]:
        self._record(event)
        self._held.append(event)
        if self._phase == "restore":
            return []
        deciding = [i for i in sorted(self._items) if self._items[i].get("type") == "function_call"
                    and (self.may_restore or i not in self._withheld)]
        if self._phase in ("undecided", "text") and deciding:
            if _restore(self._items[deciding[0]]):
                self._phase = "restore"
                return []
            self._phase = "agent"
        if self._phase == "undecided" and self._shows_text(event):
            self._phase = "text"
        if self._phase == "undecided" and event.kind not in _END:
            return []  # only the start and reasoning so far: it may still open with a restore call
        return self._flush()

    @staticmethod
    def _shows_text(event: _Event) -> bool:
        data = event.data or {}
        if event.kind == "response.output_item.added":
            return (data.get("item") or {}).get("type") not in ("reasoning", "message", "function_call")
        return event.kind in ("response.output_text.delta", "response.refusal.delta") and bool(data.get("delta"))

    def _record(self, event: _Event) -> None:
        data = event.data or {}
        index = data.get("output_index")
        if event.kind in ("response.output_item.added", "response.output_item.done") and isinstance(index, int):
            item = data.get("item") if isinstance(data.get("item"), dict) else {}
            self._items[index] = item
            if _restore(item):
                self._withheld.add(index)
        elif event.kind in _END:
            response = data.get("response") if isinstance(data.get("response"), dict) else {}
            self.usage = response.get("usage")
            output = response.get("output")
            if isinstance(output, list):  # the items whole, as the model gave them
                self._items = {i: item for (i, item) in enumerate(output) if isinstance(item, dict)}

    def _flush(self) -> list[bytes]:
        out = [self._for_agent(event) for event in self._held]
        self._held = []
        return [raw for raw in out if raw]

    def _for_agent(self, event: _Event) -> bytes:
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
            before = len(self.carry.get("items", []))
            shifted = before + index - len([w for w in self._withheld if w < index])
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
        if not changed:
            return event.raw
        return f"event: {kind}\ndata: ".encode() + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"
