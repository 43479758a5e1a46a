"""What the fake upstream refuses, as the real services do: Anthropic Messages turns whose
`tool_use` blocks go unanswered, whose thinking blocks lack the signature the fake gave them, or
that carry more than 4 cache breakpoints; Responses inputs whose function calls and outputs do not
pair up."""

from __future__ import annotations

import base64
import hashlib

__all__ = ["messages_problem", "responses_problem", "signature"]


def signature(thinking: str) -> str:
    """The signature the fake gives a thinking block (and checks when it comes back)."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()



def messages_problem(body: dict) -> str:
    """What Anthropic would refuse in a request's turns ("" for nothing)."""
    turns = body.get("messages") or []
    for (k, turn) in enumerate(turns):
        blocks = turn.get("content") if isinstance(turn.get("content"), list) else []
        for block in blocks:
            if block.get("type") == "thinking" and block.get("signature") != signature(block.get("thinking", "")):
                return f"messages.{k}: Invalid `signature` in `thinking` block"
        calls = [b["id"] for b in blocks if b.get("type") == "tool_use"]
        following = turns[k + 1] if k + 1 < len(turns) else None
        if calls and following is not None:
            answered = [b.get("tool_use_id") for b in following.get("content") or [] if isinstance(b, dict) and b.get("type") == "tool_result"]
            if following.get("role") != "user" or set(calls) - set(answered):
                return f"messages.{k}: `tool_use` ids were found without `tool_result` blocks immediately after: {sorted(set(calls) - set(answered))}"
        previous = turns[k - 1] if k > 0 else None
        results = [b.get("tool_use_id") for b in blocks if b.get("type") == "tool_result"]
        called = [b.get("id") for b in (previous or {}).get("content") or [] if isinstance(b, dict) and b.get("type") == "tool_use"] if previous else []
        if set(results) - set(called):
            return f"messages.{k}: unexpected `tool_use_id` found in `tool_result` blocks: {sorted(set(results) - set(called))}"
    markers = sum(1 for t in turns for b in (t.get("content") if isinstance(t.get("content"), list) else []) if b.get("cache_control"))
    markers += sum(1 for b in body.get("system") or [] if isinstance(b, dict) and b.get("cache_control"))
    markers += sum(1 for b in body.get("tools") or [] if isinstance(b, dict) and b.get("cache_control"))
    if markers > 4:
        return f"A maximum of 4 blocks with cache_control may be provided. Found {markers}."
    return ""


def responses_problem(body: dict) -> str:
    """What the Responses API would refuse in a request's input ("" for nothing)."""
    items = body.get("input") if isinstance(body.get("input"), list) else []
    called: set = set()
    for (i, item) in enumerate(items):
        if item.get("type") == "function_call":
            called.add(item["call_id"])
        elif item.get("type") == "function_call_output":
            if item.get("call_id") not in called:
                return f"No tool call found for function call output with call_id {item.get('call_id')}."
            called.discard(item["call_id"])
    if called:
        return f"No tool output found for function call {sorted(called)[0]}."
    return ""
