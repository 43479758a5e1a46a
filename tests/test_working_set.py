"""The working sets' commit passes (adapters/working_set.py): jaclang's re-baselining after a flush,
run in slices that give way between them, leaves every written anchor as jaclang's whole pass does;
new anchors are written without a write check only while jaclang's own hooks answer it."""

from __future__ import annotations

from conftest import assistant, call, tool, user
from contextrender import core, working_set
from contextrender.jaclang_setup import import_jaclang

import_jaclang()

from jaclang.jac0core.archetype import Root  # noqa: E402
from jaclang.runtimelib import memory as jac_memory  # noqa: E402
from jaclang.runtimelib.changeset import ApplyReport  # noqa: E402
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
