"""Ingestion (walkers/ingest.jac): a resent earlier turn is recognised, a real rewrite forks, and an
answer placed after a position is compared with what the chain holds there."""

from __future__ import annotations

import random

import pytest

from contextrender import InvalidRequest
from contextrender.testing.checks import pairing_problems
from tests.conftest import assistant, call, tool, user

SYSTEM = {"role": "system", "content": "You answer order questions."}


def run(results: int) -> list[dict]:
    """System, a user question, `results` lookups each answered, and a closing answer."""
    messages = [SYSTEM, user("Where are my orders?")]
    for i in range(results):
        messages.append(assistant(None, call(f"c{i}", "lookup", {"order": f"ORD-{1000 + i}"})))
        messages.append(tool(f"c{i}", f"order ORD-{1000 + i} for buyer{i}@example.com: shipped to depot {i} " * 12))
    messages.append(assistant("All shipped."))
    return messages


def shape(engine, session_id: str) -> tuple[int, int, int]:
    """(graph nodes, Superseded edges, the session's branch): what a fork or a duplicate would grow."""
    graph = engine.export_graph(session_id)
    superseded = sum(1 for edge in graph["edges"] if edge["kind"] == "Superseded")
    return len(graph["nodes"]), superseded, engine.get_session(session_id)["branch"]


def test_a_resent_earlier_turn_writes_nothing_and_renders_that_turn(engine):
    messages = run(10)
    engine.render("s", messages, budget=400)
    before = shape(engine, "s")
    assert before[1:] == (0, 0)
    summary = engine.ingest("s", messages[:12])
    assert (summary.forked_at, summary.resent, summary.added) == (-1, 11, 0)
    assert shape(engine, "s") == before
    # The render of a resend shows that turn: it ends where the resent list ends, within B.
    rendered = engine.render("s", messages[:12], budget=400)
    assert rendered.messages[-1] == messages[11] and rendered.history_tokens <= 400
    assert pairing_problems(rendered.messages) == []
    assert all(m.get("content") != "All shipped." for m in rendered.messages)
    assert shape(engine, "s") == before and engine.get_session("s")["events"] == len(messages) - 1
    # The whole list again renders the whole chain.
    assert engine.render("s", messages, budget=400).messages[-1]["content"] == "All shipped."


def test_a_rewrite_still_forks(engine):
    messages = run(4)
    engine.ingest("s", messages)
    rewritten = messages[:5] + [assistant("Let me check something else.")]
    summary = engine.ingest("s", rewritten)
    assert (summary.forked_at, summary.resent) == (4, -1)
    assert shape(engine, "s")[1:] == (1, 1)


def test_an_answer_placed_after_a_position_is_compared_with_the_chain_there(engine):
    messages = run(4)
    engine.ingest("s", messages)
    before = shape(engine, "s")
    # The stored answer to the first lookup, sent again after the 3 events before it: nothing new.
    same = engine.ingest("s", [messages[4]], append=True, at=3)
    assert (same.added, same.forked_at, same.resent) == (0, -1, 4)
    assert shape(engine, "s") == before
    # Another answer there: the chain forks at that position and the answer follows event 3.
    other = engine.ingest("s", [assistant("No lookup needed.")], append=True, at=3)
    assert (other.added, other.forked_at, other.events) == (1, 3, 4)
    assert engine.get_session("s")["branch"] == 1


def test_the_fork_test_does_not_compare_the_resent_history_again(engine, monkeypatch):
    """split_messages compared the resent history with the stored chain and says how far they
    agree: ingestion's fork test starts there (it compared the whole history a second time)."""
    import copy

    import walkers.ingest as ingest_module

    messages = run(30)
    engine.ingest("s", messages)
    compared: list = []
    real = ingest_module.matching_run
    monkeypatch.setattr(ingest_module, "matching_run", lambda a, i, b, j: compared.append(real(a, i, b, j)) or compared[-1])
    grown = engine.ingest("s", copy.deepcopy(messages) + [user("next")])
    assert (grown.added, grown.forked_at) == (1, -1) and sum(compared) == 0
    edited = copy.deepcopy(messages)
    edited[21] = tool("c9", "edited")
    fork = engine.ingest("s", edited)
    assert fork.forked_at == 20 and sum(compared) == 0
    # An echo of an answer (the same text and calls, re-serialised) is still not a rewrite.
    echoed = copy.deepcopy(messages) + [user("again")]
    echoed[4] = dict(echoed[4], refusal=None)
    assert engine.ingest("t", messages).added == len(messages) - 1
    again = engine.ingest("t", echoed)
    assert (again.added, again.forked_at) == (1, -1) and sum(compared) == len(messages) - 1 - 4


def test_the_index_copies_a_calls_messages_in_one_pass_before_placing_them(engine, monkeypatch):
    """The copies the index keeps are made side by side, before the call's nodes: every later
    call compares its resent history with them (split_messages), out of the processor's caches.
    An in-place change of the caller's dicts after the call still changes nothing stored."""
    import walkers.ingest as ingest_module

    order: list = []
    (as_stored, link) = (ingest_module.as_stored, ingest_module._link)
    monkeypatch.setattr(ingest_module, "as_stored", lambda message: order.append("copy") or as_stored(message))
    monkeypatch.setattr(ingest_module, "_link", lambda *arguments: order.append("link") or link(*arguments))
    messages = run(5)
    engine.ingest("s", messages)
    copies = order.count("copy")
    assert copies == len(messages) - 1 and order[:copies] == ["copy"] * copies
    messages[3]["content"] = "changed in place"
    assert engine.ingest("s", messages).forked_at == 2


def test_at_past_the_chain_is_refused(engine):
    engine.ingest("s", run(1))
    with pytest.raises(InvalidRequest, match="at=9"):
        engine.ingest("s", [user("hi")], append=True, at=9)


def test_writers_sending_one_growing_list_out_of_order_leave_one_chain(engine):
    messages = run(20)
    # Lengths that end on a whole round (a tool result) or the closing answer, in a shuffled order,
    # as writers that each hold a copy of the list at another moment would send them.
    lengths = [2 + 2 * k for k in range(1, 21)] + [len(messages)]
    order = lengths[:]
    random.Random(7).shuffle(order)
    for length in order:
        engine.ingest("s", messages[:length])
    nodes, superseded, branch = shape(engine, "s")
    assert (superseded, branch) == (0, 0)
    assert engine.get_session("s")["tool_results"] == 20
    results = [n for n in engine.export_graph("s")["nodes"] if n["kind"] == "ToolResult"]
    assert len(results) == 20
    assert engine.get_session("s")["events"] == len(messages) - 1


def test_edges_between_new_nodes_skip_connects_checks_only_while_jaclang_answers_them(engine):
    """Ingestion builds the edges between the nodes it made without connect's access checks
    (jaclang's grant every unhashed node); a plugin with its own check is asked, and the graph
    is the same."""
    import walkers.ingest as ingest_module
    from jaclang.jac0core.runtime import hookimpl, plugin_manager

    asked: list = []

    class AsksForNewNodes:
        @staticmethod
        @hookimpl
        def check_connect_access(to, op_hint: str = "connect") -> bool:  # noqa: ANN001 (jaclang's hook)
            if to.hash == 0:
                asked.append(to.id)
            return True

    assert ingest_module._jaclang_connects()
    engine.ingest("plain", run(3))
    plugin = AsksForNewNodes()
    plugin_manager.register(plugin, name="asks-for-new-nodes")
    try:
        assert not ingest_module._jaclang_connects()
        engine.ingest("checked", run(3))
    finally:
        plugin_manager.unregister(plugin)
    assert ingest_module._jaclang_connects()
    assert len(set(asked)) >= 9  # the new events and calls, each asked as an edge's end
    (plain, checked) = (engine.export_graph(s) for s in ("plain", "checked"))
    assert len(plain["nodes"]) == len(checked["nodes"]) and len(plain["edges"]) == len(checked["edges"])
    assert sorted(e["kind"] for e in plain["edges"]) == sorted(e["kind"] for e in checked["edges"])


def test_no_full_collection_while_a_call_makes_its_nodes(engine, monkeypatch):
    """Python's full collections scanned every object of the process three or four times during a
    2,000-result ingestion (a fifth of its CPU time) to free almost nothing: the nodes a call makes
    live until it ends. Full collections are held (engine/courtesy.jac) while ingestion places and
    links them, and the collector's thresholds are as they were after, also when it was held already."""
    import gc

    from engine.courtesy import CALLS, HELD_FULL_THRESHOLD
    from engine.index import SessionIndex

    seen: list[int] = []
    add = SessionIndex.add
    monkeypatch.setattr(SessionIndex, "add", lambda self, *args, **kwargs: seen.append(gc.get_threshold()[2]) or add(self, *args, **kwargs))
    thresholds = gc.get_threshold()
    assert thresholds[2] != HELD_FULL_THRESHOLD
    engine.ingest("s", run(4))
    assert len(seen) == len(run(4)) - 1 and set(seen) == {HELD_FULL_THRESHOLD}  # each event but the system message
    assert gc.get_threshold() == thresholds and CALLS.holding == 0
    CALLS.hold_full_collections()  # a long call of the server's, say
    try:
        engine.ingest("s", run(5))
        assert gc.get_threshold()[2] == HELD_FULL_THRESHOLD  # still its hold
    finally:
        CALLS.release_full_collections()
    assert gc.get_threshold() == thresholds
    assert engine.get_session("s")["events"] == len(run(5)) - 1


def test_edges_are_built_and_saved_without_jaclangs_dispatch_while_jaclang_answers(engine, monkeypatch):
    """Ingestion builds and saves its edges as jaclang's `build_edge` builder and `save` do, without
    a hook call for each (`save` through jaclang's dispatch, for the edge and each new node: about
    5 % of a long ingestion); a plugin that answers `save` itself gets every save, and the graph
    and the render are the ones jaclang's connect makes."""
    import walkers.ingest as ingest_module
    from jaclang.jac0core.runtime import JacRuntimeInterface, hookimpl, plugin_manager

    saved: list = []
    save = JacRuntimeInterface.save
    monkeypatch.setattr(JacRuntimeInterface, "save", lambda obj: saved.append(obj) or save(obj))
    messages = run(6)
    for session in ("lean", "connect"):
        engine.ingest(session, messages[:2])  # the session made (its directory and shelves: connect's)
    saved[:] = []
    engine.ingest("lean", messages)
    assert saved == []

    class SavesItself:
        @staticmethod
        @hookimpl
        def save(obj) -> None:  # noqa: ANN001 (jaclang's hook)
            saved.append(obj)

    plugin = SavesItself()
    plugin_manager.register(plugin, name="saves-itself")
    try:
        assert not ingest_module._jaclang_connects()
    finally:
        plugin_manager.unregister(plugin)
    assert ingest_module._jaclang_connects()
    monkeypatch.setattr(ingest_module, "_jaclang_connects", lambda: False)
    engine.ingest("connect", messages)
    assert len(saved) >= len(messages) - 2  # connect saves through the hook
    (lean, plain) = (engine.export_graph(s) for s in ("lean", "connect"))
    assert sorted(e["kind"] for e in lean["edges"]) == sorted(e["kind"] for e in plain["edges"])
    assert sorted(n["kind"] for n in lean["nodes"]) == sorted(n["kind"] for n in plain["nodes"])
    assert engine.render("lean", messages, budget=600).messages == engine.render("connect", messages, budget=600).messages


def test_an_edge_to_a_stored_node_asks_its_access_check_as_connect_would(engine, monkeypatch):
    """Ingestion builds an edge to a node loaded from the store (the chain's tail, a result reused
    again) without jaclang's connect and its dispatch: the stored end's check is asked as connect
    asks it, the new end's is not (jaclang answers WRITE for it unasked), and the graph is the
    one connect builds."""
    import walkers.ingest as ingest_module
    from jaclang.jac0core.runtime import JacRuntimeInterface

    # The last answer reuses a value of a stored result (a `Reuses` edge to it).
    messages = run(8) + [user("And ORD-1002?"), assistant("ORD-1002 went to depot 2 as well.")]
    for session in ("lean", "connect"):
        engine.ingest(session, messages[:8])
    asked: list = []
    check = JacRuntimeInterface.check_connect_access  # connect's and `_link`'s (JacRuntime inherits it)
    monkeypatch.setattr(JacRuntimeInterface, "check_connect_access",
                        lambda anchor, op_hint="connect":
                        (op_hint == "edge_write" and asked.append(anchor.hash)) or check(anchor, op_hint=op_hint))
    engine.ingest("lean", messages)
    assert len(asked) >= 2 and all(hashed != 0 for hashed in asked)  # the chain's tail, the reused result
    (lean_asked, asked[:]) = (len(asked), [])
    monkeypatch.setattr(ingest_module, "_jaclang_connects", lambda: False)
    engine.ingest("connect", messages)  # jaclang's connect asks for both ends, new ones too
    assert len([hashed for hashed in asked if hashed != 0]) == lean_asked
    assert any(hashed == 0 for hashed in asked)
    (lean, plain) = (engine.export_graph(s) for s in ("lean", "connect"))
    assert sorted(e["kind"] for e in lean["edges"]) == sorted(e["kind"] for e in plain["edges"])
    assert len(lean["nodes"]) == len(plain["nodes"])
    assert engine.render("lean", messages, budget=600).messages == engine.render("connect", messages, budget=600).messages


def test_a_call_reads_its_context_and_the_topology_index_setting_once(engine, monkeypatch):
    """jaclang's builder and `save` ask for the context through its dispatch and read the topology
    index's setting for each edge and each new node; ingestion reads both once a call, and calls
    the index's hooks for each edge and node when the index is on."""
    import walkers.ingest as ingest_module
    from jaclang.jac0core.runtime import JacRuntimeInterface
    from jaclang.runtimelib import topo_utils

    messages = run(6)
    engine.ingest("s", messages[:2])
    reads: list = []
    get_context = JacRuntimeInterface.get_context
    monkeypatch.setattr(JacRuntimeInterface, "get_context", lambda: reads.append("context") or get_context())
    enabled = topo_utils._is_enabled
    for module in (topo_utils, ingest_module):
        monkeypatch.setattr(module, "_is_enabled", lambda: reads.append("setting") or enabled(), raising=False)
    engine.ingest("s", messages)
    (settings, contexts, reads[:]) = (reads.count("setting"), reads.count("context"), [])
    engine.ingest("s", messages + run(18)[len(messages) - 1:])  # twice the new events (25)
    assert settings == reads.count("setting") == 1 and contexts == reads.count("context")  # not per edge
    indexed: list = []
    for name in ("on_edge_created", "on_node_saved"):
        monkeypatch.setattr(ingest_module, name, lambda *anchors, name=name: indexed.append(name), raising=False)
    monkeypatch.setenv("JAC_TOPOLOGY_INDEX", "1")
    summary = engine.ingest("t", messages)
    assert indexed.count("on_node_saved") >= summary.added and indexed.count("on_edge_created") >= summary.added


def test_the_passes_place_and_track_the_new_events_without_a_walker_step_each(engine, monkeypatch):
    # A walker's step (a visit and jaclang's dispatch of its entry ability) cost about 20 µs a
    # new event, more than placing it: the ingestion and TFA passes loop over the new events.
    from jaclang.jac0core.runtime import plugin_manager

    visits = []
    visit = plugin_manager.hook.visit
    monkeypatch.setattr(plugin_manager.hook, "visit", lambda **arguments: visits.append(1) or visit(**arguments))
    engine.ingest("few", run(2))
    few = len(visits)
    messages = run(20)
    summary = engine.ingest("s", messages)
    assert (summary.added, summary.results) == (len(messages) - 1, 20)
    # The same steps (the walk to the session) for 20 tool rounds as for 2.
    assert len(visits) - few == few
    # The chain, the calls, their answers and the reuse are all there.
    graph = engine.export_graph("s")
    kinds = [edge["kind"] for edge in graph["edges"]]
    assert (kinds.count("Next"), kinds.count("Calls"), kinds.count("Answered")) == (len(messages) - 1, 20, 20)
    assert engine.ingest("s", messages).added == 0


def test_the_tfa_pass_is_called_not_spawned(engine, monkeypatch):
    # A nested spawn cost about 40 µs of jaclang's walk machinery a call: the ingestion spawns the
    # ingestion pass on the session, and the TFA pass is an object it calls: as many spawns for a
    # call that links reuses as for one that adds nothing.
    from jaclang.jac0core.runtime import plugin_manager

    spawned = []
    spawn = plugin_manager.hook.spawn

    def counted(*arguments, **named):
        spawned.append(" ".join(type(value).__name__ for value in (*arguments, *named.values())))
        return spawn(*arguments, **named)

    monkeypatch.setattr(plugin_manager.hook, "spawn", counted)
    messages = run(3)
    engine.ingest("s", messages)
    spawned[:] = []
    assert engine.ingest("s", messages).added == 0
    nothing = len(spawned)
    spawned[:] = []
    # A lookup of a value an earlier result holds: a reuse to link.
    summary = engine.ingest("s", messages + [assistant(None, call("x1", "lookup", {"order": "ORD-1001"})), tool("x1", "again")])
    assert summary.added == 2 and summary.reuse_links >= 1
    assert nothing > 0 and len(spawned) == nothing and not any("TrackReuse" in kinds for kinds in spawned)


def test_a_new_nodes_id_text_is_read_from_its_anchor_not_asked_through_the_dispatch(engine, monkeypatch):
    # jaclang's `object_ref` (what `jid` asks, 2-3 µs a call through its dispatch) answers a node's
    # anchor id in hex: ingestion reads it directly while no plugin answers that hook.
    from jaclang import JacRuntime
    from jaclang.jac0core.runtime import plugin_manager

    asked = []

    class Counted:
        # jaclang's hook, its calls counted (its implementations still listed).
        def __init__(self, hook):
            self.hook = hook

        def __call__(self, **arguments):
            asked.append(1)
            return self.hook(**arguments)

        def __getattr__(self, name):
            return getattr(self.hook, name)

    monkeypatch.setattr(plugin_manager.hook, "object_ref", Counted(plugin_manager.hook.object_ref))
    engine.ingest("few", run(2))
    few = len(asked)
    engine.ingest("s", run(20))
    # 61 new nodes (41 events, 20 calls): fewer asks than tool rounds (the session's own are left).
    assert len(asked) - few < 20
    from graph.context import Message
    from walkers.ingest import LeanLinks, _node_id

    made = Message(position=0, turn=0, raw="{}", tokens=1)
    lean = LeanLinks(context=None, indexed=False, ids=True)
    assert _node_id(made, lean) == _node_id(made, None) == JacRuntime.object_ref(made) == made.__jac__.id.hex
