"""What the tests check of every rendered chat-completions list before a provider would see it (the
engine itself never renders an unpaired list; tests/test_traces.py and the protocol tests hold it to that)."""

from __future__ import annotations


def pairing_problems(messages: list[dict]) -> list[str]:
    """Why `messages` is not a valid chat-completions list for OpenAI and Anthropic: every
    assistant tool call answered by a tool message before the next non-tool message, and every
    tool message answering a call of the assistant message just before it. Empty: valid."""
    problems: list[str] = []
    open_calls: set[str] = set()
    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in open_calls:
                problems.append(f"messages[{i}] answers {call_id!r}, which the preceding assistant message did not call")
            open_calls.discard(call_id)
            continue
        if open_calls:
            problems.append(f"messages[{i}]: calls {sorted(open_calls)} have no tool message")
            open_calls = set()
        if role == "assistant":
            open_calls = {call["id"] for call in message.get("tool_calls") or []}
    return problems
