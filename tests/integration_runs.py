"""What the framework integrations' tests share (tests/test_integrations_*.py, tests/test_tools.py):
the budget a run is rendered to, the files its agent reads and the fake model's scripted reads of
them, how a request's history is read, and which results it leaves out without naming their
handle (in a stub, or in the fold index the render folds them behind: `named_handles`)."""

from __future__ import annotations

import re
from typing import Any

from contextrender.testing.fake_upstream import named_handles, strings
from engine.measure import get_tokenizer
from tests.conftest import call

TOK = get_tokenizer()
BUDGET = 1500
READS = 8
# A stub's handle, in a message's text or in JSON (where its quotes are escaped).
HANDLE = re.compile(r'call contextrender_restore with handle \\?"([rp][0-9]+)\\?"')


def handles_of(engine: Any, session: str) -> dict[str, str]:
    """Call id -> the handle of each result a session stores (an Engine's or a Client's `explain`)."""
    return {d.call_id: d.handle for d in engine.explain(session).decisions}


def unnamed(payload: dict, originals: dict[str, str], handles: dict[str, str]) -> list[str]:
    """The handles of results (`originals`: call id -> text) that a request neither shows whole nor
    names for the restore tool, by a stub or in the fold index (`named_handles`): [] when every
    result it leaves out is one restore away."""
    shown, named = set(strings(payload)), set(named_handles(payload))
    return [h for (c, h) in handles.items() if c in originals and originals[c] not in shown and h not in named]


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
