"""Restores (walkers/restore.jac): handles, stubs that name them, `restore_result` in-process and
on the server, the `Restored` edge, and how a restore enters the score (engine/score.jac)."""

from __future__ import annotations

import json
import re
import sqlite3
import uuid
from typing import Any

import pytest

from contextrender import Engine, InvalidRequest, Restoration, UnknownResult, UnknownSession
from contextrender.testing.checks import pairing_problems
from contextrender.client import AsyncClient, Client
from engine.measure import get_tokenizer
from engine.notices import RESTORE_TOOL
from tests.conftest import assistant, call, in_new_process, tool, user
from tests.test_render import PAPER, assert_sound
from tests.test_selectors import session

TOK = get_tokenizer()
# session(size=40): ten results of 168 tokens; at B = 1,100 with the paper's layout (PAPER: per-call
# selection, the prose share off, so nothing is folded) contextrender keeps the three newest (r8,
# r9, r10), and r7 is the first omitted (U 0.41 against r8's 0.55). The restore mechanics are
# tested there; test_a_restore_under_the_defaults_re_renders_with_the_result covers the defaults.
BUDGET = 1100
STUB = re.compile(r'^\[ContextRender: this \w+ result \(\d+ tokens\) is omitted to fit the history budget\. To see it in full, call contextrender_restore with handle "(r\d+)"\.\]$')


def stubs(result) -> dict[str, str]:
    """Handle -> stub text, for every stub of a render; each names the handle of the result it
    stands for."""
    handles = {d.call_id: d.handle for d in result.decisions}
    out = {}
    for m in result.messages:
        if m["role"] == "tool" and m["content"].startswith("[ContextRender: this"):
            found = STUB.search(m["content"])
            assert found and found.group(1) == handles[m["tool_call_id"]]
            out[found.group(1)] = m["content"]
    return out


def status(result) -> dict[str, str]:
    return {d.handle: d.status for d in result.decisions}


def graph_state(engine: Engine, session_id: str) -> tuple:
    graph = engine.export_graph(session_id)
    return (len(graph["nodes"]), sorted((e["kind"], e["from"], e["to"]) for e in graph["edges"]), engine.get_session(session_id))


# ---------------------------------------------------------------- handles and stubs


def test_every_result_gets_a_handle_and_every_stub_names_it(engine):
    messages = session(size=40)
    result = engine.render("s", messages, budget=BUDGET, explain=True, **PAPER)
    assert [d.handle for d in result.decisions] == [f"r{i}" for i in range(1, 11)]
    assert [d.call_id for d in result.decisions] == [f"c{i}" for i in range(10)]
    # B = 1,200: nothing folded, so every omitted result leaves a stub.
    result = engine.render("s", messages, budget=1200, explain=True, **PAPER)
    named = stubs(result)
    assert set(named) == {d.handle for d in result.decisions if d.status == "omitted"} and len(named) >= 5
    assert RESTORE_TOOL in named["r1"]
    assert_sound(result, 1200)  # stubs, handles included, are charged to B exactly
    # The same result has the same stub at every render (prefix caches), whatever else changes.
    later = stubs(engine.render("s", messages[:-1] + [assistant("noted"), user("go on")], budget=1200, explain=True, **PAPER))
    assert len(set(later) & set(named)) >= 5 and all(later[h] == named[h] for h in set(later) & set(named))


def test_handles_are_never_reused_after_a_fork(engine):
    messages = session(turns=3, size=10)
    engine.ingest("s", messages)
    # The agent rewrites the answer to c1: the session forks there and the new result is r4.
    rewritten = messages[:5] + [tool("c1", "a different answer"), *messages[6:]]
    assert engine.ingest("s", rewritten).forked_at == 4  # chain positions: the system prompt is off the chain
    result = engine.render("s", rewritten, budget=10_000, explain=True)
    assert [d.handle for d in result.decisions] == ["r1", "r4", "r5"]
    assert engine.restore("s", "r4").message == rewritten[5]
    with pytest.raises(UnknownResult, match="'r2'"):
        engine.restore("s", "r2")  # on the superseded branch only


# ---------------------------------------------------------------- restore_result


def test_restore_answers_the_complete_result_and_records_the_edge(engine):
    messages = session(size=40)
    engine.render("s", messages, budget=BUDGET, **PAPER)
    restored = engine.restore("s", "r7")
    assert restored.message == messages[15] and restored.call_id == "c6" and restored.tool_name == "read"
    assert (restored.handle, restored.position, restored.restores, restored.recorded) == ("r7", 14, 1, True)
    graph = engine.export_graph("s")
    nodes = {n["id"]: n for n in graph["nodes"]}
    edges = [e for e in graph["edges"] if e["kind"] == "Restored"]
    assert len(edges) == 1
    # From the requesting turn (the latest event: the current user message) to the result.
    assert nodes[edges[0]["from"]]["position"] == len(messages) - 2 and nodes[edges[0]["from"]]["role"] == "user"
    assert nodes[edges[0]["to"]]["handle"] == "r7"
    # The same turn asking again (a retried request) is one restore; a later turn's is another.
    assert engine.restore("s", "r7").recorded is False
    assert engine.get_session("s")["restores"] == 1
    engine.ingest("s", messages + [assistant("checked")])
    again = engine.restore("s", "r7")
    assert again.recorded and again.restores == 2 and engine.get_session("s")["restores"] == 2


@pytest.mark.parametrize("handle, error, fragment", [
    ("r99", UnknownResult, "no tool result 'r99'"),
    ("p3", UnknownResult, "no tool result 'p3'"),  # derived handles name only results stored before handles
    ("u1", UnknownResult, "no user message at position 1"),  # a user message's handle names a user message
    ("u999", UnknownResult, "no user message at position 999"),
    ("7", InvalidRequest, "such as 'r17'"),
    ("r7; drop", InvalidRequest, "such as 'r17'"),
    ("", InvalidRequest, "such as 'r17'"),
    (17, InvalidRequest, "such as 'r17'"),
])
def test_a_bad_handle_is_refused_and_nothing_is_written(engine, handle, error, fragment):
    engine.render("s", session(size=40), budget=BUDGET, **PAPER)
    before = graph_state(engine, "s")
    with pytest.raises(error, match=re.escape(fragment)) as raised:
        engine.restore("s", handle)
    assert raised.value.status == (404 if error is UnknownResult else 400)
    assert graph_state(engine, "s") == before


def test_an_unknown_session_is_a_404(engine):
    with pytest.raises(UnknownSession):
        engine.restore("nobody", "r1")
    assert engine.list_sessions() == []


# ---------------------------------------------------------------- the score


def test_a_restored_result_stays_in_view_at_the_next_render(engine):
    messages = session(size=40)
    before = engine.render("s", messages, budget=BUDGET, explain=True, **PAPER)
    assert status(before)["r7"] == "omitted" and status(before)["r8"] == "kept"
    engine.restore("s", "r7")
    after = engine.render("s", messages, budget=BUDGET, explain=True, **PAPER)
    decision = next(d for d in after.decisions if d.handle == "r7")
    # One restore adds restore_weight (2) to c_t: 0 -> 2, reuse term 1 - e^(-0.2 * 2).
    assert (decision.restores, decision.reuse_count) == (1, 2.0)
    assert decision.reuse == pytest.approx(1 - 2.718281828459045 ** -0.4)
    assert decision.status == "kept" and "r7" not in stubs(after)
    assert_sound(after, BUDGET)
    assert pairing_problems(after.messages) == []


def test_a_restore_under_the_defaults_re_renders_with_the_result(engine):
    """The stable policy appends while it can; a restore since the previous request makes the next
    render a re-render on all of B, and no partial re-render may leave the restored result out."""
    messages = session(size=40)
    stub_layout = {"prose_share": 1.0, "condense": False}  # nothing folded: r7 has a stub to name it
    before = engine.render("s", messages, budget=BUDGET, explain=True, **stub_layout)
    assert status(before)["r7"] == "omitted" and "r7" in stubs(before)
    again = engine.render("s", messages + [assistant("looking"), user("go on")], budget=BUDGET, explain=True, **stub_layout)
    assert again.mode == "append" and status(again)["r7"] == "omitted"
    engine.restore("s", "r7")
    messages += [assistant("looking"), user("go on"), assistant("still looking"), user("and now?")]
    after = engine.render("s", messages, budget=BUDGET, explain=True, **stub_layout)
    assert after.mode == "re-render" and "r7 was restored" in after.mode_reason
    assert status(after)["r7"] == "kept" and "r7" not in stubs(after)
    assert_sound(after, BUDGET)
    assert pairing_problems(after.messages) == []
    # The restore is taken into account once: the next call appends again, r7 still shown.
    later = engine.render("s", messages + [assistant("found it"), user("fix it")], budget=BUDGET, explain=True, **stub_layout)
    assert later.mode == "append" and status(later)["r7"] == "kept"


def test_a_restore_weight_is_a_setting_and_must_not_be_negative(engine):
    messages = session(size=40)
    engine.render("s", messages, budget=BUDGET, **PAPER)
    engine.restore("s", "r7")
    heavy = engine.render("s", messages, budget=BUDGET, explain=True, restore_weight=5, **PAPER)
    assert next(d for d in heavy.decisions if d.handle == "r7").reuse_count == 5.0
    with pytest.raises(InvalidRequest, match="'restore_weight' must be between 0.0 and 1000.0"):
        engine.render("s", messages, budget=BUDGET, restore_weight=-1)


def test_paper_exact_renders_ignore_restores(engine):
    messages = session(size=40)
    engine.render("s", messages, budget=BUDGET, **PAPER)
    engine.restore("s", "r7")
    # contextrender with restore_weight 0 is the paper's formula: the same as a session never restored.
    exact = engine.render("s", messages, budget=BUDGET, explain=True, restore_weight=0, **PAPER)
    fresh = engine.render("fresh", messages, budget=BUDGET, explain=True, **PAPER)
    assert status(exact) == status(fresh) and status(exact)["r7"] == "omitted"
    assert [d.reuse_count for d in exact.decisions] == [d.reuse_count for d in fresh.decisions]
    assert next(d for d in exact.decisions if d.handle == "r7").restores == 1  # still reported
    # The B.3 ablations never count them.
    for selector in ("cr-recency", "cr-relevance", "cr-recency-relevance"):
        ablated = engine.render("s", messages, budget=BUDGET, explain=True, selector=selector, **PAPER)
        assert next(d for d in ablated.decisions if d.handle == "r7").reuse_count == 0.0


def test_only_restores_asked_from_the_live_chain_count(engine):
    messages = session(size=40)
    engine.render("s", messages, budget=BUDGET, **PAPER)
    engine.ingest("s", messages + [assistant("looking"), user("more")])
    engine.restore("s", "r7")  # asked from the turn "more"
    assert engine.get_session("s")["restores"] == 1
    # The agent rewrites its last turn: the requesting turn is superseded, so is its restore.
    engine.ingest("s", messages + [assistant("something else")])
    assert engine.get_session("s")["restores"] == 0
    assert status(engine.render("s", messages + [assistant("something else")], budget=BUDGET, explain=True, **PAPER))["r7"] == "omitted"


def test_restores_are_counted_again_after_a_restart(tmp_path):
    messages = session(size=40)
    engine = Engine(tmp_path)
    engine.render("s", messages, budget=BUDGET, **PAPER)
    engine.restore("s", "r7")
    script = (
        "import sys, json; from contextrender import Engine; from tests.test_selectors import session; "
        "e = Engine(sys.argv[1]); r = e.render('s', session(size=40), budget=1100, explain=True, policy='per-call', prose_share=1.0, condense=False); "
        "print(json.dumps([[d.handle, d.status, d.restores] for d in r.decisions if d.handle == 'r7']))"
    )
    assert in_new_process(script, tmp_path) == [["r7", "kept", 1]]


def test_results_stored_before_handles_existed_get_derived_ones(tmp_path):
    messages = session(size=40)
    Engine(tmp_path).ingest("s", messages)
    with sqlite3.connect(next((tmp_path / ".jac" / "data").glob("*.db"))) as db:
        # As a store written before handles: no handle on results, no counters on the session.
        rows = db.execute("SELECT id, arch_type, data FROM anchors WHERE arch_type IN ('ToolResult', 'Session')").fetchall()
        assert len(rows) == 11
        for (anchor_id, kind, data) in rows:
            stored = json.loads(data)
            for field in (("handle",) if kind == "ToolResult" else ("handles", "restores")):
                assert field in stored["archetype"]
                del stored["archetype"][field]
            db.execute("UPDATE anchors SET data = ?, fingerprint = 'before-handles' WHERE id = ?", (json.dumps(stored), anchor_id))
    script = (
        "import sys, json; from contextrender import Engine; from tests.test_selectors import session; "
        "from tests.conftest import assistant, call, tool, user; "
        "e = Engine(sys.argv[1]); m = session(size=40); "
        "m = m[:-1] + [assistant(None, call('c10', 'read', {})), tool('c10', 'NEW_RESULT_1 ' * 50), user('go')]; "
        "r = e.render('s', m, budget=700, explain=True, policy='per-call', prose_share=1.0, condense=False); x = e.restore('s', 'p14'); "
        "print(json.dumps([[d.handle for d in r.decisions], x.message['tool_call_id'], "
        "[t['content'][-60:] for t in r.messages if t['role'] == 'tool' and t['content'].startswith('[ContextRender')][:1]]))"
    )
    (handles, restored_call, stub) = in_new_process(script, tmp_path)
    # Old results: p<position> (positions 2, 4, ... in the chain); the new one: the counter's r1.
    assert handles == [f"p{2 + 2 * i}" for i in range(10)] + ["r1"]
    assert restored_call == "c6" and re.search(r'handle "p\d+"\.\]$', stub[0])


# ---------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def carol(jac_server):
    with Client(jac_server.url) as client:
        client.register(f"carol_{uuid.uuid4().hex[:8]}", "secret-password-1")
        yield client


def test_the_server_endpoint(carol):
    messages = session(size=40)
    rendered = carol.render("s", messages, budget=BUDGET, **PAPER)
    assert any(m["content"].endswith('handle "r7".]') for m in rendered.messages if m["role"] == "tool")
    restored = carol.restore("s", "r7")
    assert isinstance(restored, Restoration)  # the type Engine.restore returns
    assert restored.message == messages[15] and restored.restores == 1 and restored.recorded is True
    assert carol.get_session("s")["restores"] == 1
    kinds = [e["kind"] for e in carol.export_graph("s")["edges"]]
    assert kinds.count("Restored") == 1
    explained = carol.render("s", messages, budget=BUDGET, explain=True, **PAPER)
    r7 = next(d for d in explained.decisions if d.handle == "r7")
    assert (r7.status, r7.restores, r7.reuse_count) == ("kept", 1, 2.0)


def test_the_server_refuses_bad_handles_and_writes_nothing(carol, jac_server):
    carol.render("bad", session(size=40), budget=BUDGET, **PAPER)
    before = (carol.get_session("bad"), carol.export_graph("bad"))
    with pytest.raises(UnknownResult) as unknown:
        carol.restore("bad", "r404")
    assert unknown.value.status == 404 and "no tool result 'r404'" in str(unknown.value)
    with pytest.raises(InvalidRequest) as malformed:
        carol.restore("bad", "handle-7")
    assert malformed.value.status == 400 and "such as 'r17'" in str(malformed.value)
    with pytest.raises(UnknownSession):
        carol.restore("no-such-session", "r1")
    assert (carol.get_session("bad"), carol.export_graph("bad")) == before


def test_the_async_client_restores(jac_server, carol):
    import asyncio

    carol.render("async", session(size=40), budget=BUDGET, **PAPER)

    async def run() -> Any:
        async with AsyncClient(jac_server.url, token=carol.token) as client:
            return await client.restore("async", "r2")

    assert asyncio.run(run()).message["tool_call_id"] == "c1"
