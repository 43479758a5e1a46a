"""What the framework integrations' tests share (tests/test_integrations_*.py): the budget a run
is rendered to, the files its agent reads and the fake model's scripted reads of them, and how a
request's history and the handles its stubs name are read."""

from __future__ import annotations

import re

from engine.measure import get_tokenizer
from tests.conftest import call

TOK = get_tokenizer()
BUDGET = 1500
READS = 8
# A stub's handle, in a message's text or in JSON (where its quotes are escaped).
HANDLE = re.compile(r'call contextrender_restore with handle \\?"([rp][0-9]+)\\?"')


def named_handles(text: str) -> list[str]:
    """The handles a request names: its stubs' first, then its fold index's entries (a tool's line,
    "read_file results: r1 (src/f0.py) r2 (src/f1.py)"), in `text` or in its JSON."""
    lines = re.findall(r"results: ([^\n\"\\]*)", text)
    return HANDLE.findall(text) + [h for line in lines for h in re.findall(r"(?<!\w)([rp][0-9]+)(?!\w)", line)]


def body(path: str) -> str:
    """What the agent's read_file tool returns for `path`."""
    return " ".join(f"{path}_line_{j} = value_{j}" for j in range(40))


def script_reads(upstream, count: int, start: int = 0, narrate: bool = True) -> None:
    """The fake model's next answers: one read_file call each (with a sentence before it when
    `narrate`), of src/f<i>.py."""
    for i in range(start, start + count):
        upstream.enqueue(content=f"Reading file {i}." if narrate else None,
                         tool_calls=[call(f"call_{i}", "read_file", {"path": f"src/f{i}.py"})])


def history_of(request_json: dict) -> list[dict]:
    """A chat-completions request's history: without the system prompt and the current user turn."""
    messages = [m for m in request_json["messages"] if m["role"] not in ("system", "developer")]
    return messages[:-1] if messages and messages[-1]["role"] == "user" else messages
