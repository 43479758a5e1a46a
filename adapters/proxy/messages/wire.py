"""Anthropic Messages (`POST /v1/messages`: Claude Code, the Anthropic SDKs): the format layer
between a Messages request and the engine's message normal form (chat-completions messages).

In. The top-level `system` becomes a leading system message (outside B, stored on the session),
and a `system` turn inside `messages` a system message where it stands; each user turn becomes
one `tool` message per `tool_result` block (in order), then a user message with its other blocks
(text, images, documents), if any; each assistant turn one assistant
message whose `tool_use` blocks are its tool calls and whose other blocks (text, `thinking`,
`redacted_thinking`, server tool blocks) are its content parts. Blocks are stored without
`cache_control` and without null fields, so the breakpoints a client moves from call to call,
and an SDK's re-serialised answer, are not history rewrites. A thinking block's text counts
toward B (engine.measure); other non-text blocks count as one part each.

Out. The request is rebuilt from the rendered history: every message kept as it was is sent back
exactly as the client sent it (the request itself is the source: a client resends the whole
conversation every call, so nothing has to be remembered between calls), `thinking` blocks and
their signatures included; an omitted result is a `tool_result` stub with the same `tool_use_id`;
the fold marker and summaries are user text; a shortened message keeps its thinking and calls
with its text cut. What came from one client turn is one turn again (that turn exactly as sent
when it is all there unchanged, else its blocks with the results first), so every `tool_use` is
answered in the next turn; the marker and summaries are turns of their own (the API combines
consecutive turns of one role). `system`, `tools` and every other field are forwarded untouched.

The prompt cache breakpoints it places are `anthropic_cache.py`'s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from contextrender.proxy.messages.cache import CACHE, MAX_BREAKPOINTS, NO_BREAKPOINT, as_blocks, bare, breakpoints
from contextrender.core import InvalidRequest, content_text
from contextrender.proxy.formats import EventReader, arguments, cut_arguments, origins_of, plain, usage_counts

__all__ = ["FORMAT", "MAX_BREAKPOINTS", "breakpoints", "to_normal"]

_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


@dataclass
class Origin:
    """Where a normal-form message came from: the client's turn (its index in `messages`), the
    blocks of that turn it holds (with their cache markers), or the turn's content when that was
    a plain string."""

    turn: int
    blocks: list[dict] = field(default_factory=list)
    string: str | None = None


# ---------------------------------------------------------------- in: Messages -> normal form


# A call's input as JSON, by call id: every request repeats the conversation's calls, and this
# was a quarter of the conversion's time. The input is compared before its JSON is reused.
_ARGUMENTS: dict[str, tuple[Any, str]] = {}
_ARGUMENTS_KEPT = 100_000


def _arguments(call_id: str, value: Any) -> str:
    known = _ARGUMENTS.get(call_id)
    if known is not None and known[0] == value:
        return known[1]
    text = arguments(value)
    _ARGUMENTS[call_id] = (value, text)
    if len(_ARGUMENTS) > _ARGUMENTS_KEPT:
        del _ARGUMENTS[next(iter(_ARGUMENTS))]  # the oldest
    return text


def _assistant(blocks: list[dict]) -> dict:
    """An assistant turn's blocks as one normal-form assistant message."""
    calls = [
        {"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": _arguments(b["id"], b.get("input", {}))}}
        for b in blocks if b.get("type") == "tool_use"
    ]
    parts = [bare(b) for b in blocks if b.get("type") != "tool_use"]
    # The chat-completions rule the engine stores by: null beside calls, else "".
    message: dict[str, Any] = {"role": "assistant", "content": parts or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message


def _check_blocks(where: str, content: Any) -> None:
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}: content must be a string or a list of content blocks")
    for (j, block) in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise InvalidRequest(f"{where}.content[{j}]: each content block must be an object with a 'type'")
        if block["type"] == "tool_use" and not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)):
            raise InvalidRequest(f"{where}.content[{j}]: a tool_use block needs a string 'id' and 'name'")
        if block["type"] == "tool_result" and not isinstance(block.get("tool_use_id"), str):
            raise InvalidRequest(f"{where}.content[{j}]: a tool_result block needs the 'tool_use_id' of the call it answers")


def to_normal(body: dict) -> tuple[list[dict], list[Origin | None]]:
    """The conversation of a Messages request in normal form, and each message's origin (None
    for the system prompt). Raises InvalidRequest naming the part to fix."""
    normal: list[dict] = []
    origins: list[Origin | None] = []
    system = body.get("system")
    if system is not None:
        if isinstance(system, list):
            _check_blocks("system", system)
            system = [bare(b) for b in system]
        elif not isinstance(system, str):
            raise InvalidRequest("system must be a string or a list of text blocks")
        normal.append({"role": "system", "content": system})
        origins.append(None)
    for (k, message) in enumerate(body["messages"]):
        where = f"messages[{k}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
            raise InvalidRequest(f"{where}: each message must be an object with role 'user', 'assistant' or 'system'")
        role, content = message["role"], message.get("content")
        if isinstance(content, str):
            normal.append({"role": role, "content": content})
            origins.append(Origin(k, string=content))
            continue
        _check_blocks(where, content)
        if role == "system":
            normal.append({"role": "system", "content": [bare(b) for b in content]})
            origins.append(Origin(k, blocks=content))
            continue
        if role == "assistant":
            if any(b["type"] == "tool_result" for b in content):
                raise InvalidRequest(f"{where}: tool_result blocks belong in user turns")
            normal.append(_assistant(content))
            origins.append(Origin(k, blocks=content))
            continue
        if any(b["type"] == "tool_use" for b in content):
            raise InvalidRequest(f"{where}: tool_use blocks belong in assistant turns")
        results = [b for b in content if b["type"] == "tool_result"]
        for block in results:
            result = block.get("content")
            tool = {"role": "tool", "tool_call_id": block["tool_use_id"],
                    "content": "" if result is None else (result if isinstance(result, str) else plain(result, frozenset({CACHE})))}
            if block.get("is_error"):
                tool["is_error"] = True
            normal.append(tool)
            origins.append(Origin(k, blocks=[block]))
        rest = [b for b in content if b["type"] != "tool_result"]
        if rest or not results:
            normal.append({"role": "user", "content": [bare(b) for b in rest]})
            origins.append(Origin(k, blocks=rest))
    return normal, origins


# ---------------------------------------------------------------- out: rendered history -> Messages


def _from_rendered(message: dict, sent: dict | None, origin: Origin | None, last: bool = False) -> list[dict] | str:
    """The blocks of one rendered message: as the client sent them when it is unchanged
    (`sent` is the normal form the engine was given for `origin`), else rebuilt. A cut message
    keeps its thinking only when it is the `last` assistant turn (Anthropic wants the thinking of
    a tool loop's turn back; older thinking may go, and the cut text's count does not hold it)."""
    if origin is not None and message == sent:
        return origin.string if origin.string is not None else origin.blocks
    role, content = message.get("role"), message.get("content")
    if role == "tool":  # a stub or a compacted result
        return [{"type": "tool_result", "tool_use_id": message["tool_call_id"], "content": content if content is not None else ""}]
    calls = {c["id"]: c for c in message.get("tool_calls") or []}
    if role == "assistant" and origin is not None and origin.string is None:
        # The client's turn with some calls left out (their results were dropped, or it stands
        # over selected results of folded turns: content null), or its text cut (content a string
        # where the client sent blocks).
        same_text = not isinstance(content, str)
        cut = cut_arguments(message, sent)
        out: list[dict] = []
        cut_placed = False
        for block in origin.blocks:
            kind = block.get("type")
            if kind == "tool_use":
                if block.get("id") in cut:
                    out.append(block | {"input": json.loads(cut[block["id"]] or "{}")})
                elif block.get("id") in calls:
                    out.append(block)
            elif content is None:
                continue
            elif same_text or (kind != "text" and (last or kind not in NO_BREAKPOINT)):
                out.append(block)  # thinking and its signature as sent
            elif kind != "text":
                continue
            elif not cut_placed:
                out.append({"type": "text", "text": content_text(content)})
                cut_placed = True
        return out
    out = [{"type": "text", "text": content}] if isinstance(content, str) and content else list(content or []) if isinstance(content, list) else []
    for call in calls.values():
        out.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                    "input": json.loads(call["function"]["arguments"] or "{}")})
    return out


def to_messages(rendered: list[dict], prepared: list[dict], origins: list[Origin | None], client: list[dict]) -> list[dict]:
    """Messages turns for a rendered history. The messages that came from one client turn form
    one turn again: that turn exactly as the client sent it when all of them are there unchanged,
    else their blocks (results first, as Anthropic requires); the fold marker and summaries are
    turns of their own (consecutive turns of one role are combined by the API). The top-level
    `system` is forwarded as the client sent it; `system` turns stay where they are."""
    groups: list[tuple[str, int | None, list[tuple[list[dict] | str, bool]]]] = []
    found = origins_of(rendered, prepared, [o is not None for o in origins])
    final = max((r for (r, m) in enumerate(rendered) if m.get("role") == "assistant"), default=-1)
    for (r, (message, i)) in enumerate(zip(rendered, found)):
        role = message.get("role")
        if role in ("system", "developer") and i is None:
            continue
        origin = origins[i] if i is not None else None
        content = _from_rendered(message, prepared[i] if i is not None else None, origin, last=r == final)
        if role == "assistant" and isinstance(content, list) and all(b.get("type") in NO_BREAKPOINT for b in content):
            continue  # nothing left but reasoning (or nothing): not a turn Anthropic takes
        side = role if role in ("assistant", "system") else "user"
        piece = (content, message == prepared[i] if i is not None else False)
        if origin is not None and groups and groups[-1][1] == origin.turn:
            groups[-1][2].append(piece)
        else:
            groups.append((side, origin.turn if origin is not None else None, [piece]))
    pieces = {}
    for origin in origins:
        if origin is not None:
            pieces[origin.turn] = pieces.get(origin.turn, 0) + 1
    turns: list[dict] = []
    for (side, k, parts) in groups:
        if k is not None and len(parts) == pieces[k] and all(same for (_, same) in parts):
            turns.append({"role": side, "content": client[k]["content"]})
            continue
        if len(parts) == 1:
            turns.append({"role": side, "content": parts[0][0]})
            continue
        joined = [b for (content, _) in parts for b in as_blocks(content)]
        # A user turn answering calls starts with its results (Anthropic requires it).
        joined = [b for b in joined if b.get("type") == "tool_result"] + [b for b in joined if b.get("type") != "tool_result"]
        turns.append({"role": side, "content": joined})
    problems = turn_pairing_problems(turns)
    if problems:
        raise ValueError(f"the rebuilt Messages request is not valid: {problems[0]}")
    return turns


def turn_pairing_problems(turns: list[dict]) -> list[str]:
    """Why `turns` break Anthropic's rule: every `tool_use` answered by a `tool_result` in the
    next turn, a user turn, and every `tool_result` answering a call of the turn before."""
    problems: list[str] = []
    for (k, turn) in enumerate(turns):
        blocks = turn["content"] if isinstance(turn["content"], list) else []
        results = {b.get("tool_use_id") for b in blocks if b.get("type") == "tool_result"}
        calls = set()
        if k > 0 and turns[k - 1]["role"] == "assistant" and isinstance(turns[k - 1]["content"], list):
            calls = {b.get("id") for b in turns[k - 1]["content"] if b.get("type") == "tool_use"}
        if turn["role"] == "user" and results - calls:
            problems.append(f"messages[{k}] answers {sorted(results - calls)}, not called in the turn before")
        if turn["role"] == "assistant":
            mine = {b.get("id") for b in blocks if b.get("type") == "tool_use"}
            after = turns[k + 1] if k + 1 < len(turns) else None
            answered = set()
            if after is not None and after["role"] == "user" and isinstance(after["content"], list):
                answered = {b.get("tool_use_id") for b in after["content"] if b.get("type") == "tool_result"}
            if mine - answered and after is not None:
                problems.append(f"messages[{k}] calls {sorted(mine - answered)} with no tool_result in the next turn")
    return problems


# ---------------------------------------------------------------- the format layer


class _Exchange:
    def __init__(self, body: dict) -> None:
        self.body = body
        self.messages, self.origins = to_normal(body)
        self.model = str(body.get("model") or "")
        self.tools = body.get("tools")
        self.unmanaged = ""

    def build(self, rendered: list[dict], prepared: list[dict], previous: Any) -> tuple[dict, Any]:
        turns = to_messages(rendered, prepared, self.origins, self.body["messages"])
        # A re-rendered history changes early, so the client's breakpoints at its end write
        # entries no later request reads: they move to the end of the stable prefix. A history
        # sent as it came keeps them (they are right for a growing conversation), plus that one.
        memo = breakpoints(self.body, turns, previous, move=rendered != prepared)
        return dict(self.body, messages=turns), memo


def _usage(usage: Any) -> dict:
    if not isinstance(usage, dict):
        return {}
    return usage_counts(usage.get("input_tokens"), usage.get("cache_read_input_tokens"),
                        usage.get("cache_creation_input_tokens"), usage.get("output_tokens"))


class _Stream:
    """Rebuilds the answer from Messages SSE events (message_start, content_block_start / delta /
    stop, message_delta, message_stop), as the Anthropic SDK accumulates it."""

    def __init__(self) -> None:
        self._events = EventReader()
        self._blocks: dict[int, dict] = {}
        self._json: dict[int, str] = {}
        self._usage: dict = {}
        self.done = False
        self.broken = False

    @property
    def usage(self) -> dict:
        return _usage(self._usage)

    def feed(self, data: bytes) -> None:
        for (_, payload) in self._events.feed(data):
            try:
                self._event(json.loads(payload))
            except (ValueError, KeyError, TypeError, AttributeError):
                self.broken = True

    def _event(self, event: dict) -> None:
        kind = event.get("type")
        if kind == "message_start":
            self._usage = dict(event["message"].get("usage") or {})
        elif kind == "content_block_start":
            self._blocks[event["index"]] = dict(event["content_block"])
        elif kind == "content_block_delta":
            block, delta = self._blocks[event["index"]], event["delta"]
            step = delta.get("type")
            if step == "text_delta":
                block["text"] = block.get("text", "") + delta["text"]
            elif step == "thinking_delta":
                block["thinking"] = block.get("thinking", "") + delta["thinking"]
            elif step == "signature_delta":
                block["signature"] = delta["signature"]
            elif step == "input_json_delta":
                self._json[event["index"]] = self._json.get(event["index"], "") + delta["partial_json"]
            elif step == "citations_delta":
                block["citations"] = (block.get("citations") or []) + [delta["citation"]]
        elif kind == "content_block_stop":
            if event["index"] in self._json:
                self._blocks[event["index"]]["input"] = json.loads(self._json.pop(event["index"]) or "{}")
        elif kind == "message_delta":
            # Cumulative counts: they replace the message_start ones they repeat.
            self._usage.update({k: v for (k, v) in (event.get("usage") or {}).items() if v is not None})
        elif kind == "message_stop":
            self.done = True
        elif kind == "error":
            self.broken = True

    def answer(self) -> dict | None:
        if self.broken or not self.done or not self._blocks:
            return None
        return _assistant([self._blocks[i] for i in sorted(self._blocks)])


class _Messages:
    def parse(self, body: dict) -> _Exchange | None:
        return _Exchange(body) if isinstance(body.get("messages"), list) else None

    def answer(self, body: bytes) -> tuple[dict | None, dict]:
        try:
            payload = json.loads(body)
        except ValueError:
            return None, {}
        if not isinstance(payload, dict):
            return None, {}
        usage = _usage(payload.get("usage"))
        content = payload.get("content")
        if payload.get("type") != "message" or not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
            return None, usage
        return _assistant(content), usage

    def reader(self) -> _Stream:
        return _Stream()

    def error(self, status: int, message: str, kind: str) -> dict:
        if status in _ERROR_TYPES:
            kind = _ERROR_TYPES[status]
        elif status >= 500:
            kind = "api_error"
        else:
            kind = "invalid_request_error"
        return {"type": "error", "error": {"type": kind, "message": message}}

    def stream_error(self, message: str) -> bytes:
        # The event Anthropic sends when a stream fails midway (the SDK raises on `event: error`).
        data = {"type": "error", "error": {"type": "api_error", "message": f"ContextRender proxy: {message}"}}
        return b"event: error\ndata: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


FORMAT = _Messages()
