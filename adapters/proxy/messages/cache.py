"""Anthropic prompt cache breakpoints for the Messages format layer (`anthropic.py`).

Prompt cache. The client's `cache_control` markers stay on the blocks they were on when those are
kept. One more breakpoint goes on the last block of the stable prefix: the longest run of messages
identical to the session's previous forwarded request, the part a re-rendered history repeats.
Anthropic allows 4: when the client's markers and this one exceed that, the client's markers inside
the history are dropped first (its markers on `system`, `tools` and the last message are kept).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from contextrender.proxy.formats import plain

__all__ = ["CACHE", "MAX_BREAKPOINTS", "NO_BREAKPOINT", "as_blocks", "bare", "breakpoints"]

CACHE = "cache_control"
MAX_BREAKPOINTS = 4
# Blocks that cannot carry a cache breakpoint (Anthropic refuses one on them).
NO_BREAKPOINT = ("thinking", "redacted_thinking")


def bare(block: dict) -> dict:
    """A block without its cache marker (and null fields): how the history stores it."""
    return plain(block, frozenset({CACHE}))


def as_blocks(content: list[dict] | str) -> list[dict]:
    """A turn's content as a list of blocks (a copy)."""
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def _signature(role: str, index: int, block: dict) -> bytes:
    text = json.dumps([index, role, bare(block)], ensure_ascii=False, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def _markers(value: Any) -> int:
    if isinstance(value, list):
        return sum(1 for b in value if isinstance(b, dict) and b.get(CACHE))
    return 0


def _can_mark(block: dict) -> bool:
    return block.get("type") not in NO_BREAKPOINT and block != {"type": "text", "text": ""}


def breakpoints(body: dict, turns: list[dict], previous: Any, move: bool = False) -> Any:
    """Put a cache breakpoint at the end of the stable prefix of `turns` (in place: blocks are
    replaced, never changed) and return what the next request compares with. `move`: the
    client's breakpoints inside `messages` go (the stable end takes their place), else they stay
    and the total is kept within MAX_BREAKPOINTS by dropping the client's ones inside the history
    first. With no stable prefix (a session's first request, or everything changed) the client's
    breakpoints are left as they are."""
    head = hashlib.blake2b(json.dumps([body.get("system"), body.get("tools")], ensure_ascii=False, sort_keys=True).encode(),
                           digest_size=16).digest()
    blocks: list[tuple[int, int, dict]] = []
    for (k, turn) in enumerate(turns):
        blocks.extend((k, j, b) for (j, b) in enumerate(as_blocks(turn["content"])))
    signatures = [_signature(turns[k]["role"], k, b) for (k, _, b) in blocks]
    memo = (head, signatures)
    stable = 0
    if previous is not None and previous[0] == head:
        old = previous[1]
        while stable < min(len(old), len(signatures)) and old[stable] == signatures[stable]:
            stable += 1
    spot = next((p for p in range(stable - 1, -1, -1) if _can_mark(blocks[p][2])), None)
    if spot is None or (blocks[spot][2].get(CACHE) and not move):
        return memo
    # A top-level `cache_control` (automatic caching) takes one breakpoint at the request's end.
    fixed = _markers(body.get("system")) + _markers(body.get("tools")) + (1 if body.get(CACHE) else 0)
    marked = [p for (p, (_, _, b)) in enumerate(blocks) if b.get(CACHE)]
    # The client's own marker (its TTL) where it set one, else the 5-minute default.
    marker = blocks[marked[-1]][2][CACHE] if marked else {"type": "ephemeral"}
    if move:
        drop = marked
    else:
        # Room for one more: the client's breakpoints inside the history go first, oldest first
        # (those on system, tools and the last turn stay). A client already over the limit is
        # left as it sent it.
        droppable = [p for p in marked if blocks[p][0] != len(turns) - 1]
        excess = fixed + len(marked) + 1 - MAX_BREAKPOINTS
        if fixed + len(marked) > MAX_BREAKPOINTS or excess > len(droppable):
            return memo
        drop = droppable[:max(0, excess)]
    if fixed + 1 > MAX_BREAKPOINTS:
        return memo
    for p in drop:
        _set_block(turns, blocks[p][0], blocks[p][1], {key: v for (key, v) in blocks[p][2].items() if key != CACHE})
    (k, j) = blocks[spot][:2]
    _set_block(turns, k, j, dict(as_blocks(turns[k]["content"])[j], **{CACHE: marker}))
    return memo


def _set_block(turns: list[dict], k: int, j: int, block: dict) -> None:
    # A copy: the client's blocks stay as they were (kept messages share them).
    content = as_blocks(turns[k]["content"])
    content[j] = block
    turns[k]["content"] = content
