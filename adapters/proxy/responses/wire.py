"""OpenAI Responses (`POST /v1/responses`: the OpenAI Agents SDK, newer OpenAI clients): the format
layer between a Responses request and the engine's message normal form (chat-completions messages).

In. `instructions` becomes a leading system message (outside B); a string `input` one user
message. Input items: `message` items are messages of their role; each run of model output items
(`reasoning`, assistant `message`, `function_call`) is one assistant message (one model call),
whose function calls are its tool calls and whose reasoning items and text parts are its content
parts; each `function_call_output` is a tool message. Parts are stored without null fields, so a
client's re-serialised echo of an answer is not a history rewrite. A reasoning item counts as one
non-text part toward B (its encrypted content is no text the engine can count).

Out. Every item kept is sent back exactly as the client sent it (the request is the source: the
client resends the whole input every call); an omitted result is a `function_call_output` with the
stub as its output; the fold marker and summaries are user messages; a call shown over selected
results of folded turns goes alone, without its reasoning; reasoning left with no item after it is
dropped (the API refuses it). Everything but `input` is forwarded untouched.

Not managed (forwarded as is, with the `X-ContextRender-Unmanaged` header and a warning once per
session): requests that continue server-side state (`previous_response_id`, `conversation`: the
proxy never sees that history), and inputs holding item types other than those above (hosted tool
calls, item references).
"""

from __future__ import annotations

import json
from typing import Any

from contextrender.proxy.formats import EventReader, cut_arguments, openai_usage, origins_of, plain
from contextrender.core import InvalidRequest, content_text

__all__ = ["FORMAT", "to_normal"]

_MODEL_ITEMS = ("reasoning", "message", "function_call")


def _kind(item: dict) -> str:
    return item.get("type") or ("message" if "role" in item else "")


def _is_model_item(item: dict) -> bool:
    kind = _kind(item)
    return kind in ("reasoning", "function_call") or (kind == "message" and item.get("role") == "assistant")


def _parts(content: Any) -> list:
    if isinstance(content, str):
        return [{"type": "output_text", "text": content}]
    return plain(content) if isinstance(content, list) else []


def _assistant(items: list[dict]) -> dict:
    """One model call's output items as one normal-form assistant message."""
    parts: list = []
    calls: list[dict] = []
    for item in items:
        kind = _kind(item)
        if kind == "function_call":
            calls.append({"id": item["call_id"], "type": "function",
                          "function": {"name": item["name"], "arguments": item.get("arguments") or ""}})
        elif kind == "reasoning":
            parts.append(plain(item))
        else:
            parts.extend(_parts(item.get("content")))
    message: dict[str, Any] = {"role": "assistant", "content": parts or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message


def unmanaged_reason(body: dict) -> str:
    """Why a request cannot be rendered ("" when it can)."""
    for key in ("previous_response_id", "conversation"):
        if body.get(key):
            return f"{key}: the history is kept by the provider, the proxy cannot see it"
    items = body.get("input")
    for (i, item) in enumerate(items if isinstance(items, list) else []):
        kind = _kind(item) if isinstance(item, dict) else ""
        if kind not in ("message", "function_call", "function_call_output", "reasoning"):
            return f"input[{i}] is a {kind or 'untyped'!r} item, which the proxy does not manage"
    return ""


def to_normal(body: dict) -> tuple[list[dict], list[list[dict] | None]]:
    """The conversation of a Responses request in normal form, and for each message the input
    items it came from (None for `instructions` and a string input). Raises InvalidRequest."""
    normal: list[dict] = []
    origins: list[list[dict] | None] = []
    instructions = body.get("instructions")
    if instructions:
        if not isinstance(instructions, str):
            raise InvalidRequest("instructions must be a string")
        normal.append({"role": "system", "content": instructions})
        origins.append(None)
    items = body["input"]
    if isinstance(items, str):
        normal.append({"role": "user", "content": items})
        origins.append(None)
        return normal, origins
    group: list[dict] = []
    for (i, item) in enumerate(items + [None]):
        if item is not None and _is_model_item(item):
            if _kind(item) == "function_call" and not (isinstance(item.get("call_id"), str) and isinstance(item.get("name"), str)):
                raise InvalidRequest(f"input[{i}]: a function_call item needs a string 'call_id' and 'name'")
            group.append(item)
            continue
        if group:
            normal.append(_assistant(group))
            origins.append(group)
            group = []
        if item is None:
            break
        if _kind(item) == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise InvalidRequest(f"input[{i}]: a function_call_output item needs the 'call_id' of the call it answers")
            output = item.get("output")
            normal.append({"role": "tool", "tool_call_id": item["call_id"],
                           "content": output if isinstance(output, str) else plain(output) if isinstance(output, list) else ""})
        else:
            role, content = item.get("role"), item.get("content")
            if role not in ("user", "system", "developer"):
                raise InvalidRequest(f"input[{i}]: a message's role must be user, assistant, system or developer (got {role!r})")
            normal.append({"role": role, "content": content if isinstance(content, str) else plain(content)})
        origins.append([item])
    return normal, origins


def _rebuilt(message: dict, sent: dict | None, origin: list[dict] | None, last: bool = False) -> list[dict]:
    """The input items of one rendered message: as the client sent them when it is unchanged,
    else rebuilt (a stub, the fold marker, a call shown alone, cut text: its reasoning items are
    kept only on the `last` assistant message, since the cut text's count does not hold them)."""
    if origin is not None and message == sent:
        return origin
    role, content = message.get("role"), message.get("content")
    if role == "tool":
        return [{"type": "function_call_output", "call_id": message["tool_call_id"], "output": content_text(content)}]
    if role != "assistant":
        return [{"role": role, "content": content}]
    calls = {c["id"]: c for c in message.get("tool_calls") or []}
    if origin is None:
        out = [{"role": "assistant", "content": content_text(content)}] if content_text(content) else []
        return out + [{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                       "arguments": c["function"]["arguments"]} for c in calls.values()]
    # Content parts are the client's (calls left out at most); a string is a cut text.
    same_text = not isinstance(content, str)
    cut = cut_arguments(message, sent)
    out: list[dict] = []
    cut_placed = False
    for item in origin:
        kind = _kind(item)
        if kind == "function_call":
            if item["call_id"] in cut:
                out.append(item | {"arguments": cut[item["call_id"]]})
            elif item["call_id"] in calls:
                out.append(item)
        elif content is None:
            continue  # only the calls, over results of folded turns
        elif same_text:
            out.append(item)
        elif kind == "reasoning":
            continue  # the cut text's count does not hold them, and Responses does not require them
        elif not cut_placed:
            out.append({"role": "assistant", "content": content_text(content)})
            cut_placed = True
    # Reasoning must be followed by an output item of its call.
    while out and _kind(out[-1]) == "reasoning":
        out.pop()
    return out


def to_items(rendered: list[dict], prepared: list[dict], origins: list[list[dict] | None]) -> list[dict]:
    """Input items for a rendered history (`instructions` is forwarded as the client sent it)."""
    items: list[dict] = []
    found = origins_of(rendered, prepared, [o is not None for o in origins])
    final = max((r for (r, m) in enumerate(rendered) if m.get("role") == "assistant"), default=-1)
    for (r, (message, i)) in enumerate(zip(rendered, found)):
        role = message.get("role")
        if i is None and role in ("system", "developer"):
            continue  # `instructions`, forwarded as it is
        items.extend(_rebuilt(message, prepared[i] if i is not None else None, origins[i] if i is not None else None, last=r == final))
    return items


# ---------------------------------------------------------------- the format layer


class _Exchange:
    def __init__(self, body: dict) -> None:
        self.body = body
        self.model = str(body.get("model") or "")
        self.tools = body.get("tools")
        self.unmanaged = unmanaged_reason(body)
        if self.unmanaged:
            # Enough to name the session.
            first = body.get("input")
            self.messages = ([{"role": "system", "content": body["instructions"]}] if isinstance(body.get("instructions"), str) else []) + (
                [{"role": "user", "content": first}] if isinstance(first, str) else [])
            self.origins: list = []
        else:
            self.messages, self.origins = to_normal(body)

    def build(self, rendered: list[dict], prepared: list[dict], previous: Any) -> tuple[dict, Any]:
        if isinstance(self.body["input"], str):
            return self.body, None  # one user message: the current one, never rendered away
        return dict(self.body, input=to_items(rendered, prepared, self.origins)), None


def _answer(response: Any) -> tuple[dict | None, dict]:
    if not isinstance(response, dict):
        return None, {}
    usage = openai_usage(response.get("usage"), "input_tokens", "output_tokens")
    output = response.get("output")
    if not isinstance(output, list) or not output or not all(isinstance(i, dict) and _is_model_item(i) for i in output):
        return None, usage
    return _assistant(output), usage


class _Stream:
    """Reads the answer from the `response.completed` (or `.incomplete`) event, which carries the
    whole response."""

    def __init__(self) -> None:
        self._events = EventReader()
        self._response: Any = None
        self.done = False

    @property
    def usage(self) -> dict:
        return _answer(self._response)[1]

    def feed(self, data: bytes) -> None:
        for (_, payload) in self._events.feed(data):
            if '"response.completed"' not in payload and '"response.incomplete"' not in payload:
                continue  # deltas: the final event repeats them whole
            try:
                event = json.loads(payload)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("type") in ("response.completed", "response.incomplete"):
                self._response = event.get("response")
                self.done = True

    def answer(self) -> dict | None:
        return _answer(self._response)[0]


class _Responses:
    def parse(self, body: dict) -> _Exchange | None:
        items = body.get("input")
        if not (isinstance(items, str) or (isinstance(items, list) and all(isinstance(i, dict) for i in items))):
            return None
        return _Exchange(body)

    def answer(self, body: bytes) -> tuple[dict | None, dict]:
        try:
            return _answer(json.loads(body))
        except ValueError:
            return None, {}

    def reader(self) -> _Stream:
        return _Stream()

    def error(self, status: int, message: str, kind: str) -> dict:
        return {"error": {"message": message, "type": kind, "param": None, "code": status}}

    def stream_error(self, message: str) -> bytes:
        # The Responses `error` event (openai-agents raises on it), with an `error` object too:
        # the openai SDK raises APIError on that.
        text = f"ContextRender proxy: {message}"
        data = {"type": "error", "code": "upstream_error", "message": text, "param": None,
                "error": {"message": text, "type": "upstream_error"}}
        return b"event: error\ndata: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


FORMAT = _Responses()
