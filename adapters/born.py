"""A call's new anchors written as created rows, outside jaclang's working set and change set.

Ingestion makes three nodes and four edges a tool round (and a `Reuses` edge for each reuse), and
jaclang handles each like any anchor: put in the working set, found again by the commit pass,
recorded as a create intent, staged, applied intent by intent, kept for the next call. Nothing of
that is needed for an anchor made in the call: it is written whole, once. So the ingestion walker
(walkers/impl/ingest.links.impl.jac `_save`) hands its new anchors to the working set's `bear`
instead of `put`; the commit pass gives them to the store on the change set (`born`), after every
change of the stored nodes is recorded; the store serialises their rows with the created ones and
inserts them first in the flush's one transaction (or written ahead with a big flush's created
rows), so the call stays atomic (a lost race rolls them back with the rest, kill -9 leaves only
rows nothing reaches). The anchors stay the objects they are: the walker, a traversal and the
render of the same call reach them through the edges that hold them, as before.

What keeps it jaclang's: a new anchor looked up by its id in the call (`get`, `batch_get`) is
taken back into the working set (`adopt`), so jaclang's pass records it as it always did; a call
whose change set is otherwise empty records them as creates (jaclang's commit flushes nothing
without an intent); a deleted one is not written. The stored nodes a new edge reaches (the chain's
tail, the caller, a loaded result) keep their edge-list change in jaclang's change set, which the
store applies after the new rows. The Engine's kept anchors take the new ones as written
(adapters/working_set.py `KeptAnchors.give_back`).
"""

from __future__ import annotations

import sqlite3
from typing import Any
from uuid import UUID

from contextrender.jaclang_setup import import_jaclang

import_jaclang()  # before any jaclang import of this module: without the server's plugins

from jaclang.jac0core.archetype import Anchor, NodeAnchor, Root  # noqa: E402
from jaclang.runtimelib.changeset import ChangeSet, WriteIntent  # noqa: E402

from contextrender.rows import INSERT_ROW, id_text  # noqa: E402

__all__ = ["BornAsRows", "WritesBornRows", "born_of", "handed_over"]


def born_of(changes: ChangeSet) -> list[Anchor]:
    """The new anchors a change set carries to be written as created rows (none: [])."""
    return changes.__dict__.get("born") or []


def handed_over(changes: ChangeSet) -> None:
    """The store wrote the change set's new anchors: a second commit of the context must not."""
    changes.__dict__.pop("born", None)


class BornAsRows:
    """A working set that takes a call's new anchors apart (`bear`) and hands them to the store at
    the commit (`_hand_born`, called last in the commit pass). Mixed into adapters/working_set.py's
    `NewAnchorsUnhashed` (the Engine's and the server's working sets); ingestion bears its anchors
    only where the store writes them (`writes_born`)."""

    bears = True

    def bear(self, anchor: Anchor) -> None:
        """`anchor` (new in this call, persistent) is written as a created row at the commit."""
        born = self.__dict__.get("_born")
        if born is None:
            born = self.__dict__["_born"] = {}
        born[anchor.id] = anchor

    def adopt(self, id: UUID) -> Anchor | None:
        """The new anchor `id`, taken into the working set (then jaclang's pass records it)."""
        born = self.__dict__.get("_born")
        anchor = born.pop(id, None) if born else None
        if anchor is not None:
            self.__mem__[id] = anchor
        return anchor

    def get(self, id: UUID) -> Anchor | None:
        return self.adopt(id) or super().get(id)

    def batch_get(self, ids: list[UUID]) -> dict[UUID, Anchor]:
        if self.__dict__.get("_born"):
            for id in ids:
                self.adopt(id)
        return super().batch_get(ids)

    async def aget(self, id: UUID) -> Anchor | None:
        return self.adopt(id) or await super().aget(id)

    def _hand_born(self, changes: ChangeSet, ask: bool) -> None:
        """Give the new anchors to the store on `changes`, once every other change is recorded;
        record them as jaclang would (after its write check of each, with `ask`: a plugin answers
        it) when a plugin checks writes or nothing else would reach the store."""
        from jaclang import JacRuntimeInterface as Jac

        born = self.__dict__.pop("_born", None)
        if not born:
            return
        anchors = [anchor for anchor in born.values()
                   if not ((intent := changes.intents.get(anchor.id)) is not None and intent.is_delete())
                   # jaclang's rule for a new anchor: an edgeless node (but a root) is garbage, not data.
                   and not (isinstance(anchor, NodeAnchor) and not isinstance(anchor.archetype, Root) and not anchor.edges)]
        if ask or changes.is_empty():
            for anchor in anchors:
                if not ask or Jac.check_write_access(anchor, op_hint="field_write"):
                    changes.record_create(anchor)
            return
        changes.__dict__["born"] = anchors
        self.__dict__["_handed"] = anchors

    def handed(self) -> list[Anchor]:
        """The new anchors the last commit handed to the store (and forgets them)."""
        return self.__dict__.pop("_handed", None) or []


class WritesBornRows:
    """The store's part (mixed into adapters/store.py's SharedSqliteStore, whose `_apply` serialises
    the rows of `born_of(changeset)` with the created ones, sets `_born_rows` to those it did not
    write ahead, and takes them back when the flush wrote nothing): the new rows inserted first in
    the flush's transaction."""

    # It writes a call's new anchors handed on the change set as created rows.
    writes_born = True
    _born_rows: list = []
    _born_failed: Exception | None = None

    def _apply_one(self, conn: sqlite3.Connection, intent: WriteIntent) -> None:
        """jaclang's write of one intent, the flush's new rows inserted before the first, in its
        transaction; if they cannot be, no intent is written (none may reach a missing row)."""
        if self._born_failed is None and self._born_rows:
            (pending, self._born_rows) = (self._born_rows, [])
            try:
                for (key, row) in pending:
                    conn.execute(INSERT_ROW, (id_text(key),) + row)
            except Exception as failed:  # noqa: BLE001  (reported by jaclang's apply, as any write)
                self._born_failed = failed
        if self._born_failed is not None:
            raise RuntimeError(f"the call's new rows could not be written: {self._born_failed}")
        super()._apply_one(conn, intent)
