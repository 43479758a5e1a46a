"""A big call's objects freed a slice at a time after its request context closes.

jaclang's anchors are cycles (an anchor and its archetype point at each other, a node at its edges
and they at it), so when a request's context closes nothing of its call is freed until Python's
cyclic collector makes a full collection. After a 40,000-message ingestion that is 1.4 million
objects in one collection of about 1 s (0.7-3.4 s by the load) that holds every thread of the
server: every other user's call in progress then waited for it (docs/performance.md, "Many users,
measured again"). So the server's request contexts (adapters/server/plugin.py) close through
`close_untied`: a working set of at least UNTIE_AT_LEAST anchors is handed to a thread that breaks
its cycles UNTIE_SLICE anchors at a time (a node's edge list emptied, an archetype's cached anchor
dropped), so reference counting frees each slice, and that gives way to the calls in progress
between slices as a long call does (engine/courtesy.jac `background_pass`: full collections wait
for it). Nothing of a closed context is used again, but for the root jac-scale keeps for the
process (`_process_cache['system_root']`) and what its edges reach: roots and the anchors a root's
edges reach are left as they are.
"""

from __future__ import annotations

import threading
from typing import Any

from jaclang.jac0core.archetype import EdgeAnchor, NodeAnchor, Root

__all__ = ["UNTIE_AT_LEAST", "UNTIE_SLICE", "close_untied", "untie_in_slices"]

# Anchors of a working set from which its close frees it in slices (an ordinary call has tens to
# hundreds; a 40,000-message ingestion about 150,000), and anchors untied between two give-way points.
UNTIE_AT_LEAST = 10_000
UNTIE_SLICE = 500


def close_untied(memory: Any, close: Any) -> None:
    """`close` (the working set's own), then a big working set's anchors untied in slices in a
    thread of their own; full collections wait from before the close until the last slice."""
    anchors = list(memory.__mem__.values()) if len(memory.__mem__) >= UNTIE_AT_LEAST else []
    if not anchors:
        close()
        return
    from contextrender import core

    turn = core.background_pass()  # counted from here: no full collection before the slices are done
    try:
        close()
    except BaseException:
        core.CALLS.leave(turn)
        raise
    threading.Thread(target=untie_in_slices, args=(anchors, turn), name="contextrender-untie", daemon=True).start()


def untie_in_slices(anchors: list, turn: Any = None) -> None:
    """Break the cycles of `anchors` (a closed context's), UNTIE_SLICE at a time, giving way between
    slices under `turn` (then ended: `CALLS.leave`); each slice is dropped from the list once untied,
    so what nothing else holds is freed as the slices go."""
    from contextrender import core

    token = core.TURN.set(turn) if turn is not None else None
    try:
        kept = _left_as_they_are(anchors)
        for start in range(0, len(anchors), UNTIE_SLICE):
            for i in range(start, min(start + UNTIE_SLICE, len(anchors))):
                anchor = anchors[i]
                anchors[i] = None
                if id(anchor) not in kept:
                    _untie(anchor)
            del anchor
            core.give_way()
    finally:
        if token is not None:
            core.TURN.reset(token)
            core.CALLS.leave(turn)


def _left_as_they_are(anchors: list) -> set[int]:
    """The roots among `anchors` (the process's system root among them, which jac-scale puts in
    every context), and the edges and nodes their edge lists reach: held beyond the context."""
    kept: set[int] = set()
    for anchor in anchors:
        if isinstance(anchor, NodeAnchor) and isinstance(anchor.archetype, Root):
            kept.add(id(anchor))
            for edge in anchor.edges:
                kept.update((id(edge), id(edge.source), id(edge.target)))
    return kept


def _untie(anchor: Any) -> None:
    if isinstance(anchor, NodeAnchor):
        anchor.edges = []
    elif isinstance(anchor, EdgeAnchor):
        anchor.source = anchor.target = None
    archetype = getattr(anchor, "archetype", None)
    if archetype is not None:
        # jaclang's `__jac__` is a cached property: the archetype's pointer back at its anchor.
        vars(archetype).pop("__jac__", None)
