"""A big call's objects freed a slice at a time after its request context closes.

jaclang's anchors are cycles (an anchor and its archetype point at each other, a node at its edges
and they at it), so when a request's context closes nothing of its call is freed until Python's
cyclic collector makes a full collection. After a 40,000-message ingestion that is 1.4 million
objects in one collection of about 1 s (0.7-3.4 s by the load) that holds every thread of the
server: every other user's call in progress then waited for it (docs/performance.md, "Many users,
measured again"). So the server's request contexts (adapters/server/plugin.py) close through
`close_untied`: a working set of at least UNTIE_AT_LEAST anchors is handed to a thread that breaks
its cycles UNTIE_SLICE anchors at a time (each anchor emptied, its archetype's cached pointer back
at it dropped), so reference counting frees each slice, and that gives way to the calls in progress
between slices as a long call does (engine/courtesy.jac `background_pass`: full collections wait
for it). Nothing of a closed context is used again, but for the root jac-scale keeps for the
process (`_process_cache['system_root']`) and what its edges reach: roots and the anchors a root's
edges reach are left as they are.

The walkers a request spawned (the plugin's `spawn_call` hook notes them on the context's working
set: `note_walker`; none spawned outside a request, in the process's own context) are emptied first: each walker's anchor lists every node it visited (`path`)
and its fields hold the call's messages and made nodes, and a walker and its anchor are a cycle of
their own, out of the working set's reach. Left whole, a 40,000-message call's walkers kept about
300,000 objects for the collector after the slices (docs/performance.md, "Many users, a third
round"). The request's answer is made before its context closes, so nothing reads them again
(jac-scale closes the context when the answer starts: a walker whose answer streamed, none of
ContextRender's does, would run on what was untied).

While full collections are held (a long call in progress, for a minute at 40,000 messages; also
any call's ingestion or store flush, and a call past 0.1 s closing before its guard leaves), every
other context is untied too when it closes: its cycles otherwise piled up for the one collection
after the long call (about 290,000 objects from 30 users' calls in a minute, 1.0 s). Up to
UNTIE_SLICE anchors at once (the close runs on the server's event loop: about 2-4 µs an anchor),
more in a thread of their own, slice by slice, without the collection after.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from functools import partial
from typing import Any

from jaclang.jac0core.archetype import NodeAnchor, Root, WalkerAnchor

__all__ = ["UNTIE_AT_LEAST", "UNTIE_SLICE", "close_untied", "note_walker", "untie_in_slices", "untied_on_close"]

logger = logging.getLogger("contextrender.server")

# Anchors of a working set from which its close frees it in slices (an ordinary call has tens to
# hundreds; a 40,000-message ingestion about 150,000), and anchors untied between two give-way points.
UNTIE_AT_LEAST = 10_000
UNTIE_SLICE = 500
# Seconds the full collection after the slices waits at most for a moment with no call in progress.
IDLE_AT_MOST = 10.0
# The attribute of a server context's working set listing the walker anchors its request spawned.
_WALKERS = "contextrender_walkers"


def untied_on_close(memory: Any) -> None:
    """`memory` (a server request context's working set) closes through `close_untied`, and the
    walkers spawned under it are noted for that close."""
    setattr(memory, _WALKERS, [])
    memory.close = partial(close_untied, memory, memory.close)


def note_walker(walker: Any) -> None:
    """A walker anchor about to be spawned, noted on the current context's working set if it is a
    server request's (the plugin's `spawn_call` hook)."""
    from jaclang.jac0core.runtime import JacRuntime

    ctx = JacRuntime.get_context()
    if ctx is JacRuntime.exec_ctx:  # the process's own context (no request): closed only at exit
        return
    spawned = getattr(ctx.mem, _WALKERS, None)
    if spawned is not None:
        spawned.append(walker)


def close_untied(memory: Any, close: Any) -> None:
    """`close` (the working set's own), then a big working set's anchors (its request's walkers
    first) untied in slices in a thread of their own; full collections wait from before the close
    until the last slice. An ordinary working set closed while full collections are held (a long
    call in progress) is untied too, at once or (over UNTIE_SLICE anchors) in a thread: its cycles
    would otherwise pile up for the collection after the long call."""
    from contextrender import core

    anchors = [*(vars(memory).pop(_WALKERS, None) or ()), *memory.__mem__.values()]
    if len(memory.__mem__) < UNTIE_AT_LEAST:
        close()
        if not core.CALLS.holding:
            return
        if len(anchors) <= UNTIE_SLICE:
            _untie_all(anchors)
        else:
            threading.Thread(target=untie_in_slices, args=(anchors, None), name="contextrender-untie", daemon=True).start()
        return
    turn = core.background_pass()  # counted from here: no full collection before the slices are done
    try:
        close()
    except BaseException:
        core.CALLS.leave(turn)
        raise
    threading.Thread(target=untie_in_slices, args=(anchors, turn), name="contextrender-untie", daemon=True).start()


def _untie_all(anchors: list) -> None:
    """Break the cycles of `anchors` (a closed ordinary context's: up to UNTIE_SLICE) in one go."""
    kept = _left_as_they_are(anchors)
    for anchor in anchors:
        if id(anchor) not in kept:
            _untie(anchor)


def untie_in_slices(anchors: list, turn: Any = None) -> None:
    """Break the cycles of `anchors` (a closed context's), UNTIE_SLICE at a time, giving way between
    slices under `turn` (then ended: `CALLS.leave`); each slice is dropped from the list once untied,
    so what nothing else holds is freed as the slices go."""
    from contextrender import core

    token = core.TURN.set(turn) if turn is not None else None
    (began, count) = (time.monotonic(), len(anchors))
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
        untied = time.monotonic() - began
        if turn is not None:
            collected = _collect_when_idle()
            logger.info("a closed request context's %d anchors untied in %.2f s; then a full collection: %d objects, %.2f s",
                        count, untied, collected[0], collected[1])
    finally:
        if token is not None:
            core.TURN.reset(token)
            core.CALLS.leave(turn)


def _collect_when_idle() -> tuple[int, float]:
    """One full collection of what the slices left to the cyclic collector (the other calls' own
    cyclic garbage, held while this call was long, and any anchor of this one a cycle outside the
    working set still reaches), made at the first moment no other call is in progress (this pass is counted: one), or after IDLE_AT_MOST seconds; the objects it
    freed and its seconds."""
    from contextrender import core

    deadline = time.monotonic() + IDLE_AT_MOST
    while core.CALLS.running > 1 and time.monotonic() < deadline:
        time.sleep(0.002)
    began = time.monotonic()
    return gc.collect(), time.monotonic() - began


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
    """`anchor` emptied: its archetype's pointer back at it dropped, then its own fields (its edges,
    or its nodes, its archetype, its id and access). A walker's archetype is emptied whole (its
    fields: the call's messages, the nodes it made), as is its anchor (the nodes it visited)."""
    archetype = getattr(anchor, "archetype", None)
    if archetype is not None:
        if isinstance(anchor, WalkerAnchor):
            vars(archetype).clear()
        else:
            # jaclang's `__jac__` is a cached property: the archetype's pointer back at its anchor.
            vars(archetype).pop("__jac__", None)
    vars(anchor).clear()
