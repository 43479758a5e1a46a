"""Edges added to a stored node by the node's id alone, the node never loaded: ingestion links a new
`Reuses` edge to a result an earlier call stored that way (walkers/impl/ingest.links.impl.jac
`_link_by_id`). Loading the result (deserialised with every edge id, hashed at the commit, kept
again for the next call) only to add an edge id to its list was most of what a reuse cost in
rounds. The edge is made as jaclang makes it, its target a stub holding the result's id; the
result's edge-list change is jaclang's own intent (an `EDGE_LIST_DELTA` on the stub, with the
edges' ids and its dependencies on their creates), so jaclang's flush orders it, poisons it with a
failed edge and reports it as any other. Three places take it:

- **the store** (`merge_by_id`, from `SharedSqliteStore._merge_write`): the merged edge list and
  version stored apart from the node's row, which stays as it is (adapters/merges.py
  `merge_edge_ids`, jaclang's merge of the node a load would have given, the new edges appended;
  adapters/edge_lists.py), or, for a row in an earlier format, by jaclang's merge of the node
  loaded from the row with them appended;
- **the working set** (`LinkedById`): a node linked by id that the call loaded afterwards is given
  its edges as a link would have given them, and a stub is never re-baselined after the flush
  (touching it would load it);
- the Engine's kept anchors forget a node merged by id (it is in the flush's applied ids).
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from contextrender.jaclang_setup import import_jaclang

import_jaclang()  # before any jaclang import of this module: without the server's plugins

from jaclang.jac0core.archetype import EdgeAnchor, NodeAnchor  # noqa: E402
from jaclang.runtimelib.changeset import ApplyReport, ChangeSet, WriteIntent, WriteOp  # noqa: E402
from jaclang.runtimelib.exceptions import WriteConflict  # noqa: E402
from jaclang.runtimelib.serializer import Serializer  # noqa: E402

from contextrender.edge_lists import STORED_NODE  # noqa: E402
from contextrender.merges import merge_edge_ids  # noqa: E402

__all__ = ["LinkedById", "ResultGone", "links_by_id", "merge_by_id"]


class ResultGone(WriteConflict):
    """The stored node a call linked an edge to by its id has no row any more (deleted since the
    call chose to link it): a lost race, which rolls the call's transaction back. The call runs
    again once (its replay loads the session afresh and finds what is left); met again on the
    replay, the call fails with this message (adapters/local.py)."""

    def message(self) -> str:
        return (f"result {self.anchor_id}, which this call links a Reuses edge to, is no longer in the store "
                "(deleted meanwhile, with its session or by a repair); run the call again, or check the store with `jac fsck`")


def links_by_id(intent: WriteIntent) -> bool:
    """Whether `intent` adds edges to a stored node by its id alone (`LinkedById.record_link_by_id`)."""
    return intent.op == WriteOp.EDGE_LIST_DELTA and getattr(intent, "linked_by_id", False)


def merge_by_id(store: Any, conn: sqlite3.Connection, intent: WriteIntent) -> None:
    """Add the edges of a `links_by_id` intent to the stored node's row, in `store`'s (a
    SharedSqliteStore's) write transaction: on its text when the row is in the current format, else
    as the store merges the node loaded from the row with the edges appended (what the call would
    have done loading it). A node deleted since is a lost race (`ResultGone`): the call runs again."""
    key = str(intent.anchor.id)
    found = conn.execute(STORED_NODE, (key,)).fetchone()
    if found is None:
        raise ResultGone(anchor_id=intent.anchor.id, expected_version=0, actual_version=-1)
    (stored, apart) = (found[:6], found[6:] if found[6] is not None else None)
    if merge_edge_ids(conn, key, stored, intent.edges_added, apart):
        return
    data = json.loads(stored[4])
    if apart is not None:  # (the node as the store's view reads it: adapters/edge_lists.py)
        (data["edges"], data["version"]) = (json.loads(apart[0]), apart[1])
    loaded = Serializer.deserialize(data)
    if not isinstance(loaded, NodeAnchor) or not loaded.is_populated():
        raise ValueError(f"stored node {key} cannot be read to add its edges")
    for id in intent.edges_added:
        link = object.__new__(EdgeAnchor)
        link.id = id
        loaded.edges.append(link)
    merged = WriteIntent(op=WriteOp.EDGE_LIST_DELTA, anchor=loaded)
    merged.edges_added = list(intent.edges_added)
    store._merge_write(conn, merged)


class LinkedById:
    """A working set in which edges may be added to a stored node by its id (mixed into
    adapters/working_set.py's): ingestion links that way when the working set says so
    (`links_by_id`), its store merges them (`merges_edge_ids`) and no cache tier holds nodes."""

    links_by_id = True

    def record_link_by_id(self, stub: NodeAnchor, edge_id: Any) -> None:
        """Record edge `edge_id` added to the stored node `stub` stands for (a stub holding only its
        id), as an edge-list delta marked as added by id. Marked on the intent, not told by the stub
        being unloaded: a traversal in the same call that resolves an edge's target populates the
        stub in place, and its delta must still be merged by id (or, the node loaded, given to the
        node: `_loaded_since`)."""
        self.changes.record_edge_delta(stub, [edge_id], [])
        self.changes.intents[stub.id].linked_by_id = True

    def _loaded_since(self, changes: ChangeSet) -> None:
        """A node given edges by id that the call loaded afterwards gets them as a link would have
        given it them (appended to its edges, in their order, the edges' target the node); its
        intent is left to the commit's pass over the loaded node. Called first at the commit."""
        for (id, intent) in list(changes.intents.items()):
            node = self.__mem__.get(id)
            if node is not None and node.is_populated() and links_by_id(intent):
                for edge_id in intent.edges_added:
                    link = self.__mem__[edge_id]
                    link.target = node
                    node.edges.append(link)
                del changes.intents[id]

    def _post_apply(self, apply_report: ApplyReport) -> None:
        """The re-baselining after a flush, but of a node given edges by id (not loaded, not in
        the working set: nothing to re-baseline, and touching its stub would load it)."""
        intents = self.changes.intents
        by_id = {id for (id, intent) in intents.items() if links_by_id(intent)}
        if by_id:
            self.changes.intents = {id: intent for (id, intent) in intents.items() if id not in by_id}
        try:
            super()._post_apply(apply_report)
        finally:
            self.changes.intents = intents
