"""A context's working set with a commit pass that does not hash its new anchors. jaclang's commit
(`TieredMemory._collect_into`) hashes every anchor of the working set to find what changed, the new
ones too, whose hash it then ignores (a new anchor is written whole): a third of the commit on a
long ingestion, in which a server call cannot give way to the others. The Engine's contexts
(`OneCommitMemory`, set by adapters/local.py) and the server's (`server_memory_class`, set by the
server plugin's `create_j_context`, adapters/server/plugin.py) record new anchors without it.

The Engine's contexts also take the anchors its previous call left (`KeptAnchors`) instead of
loading and deserialising them again, while nobody else wrote the store: its root too, which
jaclang's context loads first, through the store's lender (adapters/store.py `LENDER`)."""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from contextrender.jaclang_setup import import_jaclang

import_jaclang()  # before any jaclang import of this module: without the server's plugins

from jaclang.jac0core.archetype import Anchor, EdgeAnchor, NodeAnchor, Root  # noqa: E402
from jaclang.runtimelib import memory as jac_memory  # noqa: E402
from jaclang.runtimelib.changeset import ApplyReport, ChangeSet  # noqa: E402

from contextrender.lent import UNKNOWN_HASH, Lent, lent, rebaseline, remember_edges  # noqa: E402
from contextrender.by_id import LinkedById  # noqa: E402
from contextrender.transactions import data_version, file_key, in_blocks  # noqa: E402

__all__ = ["KeptAnchors", "NewAnchorsUnhashed", "OneCommitMemory", "RebaselinedInSlices", "jaclang_checks_access", "server_memory_class"]

# Written anchors re-baselined between two give-way points after a server flush.
REBASELINE_SLICE = 500
# Anchors the Engine keeps between its calls (the least recently used are forgotten first); a call
# that wrote more than this keeps none of what it wrote.
MAX_KEPT = 2048


class NewAnchorsUnhashed(LinkedById):
    """A working set's commit pass without hashing its new anchors (see the module's docstring):
    they are recorded as jaclang records them, without the hash (a third of the commit on a long
    ingestion), giving way to other calls between them on the server (engine/courtesy.jac: this
    pass runs before the write transaction), and without jaclang's write check of each when
    jaclang's own hooks answer it (it grants every new anchor); the anchors loaded from the store
    go through jaclang's own pass. Edges may be added to stored nodes by id (adapters/by_id.py). Mixed into jaclang's working set (OneCommitMemory, the Engine's) and
    jac-scale's (`server_memory_class`, the server's)."""

    def _settled(self, changes: ChangeSet) -> set[UUID]:
        """The anchors whose changes this working set recorded itself, left out of jaclang's pass."""
        return set()

    def _collect_into(self, changes: ChangeSet) -> None:
        from jaclang import JacRuntimeInterface as Jac

        self._loaded_since(changes)
        settled = self._settled(changes)
        intents = changes.intents
        # One pass: the new anchors (not deleted), and the rest but the settled ones for jaclang's pass
        # (an id looked up only where there is something to find: a UUID's hash is a Python call).
        (fresh, others) = ([], [])
        for (key, anchor) in self.__mem__.items():
            if anchor.hash == 0 and anchor.persistent and anchor.is_populated() \
                    and not (intents and (intent := intents.get(key)) is not None and intent.is_delete()):
                fresh.append(anchor)
            elif not settled or key not in settled:
                others.append((key, anchor))
        # jaclang's pass gets the rest as a dict of its own (what it loads meanwhile is dropped, as before).
        whole = self.__mem__
        if len(others) != len(whole):
            self.__mem__ = dict(others)
        try:
            super()._collect_into(changes)
        finally:
            self.__mem__ = whole
        from contextrender import core

        give_way = core.give_way
        # jaclang's write check answers yes for a new (unhashed) anchor; asked only when a plugin
        # answers the checks instead of jaclang.
        ask = not jaclang_checks_access()
        for anchor in fresh:
            give_way()
            # jaclang's rule for a new anchor: an edgeless node (but a root) is garbage, not data.
            if isinstance(anchor, NodeAnchor) and not isinstance(anchor.archetype, Root) and not anchor.edges:
                continue
            if not ask or Jac.check_write_access(anchor, op_hint="field_write"):
                changes.record_create(anchor)


class RebaselinedInSlices:
    """jaclang's re-baselining after a flush (`TieredMemory._post_apply`: every written anchor hashed
    again, so that a later commit of the context finds it unchanged), run by jaclang's own pass on
    slices of REBASELINE_SLICE written anchors, giving way to the other calls between slices
    (engine/courtesy.jac): after a 40,000-message ingestion it is seconds in which a server call
    otherwise never gives way. Each slice's pass sees only its own anchors' intents."""

    def _post_apply(self, apply_report: ApplyReport) -> None:
        applied = apply_report.applied
        if len(applied) <= REBASELINE_SLICE:
            super()._post_apply(apply_report)
            return
        from contextrender import core

        intents = self.changes.intents
        try:
            for start in range(0, len(applied), REBASELINE_SLICE):
                part = ApplyReport()
                part.applied = applied[start:start + REBASELINE_SLICE]
                self.changes.intents = {key: intents[key] for key in part.applied if key in intents}
                super()._post_apply(part)
                core.give_way()
        finally:
            self.changes.intents = intents


# The plugin that holds jaclang's own hook implementations (generate_plugin_helpers names it).
_JACLANG_IMPL = "JacRuntimeInterfaceImpl"


def jaclang_checks_access() -> bool:
    """Whether jaclang's own hooks alone answer the write check and the access level it asks
    (no plugin registered its own). Then a new anchor (hash 0, not yet stored) is writable:
    `check_access_level` answers WRITE for it before looking at any root, and the write check
    grants anything above CONNECT."""
    from jaclang.jac0core.runtime import plugin_manager

    return all([impl.plugin_name for impl in getattr(plugin_manager.hook, name).get_hookimpls()] == [_JACLANG_IMPL]
               for name in ("check_write_access", "check_access_level"))


class OneCommitMemory(NewAnchorsUnhashed, jac_memory.TieredMemory):
    """jaclang's working set for a context that commits once (the Engine's calls): new anchors
    unhashed at the commit. The Engine sets it on each call's context (adapters/local.py), whose
    re-baselining after the flush it also skips. With `kept` (the anchors its previous call left,
    `KeptAnchors`), an anchor not yet in the working set is taken from them before the store, and
    the commit checks what it took against what it was (adapters/lent.py) instead of hashing it."""

    kept: Kept | None = None

    def _settled(self, changes: ChangeSet) -> set[UUID]:
        return self.kept.settle(self.__mem__, changes) if self.kept is not None else set()

    def get(self, id: UUID) -> Anchor | None:
        anchor = self.__mem__.get(id)
        if anchor is None and self.kept is not None:
            anchor = self.kept.lend(id, self.__mem__)
        return anchor if anchor is not None else super().get(id)

    def batch_get(self, ids: list[UUID]) -> dict[UUID, Anchor]:
        if self.kept is not None:
            for id in ids:
                if id not in self.__mem__:
                    self.kept.lend(id, self.__mem__)
        return super().batch_get(ids)

    def delete(self, id: UUID) -> None:
        if self.kept is not None:
            self.kept.forget(id.int)
        super().delete(id)


def _unlinked(anchor: Anchor) -> Anchor:
    """`anchor` with the anchors it links to as unloaded stubs: a kept anchor reaches no other
    anchor of its call, so each one it reaches later is loaded through the working set (from the
    kept ones or the store) and is in it for the commit."""
    if isinstance(anchor, NodeAnchor):
        anchor.edges = [edge.make_stub() for edge in anchor.edges]
    elif isinstance(anchor, EdgeAnchor):
        anchor.source = anchor.source.make_stub()
        anchor.target = anchor.target.make_stub()
    return anchor


@dataclass
class Kept:
    """The anchors an Engine's calls left, as stored when its watching connection's data_version
    read `version` (None: not known; then none are kept)."""

    path: str
    opened: tuple[int, int] | None
    version: int | None = None
    # By their id's number (`UUID.int`: a UUID's hash is a Python call, an int's is not).
    anchors: dict[int, Anchor] = field(default_factory=dict)
    # Kept with no baseline yet (written or made by a call): set when lent.
    unbaselined: set[int] = field(default_factory=set)
    # What the call that has them took, as it was (adapters/lent.py).
    lent: dict[UUID, Lent] = field(default_factory=dict)
    # The call that has them: its connection, and that connection's data_version when it took them.
    conn: sqlite3.Connection | None = None
    conn_version: int | None = None

    def lend(self, id: UUID, working: dict[UUID, Anchor]) -> Anchor | None:
        key = id.int
        anchor = self.anchors.pop(key, None)
        if anchor is None:
            return None
        baselined = key not in self.unbaselined
        self.unbaselined.discard(key)
        taken = lent(anchor, baselined)
        if taken is None:
            if not baselined:
                rebaseline(anchor)
        else:
            self.lent[id] = taken
            if not baselined:
                # Its baseline is taken only if the commit finds it changed (Lent.baseline).
                anchor.hash = UNKNOWN_HASH
                remember_edges(anchor)
        working[id] = anchor
        return anchor

    def settle(self, working: dict[UUID, Anchor], changes: ChangeSet) -> set[UUID]:
        """At the commit: the anchors taken from here that the working set still holds, and that
        are not deleted, whose changes (if any) are now recorded in `changes` (Lent.settle)."""
        settled = set()
        for (id, taken) in self.lent.items():
            if working.get(id) is not taken.anchor or ((intent := changes.intents.get(id)) is not None and intent.is_delete()):
                continue
            if taken.settle(changes):
                settled.add(id)
        return settled

    def forget(self, key: int) -> None:  # (an id's number, `UUID.int`)
        self.anchors.pop(key, None)
        self.unbaselined.discard(key)

    def clear(self) -> None:
        (self.anchors, self.unbaselined, self.lent) = ({}, set(), {})

    def _stored(self, ids: list[UUID]) -> dict[str, Any]:
        """The stored edge list (JSON) of each of `ids` that has a row."""
        return dict(in_blocks(self.conn, "SELECT id, json_extract(data, '$.edges') FROM anchors WHERE id IN (?ids)", [str(id) for id in ids]))

    def keep(self, working: dict[UUID, Anchor], written: set[UUID], edge_lists: dict[int, list[str]] | None = None) -> None:
        """Keep the anchors a committed call left in `working`, as stored: the ones it only loaded as
        they are, the nodes it wrote or made with no baseline (set when next lent, if the commit needs
        it: adapters/lent.py). Not kept: a node it made but did not store (edgeless), an edge it made
        (reached only through its node, whose kept edges are stubs: loaded anyway; none ever was). The
        stored edge lists its last flush wrote (`edge_lists`, the store's `edges_written`) are not read."""
        for key in (written_keys := {id.int for id in written}):
            self.forget(key)
        # Taken without a baseline and not written: kept still without one.
        unhashed = {id.int for (id, taken) in self.lent.items() if not taken.baselined} - written_keys
        self.lent.clear()
        candidates = [a for a in working.values() if a.persistent and a.is_populated()
                      and (a.hash != 0 or (not isinstance(a, EdgeAnchor) and a.id.int in written_keys))]
        changed = [a for a in candidates if a.id.int in written_keys]
        if len(changed) > MAX_KEPT:
            candidates = [a for a in candidates if a.id.int not in written_keys]
            changed = []
        # The stored edge order is taken only for a stored node whose edge set changed (the store merges a
        # delta in its own order): a node made in the call (never loaded) was written whole, in its order.
        ordered = {a.id.int: a.id for a in changed if isinstance(a, NodeAnchor) and (initial := a.__dict__.get("_initial_edge_ids"))
                   is not None and initial != frozenset(e.id for e in a.edges)}
        edge_lists = dict(edge_lists or {})
        if unknown := [id for (key, id) in ordered.items() if key not in edge_lists]:
            edge_lists.update((UUID(text).int, json.loads(order) if order else []) for (text, order) in self._stored(unknown).items())
        for anchor in candidates:
            key = anchor.id.int
            if key in unhashed:
                self.unbaselined.add(key)
            elif key in written_keys:
                if key in ordered:
                    order = edge_lists.get(key)
                    edges = {str(e.id): e for e in anchor.edges}
                    if order is None or len(order) != len(anchor.edges) or set(order) != set(edges):
                        continue
                    anchor.edges = [edges[e] for e in order]
                self.unbaselined.add(key)
            self.anchors[key] = _unlinked(anchor)
        while len(self.anchors) > MAX_KEPT:
            self.forget(next(iter(self.anchors)))


class KeptAnchors:
    """The anchors an Engine's calls left, kept for its next call instead of loaded, deserialised
    and hashed again from the store (about 1.1 ms an anchor under cProfile; a proxy's call loads
    the session, the chain's tail, the render epoch and the results its answer reuses).

    Valid only while nobody else wrote the store. SQLite's `PRAGMA data_version` on a connection
    changes when any other connection commits, not when that one does. Two are read: the Engine's
    own idle connection (`watch`, which never writes) and the connection of the call that takes
    them. A call reads its own connection's, then the watch's: the kept anchors are lent only if
    the watch reads what it read after the last call kept them. After its commit it reads the
    watch's, then its own again: if its own did not change, no other connection committed from its
    start to that last read, so the watch's value then covers its own commit only and is kept with
    what it left; else nothing is kept. A call that fails keeps nothing; one call at a time takes
    them (another meanwhile loads from the store). The server's contexts never use them."""

    def __init__(self, watch: sqlite3.Connection | None = None, path: str | None = None) -> None:
        self._lock = threading.Lock()
        self._watch = watch
        self._path = path
        self._kept: Kept | None = None

    def lend_to(self, mem: Any) -> Kept | None:
        """Give `mem` (a call's OneCommitMemory on the watched SQLite file) the kept anchors (those its
        context took its root from, `take`), if nobody else wrote the store since they were kept, else
        an empty set; None when it cannot have them (no watch, another file, the file not made yet, a
        plugin answering the access checks)."""
        l3 = mem.l3
        kept = l3.__dict__.pop("kept_begun") if "kept_begun" in getattr(l3, "__dict__", {}) else self._begin(l3)
        if kept is not None:
            mem.kept = kept
        return kept

    def take(self, l3: Any, id: UUID) -> Anchor | None:
        """The store's lender while the Engine makes a call's context (adapters/store.py `LENDER`),
        whose first load is its root: the kept anchors are begun on the store `l3` the call commits
        through, and the root is taken from them, if kept, instead of loaded again."""
        if "kept_begun" not in l3.__dict__:
            l3.__dict__["kept_begun"] = self._begin(l3)
        kept = l3.__dict__["kept_begun"]
        return kept.lend(id, {}) if kept is not None else None

    def _begin(self, l3: Any) -> Kept | None:
        """`lend_to`'s kept anchors for a call that commits through the store `l3`."""
        watch = self._watch
        if watch is None or getattr(l3, "path", None) != self._path or not jaclang_checks_access():
            return None
        now = file_key(self._path)
        own = None  # (its data_version: the one the store read as it took the connection, if just now)
        if l3.__conn__ is None:
            if now is None:
                return None
            l3._ensure_connection()
            own = getattr(l3, "taken_version", None)
        conn = l3.__conn__
        with self._lock:
            (kept, self._kept) = (self._kept, None)
        if kept is None or kept.opened != now:
            kept = Kept(path=self._path, opened=now)
        try:
            own = data_version(conn) if own is None else own
            version = self._watch_version()
        except sqlite3.Error:
            return None
        if version is None:
            return None  # closed meanwhile
        if version != kept.version:
            kept.clear()
        (kept.conn, kept.conn_version) = (conn, own)
        return kept

    def give_back(self, mem: Any, kept: Kept, working: dict[UUID, Anchor] | None, written: set[UUID]) -> None:
        """After `mem`'s call: keep what it left in `working` (None: it failed, keep nothing) if no
        other connection committed meanwhile."""
        mem.kept = None
        (conn, own, kept.conn, kept.conn_version) = (kept.conn, kept.conn_version, None, None)
        kept.version = None
        if working is None or self._watch is None or conn is None or mem.l3.__conn__ is not conn:
            kept.clear()
            return
        try:
            kept.conn = conn
            kept.keep(working, written, getattr(mem.l3, "edges_written", None))
            version = self._watch_version()
            unchanged = version is not None and data_version(conn) == own
        except sqlite3.Error:
            (version, unchanged) = (None, False)
        finally:
            kept.conn = None
        if unchanged:
            kept.version = version
        else:
            kept.clear()
        with self._lock:
            self._kept = kept

    def _watch_version(self) -> int | None:
        """The watch's data_version, read by one thread at a time: Python's sqlite3 shares a
        connection's cached statements between threads, and two threads stepping the same one
        meanwhile get no row (seen in about a fifth of the 8-thread engine test's runs)."""
        with self._lock:
            return None if self._watch is None else data_version(self._watch)

    def close(self) -> None:
        """Forget the kept anchors, and keep none from now on (the watch is closed)."""
        with self._lock:
            (self._kept, self._watch) = (None, None)


_server_memory: list[type] = []


def server_memory_class() -> type:
    """jac-scale's working set (`ScaleTieredMemory`: its caches and backends as they are) with new
    anchors unhashed at the commit. A server context may commit more than once (the walker's
    commit, then the close's backstop), so jac-scale's re-baselining after each flush stays (the
    anchors it wrote are hashed then, and a later commit of the context finds them unchanged), in
    slices that give way between them."""
    if not _server_memory:
        from jac_scale.memory_hierarchy import ScaleTieredMemory

        _server_memory.append(type("ServerMemory", (NewAnchorsUnhashed, RebaselinedInSlices, ScaleTieredMemory), {
            "__doc__": server_memory_class.__doc__, "__module__": __name__}))
    return _server_memory[0]
