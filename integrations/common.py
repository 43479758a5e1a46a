"""What the Python integrations share: one render that fails open, and the alignment of a rendered
chat-completions list with the framework's own messages (so each framework rebuilds its message
objects, keeping the ones the render left as they were).

A render keeps a message, replaces a tool result's content (a stub, or a compacted result), cuts
an assistant's or user's text (condensed prose), drops a call with its result, folds the oldest
turns away and puts a user-role marker in their place. `align` tells, for every rendered message,
which original message it came from (or none: the fold marker).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["Aligned", "align", "render_or_none", "session_name"]


def session_name(framework: str, conversation_id: Any) -> str:
    """The ContextRender session of one framework conversation: `<framework>-<its own id>`."""
    return f"{framework}-{conversation_id}"


def render_or_none(backend: Any, session_id: str, messages: list[dict], *, budget: int, selector: str = "",
                   log: logging.Logger, **params: Any) -> Any:
    """`backend.render(...)`, or None (logged) when ContextRender is down or refuses: the caller
    then sends the framework's own messages unchanged."""
    start = time.perf_counter()
    try:
        rendered = backend.render(session_id, messages, budget=budget, selector=selector, **params)
    except Exception as error:  # noqa: BLE001 - fail open: the framework's model call goes on
        log.warning("contextrender: history sent unchanged for session %s (%s: %s)", session_id,
                    type(error).__name__, error)
        return None
    log.debug("contextrender: session %s rendered in %.0f ms", session_id, (time.perf_counter() - start) * 1000)
    return rendered


@dataclass
class Aligned:
    """One rendered message and the index of the original it came from (None: the fold marker,
    or a message the render wrote). `same`: the original unchanged."""

    message: dict
    origin: int | None
    same: bool


def _first_call(message: dict) -> str | None:
    calls = message.get("tool_calls") or []
    return calls[0].get("id") if calls and isinstance(calls[0], dict) else None


def _text(message: dict) -> Any:
    content = message.get("content")
    return content if content not in (None, "") else ""


def _calls(message: dict) -> list:
    # Ids and arguments: a call over results of a folded turn may be shown cut (`folded_call_room`).
    return [(c.get("id"), (c.get("function") or {}).get("arguments")) for c in message.get("tool_calls") or [] if isinstance(c, dict)]


def _same(original: dict, rendered: dict) -> bool:
    """The render left this message as it was (up to the normal form: `content` None or "")."""
    return _text(original) == _text(rendered) and _calls(original) == _calls(rendered)


def align(originals: list[dict], rendered: list[dict]) -> list[Aligned]:
    """Each non-system message of `rendered` with the index in `originals` it stands for.

    Tool messages are found by their call id, assistant messages with calls by their first call
    id, other messages by their role and text in order; a text the render cut takes the next
    original of its role. A user message that opens as the fold marker does (after the task, which
    stays above it, or first), or is found nowhere before anything else, is the fold marker; one
    that opens with the fold index's heading is the index (sent apart, after the selected results of
    folded turns): both are notices the render wrote, with no original."""
    from contextrender.core import FOLD_INDEX_HEADING, FOLD_INDEX_STORED_HEADING, FOLD_MARKER_OPENING

    index_openings = (FOLD_INDEX_HEADING, FOLD_INDEX_STORED_HEADING)
    tool_at = {m.get("tool_call_id"): i for (i, m) in enumerate(originals) if m.get("role") == "tool"}
    out: list[Aligned] = []
    next_at = 0
    for r in rendered:
        role = r.get("role")
        if role in ("system", "developer"):
            continue
        if role == "tool":
            i = tool_at.get(r.get("tool_call_id"))
            out.append(Aligned(r, i, i is not None and _same(originals[i], r)))
            continue
        if role == "user" and isinstance(_text(r), str) and _text(r).startswith(index_openings):
            out.append(Aligned(r, None, False))  # the fold index
            continue
        if role == "user" and isinstance(_text(r), str) and _text(r).startswith(FOLD_MARKER_OPENING):
            out.append(Aligned(r, None, False))  # the fold marker
            continue
        found = None
        first = _first_call(r)
        for k in range(next_at, len(originals)):
            o = originals[k]
            if o.get("role") != role:
                continue
            if (first is not None and _first_call(o) == first) or (first is None and _first_call(o) is None and _text(o) == _text(r)):
                found = k
                break
        if found is None and role == "user" and not out:
            out.append(Aligned(r, None, False))  # the fold marker
            continue
        if found is None:
            found = next((k for k in range(next_at, len(originals)) if originals[k].get("role") == role), None)
        if found is None:
            out.append(Aligned(r, None, False))
            continue
        next_at = found + 1
        out.append(Aligned(r, found, _same(originals[found], r)))
    return out
