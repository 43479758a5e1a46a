"""The working sets' commit passes (adapters/working_set.py): jaclang's re-baselining after a flush,
run in slices that give way between them, leaves every written anchor as jaclang's whole pass does;
new anchors are written without a write check only while jaclang's own hooks answer it."""

from __future__ import annotations

import sqlite3
import uuid

import pytest
from conftest import REUSING, assistant, call, tool, user
from contextrender import InvalidRequest
from contextrender import core, working_set
from contextrender.jaclang_setup import import_jaclang
from contextrender.lent import rebaseline

import_jaclang()

from jaclang.jac0core.archetype import Root  # noqa: E402
from jaclang.runtimelib import memory as jac_memory  # noqa: E402
from jaclang.runtimelib.changeset import ApplyReport, snapshot_field_hashes  # noqa: E402
from jaclang.runtimelib.serializer import Serializer  # noqa: E402


class SlicedMemory(working_set.RebaselinedInSlices, jac_memory.TieredMemory):
    pass


def _flushed(memory: jac_memory.TieredMemory, count: int, applied: int) -> list:
    """`count` new anchors recorded in `memory`'s unit of work, the first `applied` of them
    re-baselined as written by a flush; the anchors."""
    anchors = [Root().__jac__ for _ in range(count)]
    for anchor in anchors:
        memory.changes.record_create(anchor)
    report = ApplyReport()
    report.applied = [anchor.id for anchor in anchors[:applied]]
    memory._post_apply(report)
    return anchors


def test_the_rebaselining_in_slices_is_jaclangs_and_gives_way_between_them(monkeypatch):
    monkeypatch.setattr(working_set, "REBASELINE_SLICE", 3)
    turns: list[int] = []
    monkeypatch.setattr(core, "give_way", lambda: turns.append(1))
    sliced, whole = SlicedMemory(), jac_memory.TieredMemory()
    intents = sliced.changes.intents
    ours, jaclangs = _flushed(sliced, 11, applied=10), _flushed(whole, 11, applied=10)
    # Every written anchor hashed and its edge baseline set, as jaclang's pass does; the one not
    # written stays new (hash 0) in both.
    for (mine, theirs) in zip(ours, jaclangs):
        assert (mine.hash == 0) == (theirs.hash == 0)
        assert ("_initial_edge_ids" in mine.__dict__) == ("_initial_edge_ids" in theirs.__dict__)
    assert all(a.hash != 0 for a in ours[:10]) and ours[10].hash == 0
    assert [a.hash for a in ours[:10]] == [Serializer._compute_hash(a) for a in ours[:10]]
    assert len(turns) == 4  # slices of 3, 3, 3 and 1, a turn after each
    # The unit of work is the same one, whole, afterwards.
    assert sliced.changes.intents is intents and len(intents) == 11


def test_a_short_flush_is_rebaselined_in_one_pass_without_a_turn(monkeypatch):
    turns: list[int] = []
    monkeypatch.setattr(core, "give_way", lambda: turns.append(1))
    anchors = _flushed(SlicedMemory(), 4, applied=4)
    assert all(a.hash != 0 for a in anchors) and turns == []


def test_the_servers_working_set_rebaselines_in_slices():
    assert issubclass(working_set.server_memory_class(), working_set.RebaselinedInSlices)

HISTORY = [user("read the file"), assistant(None, call("c1", "read", {"path": "a.py"})), tool("c1", "print('a')")]


def asking_plugin(asked: list) -> object:
    """A plugin with its own write check: it grants everything and notes each new anchor asked about."""
    from jaclang.jac0core.runtime import hookimpl

    class AsksForNewAnchors:
        @staticmethod
        @hookimpl
        def check_write_access(to, op_hint: str = "write") -> bool:  # noqa: ANN001 (jaclang's hook)
            if to.hash == 0:
                asked.append(to.id)
            return True

    return AsksForNewAnchors()


def test_new_anchors_are_written_without_a_write_check_only_while_jaclang_answers_it(engine):
    from jaclang.jac0core.runtime import plugin_manager

    assert working_set.jaclang_checks_access()
    engine.ingest("plain", HISTORY)
    asked: list = []
    plugin = asking_plugin(asked)
    plugin_manager.register(plugin, name="asks-for-new-anchors")
    try:
        assert not working_set.jaclang_checks_access()
        engine.ingest("checked", HISTORY)
    finally:
        plugin_manager.unregister(plugin)
    assert working_set.jaclang_checks_access()
    # Its commit asked the plugin about each new node and edge: 3 events, a call, Next x3, Calls, Answered.
    assert len(set(asked)) >= 9
    assert engine.get_session("checked")["events"] == engine.get_session("plain")["events"] == len(HISTORY)


# ---------------------------------------------------------------------------------------------
# The anchors an Engine keeps between its calls (KeptAnchors)



def _kept(engine) -> working_set.Kept:
    kept = engine._kept._kept
    assert kept is not None
    return kept


def _all_as_stored(engine) -> int:
    """Every anchor the engine keeps is what its stored row holds (its fields, edges in their stored
    order, version), with the baseline (its hash and its fields') a load would give it; how many."""
    import json
    import sqlite3

    kept = _kept(engine)
    rows = dict(sqlite3.connect(kept.path).execute("SELECT id, data FROM anchors").fetchall())
    for (key, anchor) in list(kept.anchors.items()):
        assert key == anchor.id.int  # kept by their id's number
        assert json.loads(rows[str(anchor.id)]) == json.loads(json.dumps(Serializer.serialize(anchor, include_type=True)))
        if key in kept.unbaselined:  # its baseline, as the next call's commit sets it when it changed
            rebaseline(anchor)
        assert anchor.hash == Serializer._compute_hash(anchor)
        hashes = dict(anchor.archetype.__jac_field_hashes__)
        snapshot_field_hashes(anchor)
        assert hashes == anchor.archetype.__jac_field_hashes__
    return len(kept.anchors)


def _loads(monkeypatch) -> list[str]:
    """The archetypes of the anchors the store loads from now on."""
    from contextrender import store

    loaded: list[str] = []
    get = store.jac_memory.SqliteMemory.get  # jaclang's load (the store's own get lends first)

    def counted(self, id):  # noqa: ANN001, ANN202
        anchor = get(self, id)
        if anchor is not None:
            loaded.append(type(anchor.archetype).__name__)
        return anchor

    monkeypatch.setattr(store.jac_memory.SqliteMemory, "get", counted)
    return loaded


def test_the_next_call_takes_the_anchors_the_last_left_as_stored_instead_of_loading_them(engine, monkeypatch):
    for end in (2, 4, 6, len(REUSING)):
        engine.render("s", REUSING[:end], budget=2000)
    assert _all_as_stored(engine) > 10
    loaded = _loads(monkeypatch)
    before = engine.get_session("s", include_messages=True)["messages"]
    engine.render("s", REUSING + [assistant("done: compute_beta_value fixed")], budget=2000)
    assert loaded == []  # the root, the session, the chain's tail, the results it reuses: kept
    assert engine.get_session("s", include_messages=True)["messages"] == before + [assistant("done: compute_beta_value fixed")]
    _all_as_stored(engine)


def test_a_call_keeps_the_nodes_it_made_but_not_the_edges_it_made(engine):
    from jaclang.jac0core.archetype import EdgeAnchor

    engine.ingest("s", REUSING[:5])
    engine.ingest("s", REUSING[5:], append=True)  # edges made: Next, Calls, Answered, Reuses
    kept = _kept(engine)
    kinds = {type(anchor.archetype).__name__ for anchor in kept.anchors.values()}
    assert {"Session", "ToolResult", "ToolCall", "Message"} <= kinds
    assert not [a for a in kept.anchors.values() if isinstance(a, EdgeAnchor)]  # each made by a call
    _all_as_stored(engine)


def test_another_writers_commit_between_two_calls_is_seen(tmp_path, monkeypatch):
    from contextrender import Engine

    (ours, theirs) = (Engine(tmp_path / "store"), Engine(tmp_path / "store"))
    ours.ingest("s", REUSING[:3])
    ours.ingest("s", REUSING[3:5], append=True)
    assert _all_as_stored(ours) > 0
    theirs.ingest("s", REUSING[5:7], append=True)  # the session and the chain's tail change under ours
    loaded = _loads(monkeypatch)
    ours.ingest("s", REUSING[7:], append=True)
    assert "Session" in loaded  # what ours kept was dropped, and loaded again
    assert ours.get_session("s", include_messages=True)["messages"] == REUSING
    assert theirs.get_session("s")["events"] == len(REUSING)
    _all_as_stored(ours)


def test_a_failed_call_keeps_none_of_its_anchors(engine, monkeypatch):
    engine.ingest("s", REUSING[:3])
    assert _all_as_stored(engine) > 0

    def fails() -> None:
        raise RuntimeError("the commit failed")

    # It fails in its commit, after its walker changed the session and the chain's tail.
    monkeypatch.setattr(core, "give_way", fails)
    with pytest.raises(RuntimeError, match="the commit failed"):
        engine.ingest("s", REUSING[3:5], append=True)
    monkeypatch.undo()
    assert engine._kept._kept is None or not engine._kept._kept.anchors
    assert engine.get_session("s", include_messages=True)["messages"] == REUSING[:3]
    engine.ingest("s", REUSING[5:], append=True)
    assert engine.get_session("s", include_messages=True)["messages"] == REUSING[:3] + REUSING[5:]
    _all_as_stored(engine)


def test_another_writers_commit_during_a_call_is_seen(tmp_path, monkeypatch):
    from contextrender import Engine

    (ours, theirs) = (Engine(tmp_path / "store"), Engine(tmp_path / "store"))
    ours.ingest("s", REUSING[:3])
    during: list[int] = []

    def their_calls() -> None:
        # Once, inside our call's commit (before its write transaction): sessions made under
        # the shelves and the directory ours loaded to make its own.
        if not during:
            during.append(1)
            for n in range(12):
                theirs.ingest(f"t{n}", REUSING[:1])

    monkeypatch.setattr(core, "give_way", their_calls)
    ours.ingest("new", REUSING[:3])
    monkeypatch.undo()
    assert during == [1]
    _all_as_stored(ours)  # another connection committed during the call: what it keeps is as stored (nothing)
    assert [ours.get_session(f"t{n}")["events"] for n in range(12)] == [1] * 12
    assert sorted(s["session_id"] for s in ours.list_sessions()) == sorted(["s", "new"] + [f"t{n}" for n in range(12)])


def test_the_watch_is_read_by_one_thread_at_a_time(engine):
    """Python's sqlite3 shares a connection's cached statements between threads: 8 threads reading
    `PRAGMA data_version` on one connection at once got no row in thousands of reads (and the
    8-thread engine test failed on it in CI)."""
    from concurrent.futures import ThreadPoolExecutor

    engine.ingest("s", REUSING[:3])  # the store's file exists: the Engine watches it
    kept = engine._kept

    def reads(_: int) -> set[int | None]:
        return {kept._watch_version() for _ in range(2000)}

    with ThreadPoolExecutor(8) as pool:
        seen = set().union(*pool.map(reads, range(8)))
    assert None not in seen and len(seen) == 1


def _settled_as_jaclang_would(monkeypatch) -> list[tuple[str, bool]]:
    """From now on, each anchor a call takes from the kept ones is also given a load's baseline
    aside, and at the commit what `Lent.settle` recorded for it is checked against what jaclang's
    pass finds from that baseline (changed or not, the changed fields, the edge delta); the
    archetype and whether it changed, for each settled anchor."""
    from contextrender import lent as lent_module
    from jaclang.runtimelib.changeset import derive_dirty_fields

    baselines: dict = {}
    taking = working_set.lent

    def taken(anchor, baselined):  # noqa: ANN001, ANN202
        copy = Serializer._compute_hash(anchor), dict(anchor.archetype.__dict__.get("__jac_field_hashes__") or {})
        rebaseline(anchor)
        baselines[anchor.id] = (anchor.hash, dict(anchor.archetype.__jac_field_hashes__), frozenset(e.id for e in getattr(anchor, "edges", [])))
        if baselined:
            assert copy == baselines[anchor.id][:2]  # a kept anchor's baseline is a load's
        return taking(anchor, baselined)

    seen: list[tuple[str, bool]] = []
    settle = lent_module.Lent.settle

    def checked(self, changes):  # noqa: ANN001, ANN202
        anchor = self.anchor
        (whole, fields, edges) = baselines[anchor.id]
        changed = Serializer._compute_hash(anchor) != whole
        saved = anchor.archetype.__dict__.get("__jac_field_hashes__")
        object.__setattr__(anchor.archetype, "__jac_field_hashes__", fields)
        dirty = derive_dirty_fields(anchor)
        object.__setattr__(anchor.archetype, "__jac_field_hashes__", saved)
        now = frozenset(e.id for e in getattr(anchor, "edges", []))
        settled = settle(self, changes)
        if settled:
            intent = changes.intents.get(anchor.id)
            assert (intent is not None) == changed
            if intent is not None:
                assert intent.fields == dirty
                assert (set(intent.edges_added), set(intent.edges_removed)) == (set(now - edges), set(edges - now))
            seen.append((type(anchor.archetype).__name__, changed))
        return settled

    monkeypatch.setattr(working_set, "lent", taken)
    monkeypatch.setattr(lent_module.Lent, "settle", checked)
    return seen


def test_the_commit_records_what_jaclangs_pass_would_for_each_anchor_it_took(engine, monkeypatch):
    engine.render("s", REUSING[:2], budget=100)
    seen = _settled_as_jaclang_would(monkeypatch)
    for end in range(3, len(REUSING) + 1):
        engine.render("s", REUSING[:end], budget=100, usage={"input_tokens": 10 * end, "output_tokens": 3})
    engine.configure("s", omitted="drop")
    engine.render("s", REUSING + [assistant("done: compute_beta_value fixed")], budget=100)
    engine.restore("s", "r1")
    engine.render("another", REUSING[:2], budget=100)  # a session of its own (its shelf, the directory)
    kinds = {kind for (kind, _) in seen}
    # The Root too (its class has a `__getattr__`, for `shared` alone: adapters/rows.py `_class_names`).
    assert {"Session", "ToolResult", "RenderEpoch", "Root"} <= kinds
    assert any(changed for (_, changed) in seen) and any(not changed for (_, changed) in seen)
    _all_as_stored(engine)


def _stored_ids(engine) -> list:  # noqa: ANN001
    with sqlite3.connect(engine._keepalive_path) as conn:
        return [uuid.UUID(row[0]) for row in conn.execute("SELECT id FROM anchors")]


def test_the_stored_edge_order_is_taken_from_the_flush_or_read_back_only_for_nodes_whose_edges_changed(engine, monkeypatch):
    """A node the call only changed field by field keeps the edge order it was loaded or kept with
    (nobody else wrote it meanwhile), and a node it made was written in its own order, so neither
    is read back; a stored node that got an edge takes the stored order (the store merges an edge
    delta in its own order): the one its flush wrote when it merged the row on its text (the store's
    `edges_written`), else read back from the store."""
    from contextrender import store

    engine.render("s", REUSING[:4], budget=2000)
    asked: list = []
    stored = working_set.Kept._stored

    def reads(self, ids):  # noqa: ANN001, ANN202
        asked.extend(ids)
        return stored(self, ids)

    monkeypatch.setattr(working_set.Kept, "_stored", reads)
    engine.render("s", REUSING[:4], budget=2000, usage={"input_tokens": 100, "output_tokens": 10})
    assert asked == []  # the session's figures and usage changed, no edge
    engine.render("s", REUSING[:6], budget=2000)
    # The chain's tail got an edge, merged on its row's text: its stored order is the flush's.
    assert asked == []
    _all_as_stored(engine)
    before = set(_stored_ids(engine))
    monkeypatch.setattr(store.SharedSqliteStore, "_merge_stored_text", lambda *args: False)  # jaclang merges it
    engine.render("s", REUSING[:8], budget=2000)
    assert asked and set(asked) <= before  # what jaclang merged is read back
    _all_as_stored(engine)
