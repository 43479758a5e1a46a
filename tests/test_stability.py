"""The cache-stable render policy (engine/stability.jac) and the prose share (engine/prose.jac):
appends, re-renders, hysteresis, partial re-renders, the epoch state on the graph, and the share
of B left to tool results. Every render is checked for Tok(H) <= B and valid tool-call pairing."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import pytest

from contextrender import Engine
from contextrender.edge_lists import ROWS
from engine.measure import get_tokenizer
from tests.conftest import REUSING, assistant, call, db_file, tool, user
from tests.test_render import assert_sound, filler, history_of

TOK = get_tokenizer()


def session(rounds: int, size: int = 60, prose: str = "") -> list[dict]:
    """A coding-agent-like history: one task, then rounds of a call and its result, each
    result introducing a value (VALUE_<i>00) that no other message holds."""
    messages = [user("fix the failing test")]
    for i in range(rounds):
        text = f"step {i} {prose}".strip()
        messages += [assistant(text, call(f"c{i}", "read", {"path": f"src/mod_{i}.py"})),
                     tool(f"c{i}", f"VALUE_{i}00 " + filler(f"r{i}x", size))]
    return messages


def replay(engine: Engine, messages: list[dict], budget: int, **settings) -> list:
    """Render before every assistant message, as an agent calls the model (each render checked)."""
    results = []
    for j, message in enumerate(messages + [assistant("done")]):
        if message["role"] == "assistant" and j > 0:
            result = engine.render("s", messages[:j], budget=budget, **settings)
            assert_sound(result, budget)
            results.append(result)
    return results


def shared_prefix(before: list[dict], after: list[dict]) -> int:
    n = 0
    while n < min(len(before), len(after)) and before[n] == after[n]:
        n += 1
    return n


def test_stable_is_the_default_and_appends_keep_the_previous_request_as_a_prefix(engine):
    # (At 1,200 tokens the defaults' headroom, 0.3 of B shrinking with B / full history, holds
    # less than one of these steps: every render past the first is a re-render.)
    budget = 1600
    results = replay(engine, session(24), budget)
    modes = [r.mode for r in results]
    assert {"passthrough", "append", "re-render"} <= set(modes)
    for before, after in zip(results, results[1:]):
        if after.mode == "append":
            # The whole previous request is repeated: a provider's prefix cache keeps all of it.
            assert after.messages[:len(before.messages)] == before.messages
            assert after.history_tokens > before.history_tokens or after.messages == before.messages


def test_re_render_happens_when_the_append_would_exceed_the_budget_and_leaves_headroom(engine):
    budget = 1200
    # (No hysteresis, as before 2026-12-06: with it the newest step's results are kept beyond the
    # cap, and these steps re-render every time; that guard is tested below.)
    results = replay(engine, session(24), budget, headroom=0.4, cache_value=0.0, stickiness=0.0)
    rerenders = [(b, a) for b, a in zip(results, results[1:]) if a.mode == "re-render" and b.mode == "append"]
    assert rerenders
    for before, after in rerenders:
        assert "exceed the budget" in after.mode_reason
        # Headroom shrinks with B / full history, never below what is left free at headroom 0.
        share = 0.4 * min(1.0, budget / after.full_history_tokens)
        assert after.history_tokens <= budget * (1 - share) + 1
    first = next(r for r in results if r.mode == "re-render")
    assert first.mode_reason == "the whole history no longer fits the budget"


def test_a_session_first_rendered_over_budget_is_re_rendered_whole(engine):
    """Nothing was sent before, so no prefix is kept: the paper's selection on B minus headroom."""
    budget = 1200
    result = engine.render("s", session(24), budget=budget)
    assert_sound(result, budget)
    assert result.mode == "re-render" and result.mode_reason == "first selective render with these settings"


def test_explain_says_append_or_re_render_and_why(engine):
    """Explained after every render of a replay that both re-renders and appends (the first
    over-budget render is a re-render; the next ones append until the budget is reached)."""
    budget = 1600
    messages = session(24)
    # (The defaults before 2026-12-06, no hysteresis: a re-render's kept results are then all the
    # selection's; the newest step's, kept before it with the hysteresis, say so in their own
    # words, tested below.)
    old = {"headroom": 0.5, "stickiness": 0.0, "sticky_to": "shown"}
    explained_modes = []
    for j, message in enumerate(messages + [assistant("done")]):
        if message["role"] != "assistant" or j == 0:
            continue
        result = engine.render("s", messages[:j], budget=budget, **old)
        explained = engine.explain("s")
        assert explained.mode == result.mode and explained.mode_reason == result.mode_reason, j
        assert engine.get_session("s")["last_render"]["mode"] == result.mode
        by_status: dict[str, list[str]] = {}
        for d in explained.decisions:
            by_status.setdefault(d.status, []).append(d.reason)
        if result.mode == "append":
            # Results of the previous request, and the new ones, are kept; what the last
            # re-render left out stays out.
            assert by_status["kept"] and all("kept as it was (append)" in r or "appended after its unchanged" in r
                                             for r in by_status["kept"]), (j, by_status)
            assert any("appended after its unchanged" in r for r in by_status["kept"]), (j, by_status)
            assert by_status["omitted"] and all("left out while the previous history is only appended to" in r
                                                for r in by_status["omitted"]), (j, by_status)
        elif result.mode == "re-render":
            # A selection from scratch: each kept result names its rank, each omitted one its cost.
            assert by_status["kept"] and all(r.startswith("selected #") for r in by_status["kept"]), (j, by_status)
            assert by_status["omitted"] and all(r.startswith("did not fit: needs ") for r in by_status["omitted"]), (j, by_status)
        explained_modes.append(result.mode)
    assert "re-render" in explained_modes and "append" in explained_modes, explained_modes


def test_per_call_policy_selects_from_scratch_every_time(engine, tmp_path):
    budget = 1200
    messages = session(24)
    results = replay(engine, messages, budget, policy="per-call")
    assert {r.mode for r in results} <= {"passthrough", "per-call"}
    # No state: a fresh store renders the same history identically.
    fresh = Engine(tmp_path / "other").render("s", messages, budget=budget, policy="per-call")
    assert fresh.messages == results[-1].messages


def test_epoch_state_is_kept_per_budget_and_settings(engine):
    messages = session(24)
    # (headroom 0.5 and no hysteresis, the defaults before issue 32 item 4's third round: these
    # steps append often.)
    old = {"headroom": 0.5, "stickiness": 0.0}
    variants = [{"budget": 1000} | old, {"budget": 1500} | old, {"budget": 1000, "prose_share": 0.5} | old]
    previous: list = [None] * len(variants)
    appends = 0
    for j, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        engine.ingest("s", messages[:j])
        for k, result in enumerate(engine.render_variants("s", variants)):
            assert_sound(result, variants[k]["budget"])
            if result.mode == "append":
                appends += 1
                assert result.messages[:len(previous[k].messages)] == previous[k].messages
            previous[k] = result
    assert appends >= 6


def test_epoch_state_survives_a_restart(tmp_path):
    """A new process (no cached index, no in-memory state) renders exactly what the first one
    would have rendered next: the epoch state is on the graph."""
    budget = 1600
    messages = session(24)
    reference = replay(Engine(tmp_path / "a"), messages, budget)
    turns = [j for j, m in enumerate(messages + [assistant("done")]) if m["role"] == "assistant" and j > 0]
    cut = next(k for k in range(len(reference) - 1) if reference[k].selected and reference[k + 1].mode == "append")
    store = tmp_path / "b"
    engine = Engine(store)
    for k in range(cut + 1):
        assert engine.render("s", messages[:turns[k]], budget=budget).messages == reference[k].messages
    script = (
        "import json, sys\n"
        "from contextrender import Engine\n"
        "messages = json.loads(sys.argv[2])\n"
        "r = Engine(sys.argv[1]).render('s', messages, budget=int(sys.argv[3]))\n"
        "print(json.dumps({'messages': r.messages, 'mode': r.mode}))\n"
    )
    following = messages[:turns[cut + 1]]
    done = subprocess.run([sys.executable, "-c", script, str(store), json.dumps(following), str(budget)],
                          capture_output=True, text=True, check=True)
    after = json.loads(done.stdout.strip().splitlines()[-1])
    assert after["mode"] == reference[cut + 1].mode == "append"
    assert after["messages"] == reference[cut + 1].messages


def epoch_rows(path: str) -> dict[str, dict]:
    """The stored RenderEpoch rows' archetype fields, by row id (from the rows' own table)."""
    with sqlite3.connect(path) as conn:
        rows = conn.execute(f"SELECT id, data FROM {ROWS} WHERE arch_type = 'RenderEpoch'").fetchall()
    return {key: json.loads(data)["archetype"] for (key, data) in rows}


def explained_and_rendered_in_a_new_process(store, messages: list[dict], budget: int) -> dict:
    """In a new process on `store`: the last render explained (rendered again from the epoch's
    start, writing nothing), then `messages` rendered."""
    script = (
        "import json, sys\n"
        "from contextrender import Engine\n"
        "engine = Engine(sys.argv[1])\n"
        "e = engine.explain('s')\n"
        "r = engine.render('s', json.loads(sys.argv[2]), budget=int(sys.argv[3]))\n"
        "print(json.dumps({'explained': [e.messages, e.mode, e.mode_reason], 'messages': r.messages, 'mode': r.mode}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(store), json.dumps(messages), str(budget)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_epoch_keeps_its_lists_and_maps_as_texts_and_one_stored_before_renders_as_it_did(tmp_path):
    """The epoch stores its record's lists and maps as one JSON text (`rendered`) and its start as
    another (`started`), the fields that held them before left empty. An epoch stored before
    those texts (its record in `marker_listing`, `shown`, `condensed` and `start`, its row
    under an older fingerprint) is read from those fields: in a new process, the last render is
    explained as it was (from the start) and the next one renders what the first process would
    have rendered; that render moves them into the texts."""
    budget = 2000
    # (Prose long enough to be condensed: the record's `condensed` is not empty.)
    messages = session(24, prose=filler("prose", 150))
    reference = replay(Engine(tmp_path / "a"), messages, budget)
    turns = [j for j, m in enumerate(messages + [assistant("done")]) if m["role"] == "assistant" and j > 0]
    cut = next(k for k in range(len(reference) - 1) if reference[k].selected and reference[k + 1].mode == "append")
    engine = Engine(tmp_path / "b")
    for k in range(cut + 1):
        assert engine.render("s", messages[:turns[k]], budget=budget).messages == reference[k].messages
    explained = engine.explain("s")
    path = db_file(engine)
    engine.close()
    (key, epoch), = epoch_rows(path).items()
    record = json.loads(epoch["rendered"])
    assert set(record) == {"marker_listing", "shown", "condensed"} and record["shown"] and record["condensed"]
    assert json.loads(epoch["started"])["from"] == "render"
    assert (epoch["marker_listing"], epoch["shown"], epoch["condensed"], epoch["start"]) == ({}, [], {}, {})
    # The row as a store written before the texts holds it: no `rendered` nor `started`, the
    # class's fingerprint of then (jaclang loads it as a row of an older schema).
    with sqlite3.connect(path) as conn:
        data = json.loads(conn.execute(f"SELECT data FROM {ROWS} WHERE id = ?", (key,)).fetchone()[0])
        before = data["archetype"]
        before |= json.loads(before.pop("rendered"))
        before["start"] = json.loads(before.pop("started"))
        conn.execute(f"UPDATE {ROWS} SET data = ?, fingerprint = 'fingerprint-of-before' WHERE id = ?", (json.dumps(data), key))
    after = explained_and_rendered_in_a_new_process(tmp_path / "b", messages[:turns[cut + 1]], budget)
    assert after["explained"] == [explained.messages, explained.mode, explained.mode_reason]
    assert after["mode"] == reference[cut + 1].mode == "append"
    assert after["messages"] == reference[cut + 1].messages
    moved = epoch_rows(path)[key]
    assert json.loads(moved["rendered"])["shown"] and moved["started"]
    assert (moved["marker_listing"], moved["shown"], moved["condensed"], moved["start"]) == ({}, [], {}, {})


def test_a_fork_resets_the_epoch(engine):
    budget = 1200
    messages = session(24)
    results = replay(engine, messages, budget)
    assert results[-1].mode in ("append", "re-render")
    rewritten = messages[:31] + [assistant("a different step", call("x1", "read", {"path": "other.py"})),
                                 tool("x1", "OTHER_123 " + filler("o", 300))]
    result = engine.render("s", rewritten, budget=budget)
    assert_sound(result, budget)
    assert result.mode == "re-render" and "first selective render" in result.mode_reason


def test_hysteresis_keeps_what_the_previous_render_showed(tmp_path):
    """Three equal results, two slots: the first render shows the newer two (b, c). Then the
    oldest (a) gains a little observed reuse and a new result too large to fit (answered, so not
    the newest step's) forces a re-render. Without hysteresis the re-render swaps b for a (the paper's per-call choice);
    with stickiness it keeps its earlier choice."""
    budget = 740
    # (Without `reuse_rerender`: the used result `a` would itself ask for the re-render.)
    settings = dict(w_relevance=0.0, similarity_penalty=0.0, headroom=0.0, cache_value=0.0, prose_share=1.0,
                    reuse_rerender=False)

    def run(store: str, stickiness: float, **extra) -> list:
        engine = Engine(tmp_path / store)
        messages = [user("compare")]
        for name in ("a", "b", "c"):
            messages += [assistant(None, call(name, "read", {})), tool(name, f"{name.upper()}_VALUE_1111 " + filler(name, 140))]
        first = engine.render("s", messages, budget=budget, stickiness=stickiness, explain=True, **settings, **extra)
        assert_sound(first, budget)
        # (The model answers after it: a result of the newest step would be kept in view anyway.)
        messages += [assistant("A_VALUE_1111 it is", call("d", "dump", {})), tool("d", filler("d", 320)), assistant("ok"), user("next")]
        later = engine.render("s", messages, budget=budget, stickiness=stickiness, explain=True, **settings, **extra)
        assert_sound(later, budget)
        assert later.mode == "re-render" and "exceed the budget" in later.mode_reason
        return [{d.call_id: d.status for d in r.decisions} for r in (first, later)]

    # (`sticky_to` "shown", the default before 2026-12-06: every result the previous request showed.)
    plain, sticky = run("plain", 0.0), run("sticky", 1.0, sticky_to="shown")
    assert plain == [{"a": "omitted", "b": "kept", "c": "kept"}, {"a": "kept", "b": "omitted", "c": "kept", "d": "omitted"}]
    assert sticky == [{"a": "omitted", "b": "kept", "c": "kept"}, {"a": "omitted", "b": "kept", "c": "kept", "d": "omitted"}]
    # `sticky_to` "used": b and c were shown but never used, so nothing holds them: the paper's choice.
    assert run("used", 1.0, sticky_to="used") == plain
    with pytest.raises(Exception, match="sticky_to"):
        Engine(tmp_path / "bad").render("s", [user("x")], budget=900, sticky_to="some")


def test_hysteresis_never_displaces_the_newest_steps_result(tmp_path):
    """Three equal results, two slots: the first render shows the newer two (b, c). Then the model
    asks for a fourth (e) of the same size: the append would exceed B, so it re-renders. With
    stickiness, b and c are favoured, yet the result just asked for is kept in view first (from
    B's room beyond the cap, here none), and the hysteresis keeps one of them in the slot left."""
    budget = 740
    # (`sticky_to` "shown", the default before 2026-12-06: b and c, shown and never used, are favoured.)
    settings = dict(w_relevance=0.0, similarity_penalty=0.0, headroom=0.0, cache_value=0.0, prose_share=1.0, sticky_to="shown")
    engine = Engine(tmp_path / "sticky")
    messages = [user("compare")]
    for name in ("a", "b", "c"):
        messages += [assistant(None, call(name, "read", {})), tool(name, f"{name.upper()}_VALUE_1111 " + filler(name, 140))]
    first = engine.render("s", messages, budget=budget, stickiness=1.0, explain=True, **settings)
    assert {d.call_id: d.status for d in first.decisions} == {"a": "omitted", "b": "kept", "c": "kept"}
    messages += [assistant(None, call("e", "read", {})), tool("e", "E_VALUE_1111 " + filler("e", 140))]
    later = engine.render("s", messages, budget=budget, stickiness=1.0, explain=True, **settings)
    assert_sound(later, budget)
    assert later.mode == "re-render"
    status = {d.call_id: d.status for d in later.decisions}
    assert status["e"] == "kept" and status["a"] == "omitted"
    assert "kept in view before the selection" in next(d.reason for d in later.decisions if d.call_id == "e")
    assert sorted([status["b"], status["c"]]) == ["kept", "omitted"]
    assert not str(later.messages[-1]["content"]).startswith("[ContextRender")


@pytest.mark.parametrize("selector", ["contextrender", "cr-recency"])
@pytest.mark.parametrize("size", [210, 250])
def test_the_newest_result_beyond_the_cap_leaves_the_selection_no_room(tmp_path, selector, size):
    """A first selective render whose newest result takes more than the cap leaves (kept from B's
    room beyond it): the selection has less than nothing left and takes no older result. (It once
    reserved a negative `headroom_used` room, which handed the selection that much room and let it
    pick the newest result again at a negative cost: older results were shown past the cap and, on
    a recorded customer-service conversation at B = 1,000, past B: an internal error.)"""
    budget = 1000
    messages = [user("look up the order")]
    for i in range(12):
        messages += [assistant(None, call(f"c{i}", "get", {"id": i})), tool(f"c{i}", f"ORDER_{i}00 " + filler(f"r{i}x", 12))]
    messages += [assistant(None, call("big", "get", {"id": 99})), tool("big", "BIG_9900 " + filler("bigx", size))]
    result = Engine(tmp_path / "s").render("s", messages, budget=budget, selector=selector, explain=True)
    assert_sound(result, budget)
    assert result.mode == "re-render"
    assert {d.call_id: d.status for d in result.decisions if d.status != "omitted"} == {"big": "kept"}


def test_partial_re_render_keeps_a_prefix_of_the_previous_request(engine):
    budget = 1200
    messages = session(30)
    results = replay(engine, messages, budget, cache_value=4.0)
    partial = [(b, a) for b, a in zip(results, results[1:]) if "kept the previous history up to message" in a.mode_reason]
    assert partial
    for before, after in partial:
        assert after.mode == "re-render"
        cut = int(after.mode_reason.split("up to message #")[1].split()[0])
        # Everything the previous request showed before that message is sent again unchanged.
        first = messages[cut]
        position = next((k for k, m in enumerate(before.messages)
                         if (m.get("tool_call_id") == first.get("tool_call_id") if first["role"] == "tool" else m == first)),
                        len(before.messages))  # cut at the previous end: all of it is kept
        assert shared_prefix(before.messages, after.messages) >= position > 0


def test_prose_share_leaves_the_rest_of_the_budget_to_results(engine, tmp_path):
    budget = 2000
    messages = session(20, size=40, prose=filler("because", 60))
    wide = replay(Engine(tmp_path / "wide"), messages, budget, prose_share=1.0, policy="per-call")
    narrow = replay(engine, messages, budget, prose_share=0.3, policy="per-call")
    for result in narrow:
        if result.selected:
            prose = sum(TOK.message_tokens(m) for m in history_of(result)
                        if not (m["role"] == "tool" and m["content"].startswith("VALUE_")))
            wrappers = sum(TOK.message_tokens(m) for m in history_of(result) if m["role"] == "assistant" and not m.get("content"))
            assert prose - wrappers <= 0.3 * budget
    assert narrow[-1].kept > wide[-1].kept
    assert sum(r.kept for r in narrow) > sum(r.kept for r in wide)


def test_condensed_prose_keeps_the_values_results_introduced(engine):
    budget = 4000
    messages = [user("find the config")]
    for i in range(12):
        messages += [
            assistant(f"Reading src/app/settings_{i}.py because ORDER_{i}000 showed up. " + filler("reasoning", 80),
                      call(f"c{i}", "read", {"path": f"src/app/settings_{i}.py"})),
            tool(f"c{i}", f"src/app/settings_{i + 1}.py ORDER_{i + 1}000 " + filler("cfg", 100)),
        ]
    results = replay(engine, messages, budget, prose_share=0.5, condense=True, policy="per-call")
    condensed = [m for r in results for m in history_of(r)
                 if m["role"] == "assistant" and "the rest of this message is left out" in str(m.get("content"))]
    assert condensed
    for message in condensed:
        step = int(message["content"].split("settings_")[1].split(".py")[0])
        if step > 0:
            # Both values came from the previous result, so TFA knows them: they stay.
            assert f"src/app/settings_{step}.py" in message["content"]
            assert f"ORDER_{step}000" in message["content"]
        assert message.get("tool_calls")  # the calls themselves are untouched


@pytest.mark.parametrize("name, value", [("policy", "sometimes"), ("headroom", 1.0), ("headroom", -0.1),
                                         ("prose_share", 0.0), ("stickiness", -1.0), ("cache_value", -2.0)])
def test_bad_policy_settings_are_rejected(engine, name, value):
    from contextrender import InvalidRequest

    with pytest.raises(InvalidRequest, match=name):
        engine.render("s", [user("hi")], budget=500, **{name: value})


def test_an_append_keeps_the_latest_user_message_its_previous_request_pinned(engine):
    """A render that folded past the latest user message kept it in view after the marker; the
    requests that append to it keep it there, even once a newer user message is in the history
    (which an append shows verbatim after the previous request)."""
    budget = 1500
    messages = [user("fix the bug"), user("LATEST: now make the tests pass")]
    for i in range(12):
        messages += [assistant(f"step {i} " + filler(f"p{i}q", 40), call(f"c{i}", "run", {"command": f"t{i}"})),
                     tool(f"c{i}", f"OUT_{i} " + filler(f"o{i}z", 30))]
    first = engine.render("s", messages, budget=budget)
    assert first.folded_messages > 1 and messages[1] in first.messages, [m.get("content") for m in first.messages][:4]
    later = messages + [assistant("tests pass"), user("NEWER: and the docs?"), assistant(None, call("d", "ls", {})), tool("d", "a.md")]
    again = engine.render("s", later, budget=budget)
    assert_sound(again, budget)
    assert again.mode == "append", again.mode_reason
    assert again.messages[:len(first.messages)] == first.messages
    assert later[-3] in again.messages  # the newer user message, verbatim after the previous request


@pytest.mark.parametrize("room", ["prose", "headroom", "spill"])
def test_every_index_room_keeps_the_newest_result_within_the_budget(tmp_path, room):
    """The newest step's result may use B beyond a re-render's cap; where the fold index takes
    part of that room too (fold_index_room "headroom" or "spill"), what is left for the result is
    counted from B, not from the cap: a recorded customer-service conversation at B = 1,000 went
    over B (1,046 tokens) when it was counted from the cap."""
    from tests.conftest import load_traces

    engine = Engine(str(tmp_path / room))
    for k, trace in enumerate(load_traces("tau_bench.jsonl")[:3]):
        messages = trace["messages"]
        for j, message in enumerate(messages):
            if message["role"] == "assistant":
                result = engine.render(f"t{k}", messages[:j], budget=1000, fold_index_room=room)
                assert result.history_tokens <= 1000


def test_appends_send_verbatim_calls_as_the_re_render_cut_them(tmp_path):
    """`verbatim_call_room`: an append repeats the previous request, so a call sent whole as the
    newest step stays whole (a partial re-render keeps it so too); with `verbatim_call_newest`
    every verbatim call of a managed render is cut, new ones appended cut, and the append's tokens
    count them cut (replay checks Tok(H) against what is sent)."""
    script = lambda i: f"cat <<'EOF' > mod_{i}.py\n" + "\n".join(f"line_{i}_{k} = {k}" for k in range(30)) + "\nEOF"
    messages = [user("fix the failing test")]
    for i in range(30):
        messages += [assistant(f"step {i}", call(f"c{i}", "bash", {"command": script(i)})),
                     tool(f"c{i}", f"VALUE_{i}00 " + filler(f"r{i}x", 60))]
    whole = {m["tool_calls"][0]["id"]: m["tool_calls"][0]["function"]["arguments"] for m in messages if m.get("tool_calls")}
    for newest in (False, True):
        results = replay(Engine(tmp_path / f"store-{newest}"), messages, 3000, verbatim_call_room=48, verbatim_call_newest=newest)
        modes = [r.mode for r in results]
        assert "append" in modes and "re-render" in modes
        appended_cut = 0
        for before, after in zip(results, results[1:]):
            if after.mode == "append":
                assert after.messages[:len(before.messages)] == before.messages
            if not after.selected:
                continue
            calls = [c for m in history_of(after) if m["role"] == "assistant" and m.get("content") is not None
                     for c in m.get("tool_calls") or []]
            cut = [c for c in calls if c["function"]["arguments"] != whole[c["id"]]]
            if newest:
                assert len(cut) == len(calls), "every verbatim call is shown cut"
                appended_cut += len(cut) if after.mode == "append" else 0
            else:
                assert calls[-1]["function"]["arguments"] == whole[calls[-1]["id"]], "the newest step's call is whole"
        assert appended_cut > 0 or not newest


def test_a_result_left_out_that_the_model_uses_again_brings_a_re_render_and_room(tmp_path):
    """`reuse_rerender` and `reuse_room` (docs/restores.md, "the next round"): the first render
    leaves out the oldest result (a); the model's next message uses a value only `a` holds. Without
    `reuse_rerender` that is appended (a stays out); with it (the default since the end of
    2026-12-06) the next render re-renders instead, saying why; `reuse_room` then gives it room beyond the cap: "gain" and "fit" its own
    tokens (too few for a larger, newer result, so the paper's selection takes it); "all" all of B
    (where here newer results come first)."""
    budget = 900
    settings = dict(w_relevance=0.0, similarity_penalty=0.0, cache_value=0.0, prose_share=1.0, headroom=0.5)

    def run(store: str, **extra) -> tuple:
        engine = Engine(tmp_path / store)
        messages = [user("compare")]
        for name, size in (("a", 70), ("b", 140), ("c", 140), ("d", 140), ("e", 140), ("f", 140)):
            messages += [assistant(None, call(name, "read", {})), tool(name, f"{name.upper()}_VALUE_1111 " + filler(name, size))]
        messages += [assistant("so"), user("next")]
        first = engine.render("s", messages, budget=budget, explain=True, **settings, **extra)
        assert_sound(first, budget)
        assert {d.call_id: d.status for d in first.decisions}["a"] == "omitted"
        messages += [assistant("A_VALUE_1111 it is", call("g", "look", {})), tool("g", "small")]
        later = engine.render("s", messages, budget=budget, explain=True, **settings, **extra)
        assert_sound(later, budget)
        return later.mode, later.mode_reason, {d.call_id: d.status for d in later.decisions}

    (mode, _, status) = run("off", reuse_rerender=False, reuse_room="none")
    assert mode == "append" and status["a"] == "omitted"
    (mode, reason, status) = run("rerender", reuse_rerender=True, reuse_room="none")
    assert mode == "re-render" and reason == "result r1, left out, was used since the previous request"
    assert status["a"] == "omitted", "the re-render's cap leaves it out as before"
    # "gain" without a re-render for it: the room comes at the next re-render.
    (mode, _, status) = run("gain-alone", reuse_rerender=False)
    assert mode == "append" and status["a"] == "omitted"
    # The default since the end of 2026-12-06: both, so the next render re-renders and shows it.
    (mode, default_reason, status) = run("default")
    assert mode == "re-render" and status["a"] == "kept"
    reasons = {}
    for room in ("gain", "fit"):
        (mode, reasons[room], status) = run(room, reuse_rerender=True, reuse_room=room)
        assert mode == "re-render" and status["a"] == "kept", room
    # "gain" says so: its room is taken only when the selection shows the result with it.
    assert reasons["gain"] == reason + "; result r1, left out and used since, given its room beyond the cap"
    assert default_reason == reasons["gain"]
    assert reasons["fit"] == reason
    (mode, _, status) = run("all", reuse_rerender=True, reuse_room="all")
    assert mode == "re-render" and status["e"] == "kept"
    with pytest.raises(Exception, match="reuse_room"):
        Engine(tmp_path / "bad").render("s", [user("x")], budget=900, reuse_room="some")


def test_the_reuse_that_brings_a_re_render_is_tool_flow_analysis_own(tmp_path, monkeypatch):
    """`reused_since` reads TFA's attribution (the index's `reuse_sources`, the Reuses edges), not
    values of its own: with TFA attributing nothing, a value the model uses again from a result
    left out brings no re-render; with TFA as it is, it does (the test above)."""
    from engine.index import SessionIndex

    budget = 900
    settings = dict(w_relevance=0.0, similarity_penalty=0.0, cache_value=0.0, prose_share=1.0, headroom=0.5,
                    reuse_rerender=True, reuse_room="gain")
    messages = [user("compare")]
    for name, size in (("a", 70), ("b", 140), ("c", 140), ("d", 140), ("e", 140), ("f", 140)):
        messages += [assistant(None, call(name, "read", {})), tool(name, f"{name.upper()}_VALUE_1111 " + filler(name, size))]
    messages += [assistant("so"), user("next")]
    engine = Engine(tmp_path / "store")
    first = engine.render("s", messages, budget=budget, explain=True, **settings)
    assert {d.call_id: d.status for d in first.decisions}["a"] == "omitted"
    monkeypatch.setattr(SessionIndex, "_observe", lambda self, call_id, text: [])
    messages += [assistant("A_VALUE_1111 it is", call("g", "look", {})), tool("g", "small")]
    later = engine.render("s", messages, budget=budget, explain=True, **settings)
    assert_sound(later, budget)
    assert later.mode == "append", later.mode_reason


def test_keep_shows_first_a_result_left_out_that_the_model_used_since(tmp_path):
    """`reuse_room` "keep" (docs/restores.md, "a third round"): a result the previous request left
    out whose value the model used since is shown first at the next re-render, with its tokens
    beyond the cap; "gain" gives the same room to the paper's selection, which here spends it on
    a newer result of the same size, so the used one stays out."""
    budget = 900
    settings = dict(w_relevance=0.0, similarity_penalty=0.0, cache_value=0.0, prose_share=1.0, headroom=0.5, reuse_rerender=True)

    def run(store: str, room: str) -> tuple:
        engine = Engine(tmp_path / store)
        messages = [user("compare")]
        for name in "abcdef":
            messages += [assistant(None, call(name, "read", {})), tool(name, f"{name.upper()}_VALUE_1111 " + filler(name, 140))]
        messages += [assistant("so"), user("next")]
        first = engine.render("s", messages, budget=budget, explain=True, reuse_room=room, **settings)
        assert {d.call_id: d.status for d in first.decisions}["a"] == "omitted"
        messages += [assistant("A_VALUE_1111 it is", call("g", "look", {})), tool("g", "small")]
        later = engine.render("s", messages, budget=budget, explain=True, reuse_room=room, **settings)
        assert_sound(later, budget)
        return later.mode, later.mode_reason, {d.call_id: d.status for d in later.decisions}

    (mode, _, status) = run("gain", "gain")
    assert mode == "re-render" and status["a"] == "omitted"
    (mode, reason, status) = run("keep", "keep")
    assert mode == "re-render" and status["a"] == "kept"
    assert reason.endswith("; result r1, left out and used since, shown first with its room beyond the cap")


def test_keep_names_the_result_it_shows_first(tmp_path):
    """`reuse_room` "keep" pins the results left out and used since newest first; the render's
    reason names the first one shown (the newest), not the lowest handle."""
    budget = 900
    settings = dict(w_relevance=0.0, similarity_penalty=0.0, cache_value=0.0, prose_share=1.0, headroom=0.5,
                    reuse_rerender=True, reuse_room="keep")
    engine = Engine(tmp_path / "store")
    messages = [user("compare")]
    for name in "abcdef":
        messages += [assistant(None, call(name, "read", {})), tool(name, f"{name.upper()}_VALUE_1111 " + filler(name, 100))]
    messages += [assistant("so"), user("next")]
    first = engine.render("s", messages, budget=budget, explain=True, **settings)
    status = {d.call_id: d.status for d in first.decisions}
    assert status["a"] == status["b"] == "omitted", status
    messages += [assistant("A_VALUE_1111 and B_VALUE_1111 it is", call("g", "look", {})), tool("g", "small")]
    later = engine.render("s", messages, budget=budget, explain=True, **settings)
    assert_sound(later, budget)
    status = {d.call_id: d.status for d in later.decisions}
    assert later.mode == "re-render" and status["a"] == status["b"] == "kept", (later.mode_reason, status)
    assert later.mode_reason.endswith("; result r2, left out and used since, shown first with its room beyond the cap")


def test_headroom_far_fades_the_headroom_of_a_long_history(tmp_path):
    """With `headroom_far`, once the full history is more than that many times B a re-render
    leaves less room for the appends (a further far * B / full of the headroom): it fills more of
    B than the plain headroom lets it, and stays within the faded cap."""
    budget = 2000
    settings = dict(headroom=0.6, cache_value=0.0, stickiness=0.0)
    fuller = 0
    for far in (0.0, 1.0):
        results = replay(Engine(tmp_path / f"far{far}"), session(80), budget, headroom_far=far, **settings)
        for result in results:
            if result.mode != "re-render" or result.full_history_tokens <= budget:
                continue
            plain = 0.6 * budget / result.full_history_tokens
            share = plain * min(1.0, far * budget / result.full_history_tokens) if far else plain
            assert result.history_tokens <= budget * (1 - share) + 1
            fuller += far > 0 and result.history_tokens > budget * (1 - plain) + 1
    assert fuller > 0


def test_a_wider_re_render_keeps_its_render_s_scores(tmp_path, monkeypatch):
    """`reuse_room` "gain" selects again with a cap widened for a result left out and used since:
    that plan is laid out and selected anew but keeps the scores of the render's first selection
    (the same history and settings: the same scores), where it scored everything again before."""
    from engine.plan import RenderPlan

    scored = []
    score = RenderPlan.score
    monkeypatch.setattr(RenderPlan, "score", lambda plan, *a, **k: scored.append(1) or score(plan, *a, **k))
    engine = Engine(tmp_path / "s")
    settings = dict(w_relevance=0.0, similarity_penalty=0.0, cache_value=0.0, prose_share=1.0, headroom=0.5, reuse_rerender=True)
    messages = [user("compare")]
    for name, size in (("a", 70), ("b", 140), ("c", 140), ("d", 140), ("e", 140), ("f", 140)):
        messages += [assistant(None, call(name, "read", {})), tool(name, f"{name.upper()}_VALUE_1111 " + filler(name, size))]
    messages += [assistant("so"), user("next")]
    engine.render("s", messages, budget=900, **settings)
    messages += [assistant("A_VALUE_1111 it is", call("g", "look", {})), tool("g", "small")]
    scored.clear()
    later = engine.render("s", messages, budget=900, explain=True, **settings)
    assert_sound(later, 900)
    assert later.mode_reason.endswith("given its room beyond the cap")
    assert {d.call_id: d.status for d in later.decisions}["a"] == "kept"
    assert len(scored) == 1


def test_a_render_key_is_digested_once_per_settings(monkeypatch):
    """RenderConfig.key (the epoch's key) is a digest of every setting, asked once or more a
    render of a config made per call: the digest of settings seen before is kept, by each
    setting's type and value (2 and 2.0 are different settings, as their JSON is, and so are 0.0
    and -0.0, whichever the process saw first)."""
    import hashlib

    from engine.config import RenderConfig

    made = []
    sha256 = hashlib.sha256
    monkeypatch.setattr(hashlib, "sha256", lambda data: made.append(data) or sha256(data))
    (a, b) = (RenderConfig(stickiness=2, headroom=0.31), RenderConfig(stickiness=2.0, headroom=0.31))
    keys = [a.key(900), b.key(900), RenderConfig(stickiness=2, headroom=0.31).key(900), a.key(1200)]
    assert len(made) == 2 and keys[0] != keys[1] and keys[2] == keys[0] and keys[3] == keys[0].replace(":900:", ":1200:")
    (zero, minus_zero) = (RenderConfig(stickiness=0.0).key(900), RenderConfig(stickiness=-0.0).key(900))
    assert zero != minus_zero
    for (config, key) in ((a, keys[0]), (b, keys[1]), (RenderConfig(stickiness=-0.0), minus_zero)):
        settings = {k: v for (k, v) in vars(config).items() if k != "selector"}
        assert key.endswith(sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16])


def test_reuse_latest_gives_room_to_what_the_latest_message_used(tmp_path):
    """`reuse_latest` (docs/restores.md, "customer service at 2K"): reuse comes in runs, so a
    re-render gives the results the latest assistant message used the room `reuse_room` "gain"
    gives those used since the previous request, whether that request showed them or not. Here
    the first selective render (no previous request: nothing "used since") leaves the oldest
    result `a` out under its cap although the latest message used a value only `a` holds; with
    the setting its tokens widen the cap and the paper's selection shows it."""
    budget = 900
    settings = dict(w_relevance=0.0, similarity_penalty=0.0, cache_value=0.0, prose_share=1.0, headroom=0.5)
    messages = [user("compare")]
    for name, size in (("a", 70), ("b", 140), ("c", 140), ("d", 140), ("e", 140), ("f", 140)):
        messages += [assistant(None, call(name, "read", {})), tool(name, f"{name.upper()}_VALUE_1111 " + filler(name, size))]
    messages += [assistant("A_VALUE_1111 it is", call("g", "look", {})), tool("g", "small")]
    status = {}
    for latest in (False, True):
        result = Engine(tmp_path / f"latest{latest}").render("s", messages, budget=budget, explain=True, reuse_latest=latest, **settings)
        assert_sound(result, budget)
        assert result.mode == "re-render"
        status[latest] = ({d.call_id: d.status for d in result.decisions}, result.mode_reason)
    assert status[False][0]["a"] == "omitted"
    assert status[True][0]["a"] == "kept", status[True]
    assert status[True][1].endswith("; result r1, left out and used since, given its room beyond the cap")


def test_keep_folded_keeps_what_the_previous_request_showed_of_its_folded_turns(tmp_path):
    """`keep_folded` (docs/restores.md, "customer service at 2K, a second round"): when a
    re-render's fold moves, the cost-aware choice also weighs re-renders that keep what the
    previous request showed of its folded turns (the marker and the results under it, up to a cut)
    and select again after them. Without it, each re-render whose fold moves here evicts a result
    shown under the marker, and the provider's cache ends after the task and the marker; with it,
    such a re-render sends the previous request again up to its cut."""
    messages = session(30)

    def kept_until(before: list[dict], cut: int) -> int:
        """The previous request's messages before the first that shows an event from `cut` on, or its fold index."""
        late = {m["tool_call_id"] for m in messages[cut:] if m["role"] == "tool"}
        for k, m in enumerate(before):
            ids = {c["id"] for c in m.get("tool_calls") or []} | {m.get("tool_call_id")}
            if ids & late or (m["role"] == "user" and str(m.get("content")).startswith("Results left out")):
                return k
        return len(before)

    shared = {}
    for on in (False, True):
        results = replay(Engine(tmp_path / f"kept{on}"), messages, 1200, keep_folded=on)
        moved = [(b, a) for b, a in zip(results, results[1:]) if a.mode == "re-render" and 0 < b.folded_messages < a.folded_messages]
        assert moved
        shared[on] = [shared_prefix(b.messages, a.messages) for b, a in moved]
        kept = [(b, a) for b, a in moved if "of its folded turns up to message #" in a.mode_reason]
        if not on:
            assert not kept
            continue
        assert kept
        for before, after in kept:
            cut = int(after.mode_reason.split("of its folded turns up to message #")[1].split()[0])
            assert shared_prefix(before.messages, after.messages) >= kept_until(before.messages, cut) > 2
    # Without it the cache ends after the task and the marker at such a re-render.
    assert max(shared[False]) == 2 < max(shared[True])


def test_headroom_used_gives_part_of_the_headroom_to_results_the_model_used(tmp_path):
    """`headroom_used` (docs/restores.md, "a seventh round"): once the paper's selection has
    filled a re-render's cap, it continues into this share of the headroom among results with
    observed use only. Here the oldest result `a`, whose value a later call used, is left out
    under the cap; with the setting it is shown in the headroom, while `b`, never used and
    ranked above it, still is not (the room is the used results', not a smaller headroom)."""
    budget = 900
    settings = dict(w_relevance=0.0, similarity_penalty=0.0, cache_value=0.0, prose_share=1.0, headroom=0.5)
    messages = [user("compare")]
    messages += [assistant(None, call("a", "read", {})), tool("a", "A_VALUE_1111 " + filler("a", 140))]
    messages += [assistant(None, call("b", "read", {})), tool("b", "B_VALUE_2222 " + filler("b", 140))]
    messages += [assistant(None, call("c", "read", {"key": "A_VALUE_1111"})), tool("c", "C_VALUE_3333 " + filler("c", 140))]
    for name in ("d", "e", "f"):
        messages += [assistant(None, call(name, "read", {})), tool(name, f"{name.upper()}_VALUE_4444 " + filler(name, 140))]
    messages += [assistant("next", call("g", "look", {})), tool("g", "small")]
    status = {}
    for used in (0.0, 1.0):
        result = Engine(tmp_path / f"used{used}").render("s", messages, budget=budget, explain=True, headroom_used=used, **settings)
        assert_sound(result, budget)
        assert result.mode == "re-render"
        status[used] = {d.call_id: d.status for d in result.decisions}
    assert status[0.0]["a"] == "omitted" and status[0.0]["b"] == "omitted", status[0.0]
    assert status[1.0]["a"] == "kept", status[1.0]
    assert status[1.0]["b"] == "omitted", status[1.0]


def test_the_re_renders_that_keep_the_folded_turns_take_the_full_selection_s_layout(tmp_path, monkeypatch):
    """`keep_folded`'s re-renders start from the layout of the full selection (the same
    constraints but pinned results, which the layout does not read): the only plans laid out
    without a kept fold are those the paper's selection runs on (the full one, a wider one)."""
    import engine.stability as stability
    from engine.plan import RenderPlan

    (lay_out, select) = (RenderPlan.lay_out, stability.select)
    (laid, selected) = ([], [])
    monkeypatch.setattr(RenderPlan, "lay_out", lambda plan: laid.append(plan.constraints.kept is None) or lay_out(plan))
    monkeypatch.setattr(stability, "select", lambda plan, selector: selected.append(1) or select(plan, selector))
    results = replay(Engine(tmp_path / "s"), session(30), 1200)
    assert any("of its folded turns up to message #" in r.mode_reason for r in results)
    assert sum(laid) == len(selected)


def test_the_partial_re_renders_start_from_their_base_s_choice_found_once(tmp_path, monkeypatch):
    """A partial re-render's parts (`RenderPlan.kept_prefixes`) are the clones `clone` and
    `keep_prefix` make one cut after another, but the choice each starts from (`start_choice`:
    the newest step's results kept in view) is found once, on the plan they are cloned from,
    not on each clone, and the results before the cuts are walked once, for the latest cut
    (each shown one's U read once), not once a cut; each part's greedy selection takes its U'
    (`sticky_worth`) from its base's, found once, and selects the same."""
    import numpy as np

    import engine.plan as plan_module
    import engine.stability as stability
    from engine.plan import RenderPlan

    class Counted(np.ndarray):
        reads = 0

        def __getitem__(self, key):
            if isinstance(key, (int, np.integer)):
                Counted.reads += 1
            return super().__getitem__(key)

    (clone, start_choice, kept_up_to) = (RenderPlan.clone, RenderPlan.start_choice, stability._kept_up_to)
    (started, compared, counts, reads, worths) = ([], [], [], [], [])
    monkeypatch.setattr(RenderPlan, "start_choice", lambda plan: started.append(1) or start_choice(plan))
    sticky_worth = plan_module.sticky_worth
    monkeypatch.setattr(plan_module, "sticky_worth", lambda *a: worths.append(1) or sticky_worth(*a))

    def checked(base, before, cuts, full, price, *weighed):
        scores = base.scores
        base.scores = type(scores)(**{f: getattr(scores, f) for f in ("age", "reuse_count", "cosine", "recency", "reuse", "relevance")},
                                   usefulness=scores.usefulness.view(Counted))
        order = sorted(set(cuts), reverse=True)
        (Counted.reads, one_by_one) = (0, [])
        for cut in order:
            part = clone(base)
            prefix = part.keep_prefix(before, cut)
            if prefix >= 0:
                one_by_one.append((part, cut, prefix))
        (apart, Counted.reads) = (Counted.reads, 0)
        parts = list(base.kept_prefixes(before, order))
        reads.append((apart, Counted.reads))
        base.scores = scores
        assert [(cut, prefix) for (_, cut, prefix) in parts] == [(cut, prefix) for (_, cut, prefix) in one_by_one]
        for ((made, _, _), (expected, _, _)) in zip(parts, one_by_one):
            assert vars(made.choice) == vars(expected.choice)
            # In the same order too: a set's order follows its insertions, and the cost-aware
            # choice sums U over the results shown in it (floats).
            assert list(made.choice.chosen) == list(expected.choice.chosen)
            assert list(made.choice.picks.items()) == list(expected.choice.picks.items())
            assert vars(made.layout) == vars(expected.layout)
            # Its U' (a share of its base's, made from the earliest cut on): bit for bit its own.
            own = sticky_worth(scores.usefulness, np.asarray(made.layout.candidates, dtype=np.intp), made.sticky(), made.config.stickiness)
            assert made._arrays.worth.tobytes() == own.tobytes()
            # And every array greedy reads (views of its base's): those it would make of its own layout.
            mine = made.selectable(0)
            for name in ("worth", "rows", "costs", "wrapper", "owners"):
                (shared, own) = (getattr(made._arrays, name), getattr(mine, name))
                assert shared.dtype == own.dtype and shared.shape == own.shape and shared.tobytes() == own.tobytes(), name
            assert made.choice is not base.choice and made.layout.wrapper_cost is not base.layout.wrapper_cost
            assert vars(made.greedy(made.choice)) == vars(expected.greedy(expected.choice))
        compared.append(len(parts))
        (started[:], worths[:]) = ([], [])
        out = kept_up_to(base, before, cuts, full, price, *weighed)
        counts.append((len(started), len(worths)))
        return out

    monkeypatch.setattr(stability, "_kept_up_to", checked)
    results = replay(Engine(tmp_path / "s"), session(30), 1200)
    assert any("of its folded turns up to message #" in r.mode_reason for r in results)
    assert sum(compared) > len(compared)
    assert set(counts) == {(1, 1)}
    # Each shown result before the latest cut read once (the newest step's results kept in view
    # are read by start_choice, once a part one by one, once in all here).
    assert all(walked <= apart for (apart, walked) in reads)
    assert sum(walked for (_, walked) in reads) * 3 < sum(apart for (apart, _) in reads) * 2


def test_a_partial_re_render_of_a_layout_with_no_candidates(tmp_path, monkeypatch):
    """At a budget the newest step fills, a re-render's layout can have no candidate results; its
    partial re-renders (`RenderPlan.kept_prefixes`) then make their parts without any (an empty
    candidate list taken as a float array could not index U: IndexError)."""
    from engine.plan import RenderPlan

    kept_prefixes = RenderPlan.kept_prefixes
    empty = []
    monkeypatch.setattr(RenderPlan, "kept_prefixes",
                        lambda plan, before, cuts, admit=None: empty.append(not plan.layout.candidates and bool(cuts)) or kept_prefixes(plan, before, cuts, admit))
    (messages, engine) = (REUSING, Engine(tmp_path / "s"))
    for end in range(2, len(messages) + 1):
        result = engine.render("s", messages[:end], budget=100, usage={"input_tokens": 10 * end, "output_tokens": 3})
        assert result.history_tokens <= 100
    assert any(empty)


def test_a_clone_is_copy_copy_s_copy_with_its_containers_copied(tmp_path, monkeypatch):
    """`RenderPlan.clone` copies the plan, its layout and its choice as `copy.copy` copies them
    (the same class, every attribute in its order) with each list, dict and set copied and the
    rest shared, without going through `copy.copy` (its reduce protocol took most of a clone's
    time, and a partial re-render clones its plan a dozen times)."""
    import copy

    from engine.plan import RenderPlan

    (clone, plans) = (RenderPlan.clone, [])
    monkeypatch.setattr(RenderPlan, "clone", lambda plan, *given: plans.append(plan) or clone(plan, *given))
    replay(Engine(tmp_path / "s"), session(30), 1200)
    assert len(plans) > 10
    copies = []
    monkeypatch.setattr(copy, "copy", lambda value, made=copy.copy: copies.append(value) or made(value))
    for plan in plans[:: max(1, len(plans) // 20)]:
        made = clone(plan)
        for (original, copied) in ((plan, made), (plan.layout, made.layout), (plan.choice, made.choice)):
            assert type(copied) is type(original) and copied is not original
            assert list(vars(copied)) == list(vars(original))
            for (name, value) in vars(original).items():
                if name in ("layout", "choice"):
                    continue
                if isinstance(value, (list, dict, set)):
                    assert getattr(copied, name) == value
                    assert getattr(copied, name) is not value and type(getattr(copied, name)) is type(value)
                else:
                    assert getattr(copied, name) is value
    assert copies == []


def test_a_plan_counts_each_marker_text_once(tmp_path, monkeypatch):
    """`RenderPlan.marker_tokens` counts the marker's parts once per marker text (the string
    object the layout holds: its parts, split at each call, are new strings that a count cached
    by text hashes and compares again); a plan whose marker changes counts the new one, and
    every count is the one made afresh."""
    from engine.notices import fold_marker
    from engine.plan import RenderPlan

    (notice_tokens, lay_out, plans) = (RenderPlan.notice_tokens, RenderPlan.lay_out, [])
    monkeypatch.setattr(RenderPlan, "lay_out", lambda plan: plans.append(plan) or lay_out(plan))
    replay(Engine(tmp_path / "s"), session(30), 1200)
    counted = []
    monkeypatch.setattr(RenderPlan, "notice_tokens", lambda plan, message: counted.append(1) or notice_tokens(plan, message))
    folded = [plan for plan in plans if plan.layout.marker is not None]
    assert len(folded) > 10
    for plan in folded:
        afresh = sum(notice_tokens(plan, m) for m in plan.marker_parts())
        counted.clear()
        assert plan.marker_tokens() == afresh and plan.clone().marker_tokens() == afresh
        assert counted == []
        # Another marker (of the same text, as a new string too) is counted again.
        for text in (fold_marker(plan.budget)["content"], "".join(list(plan.layout.marker["content"]))):
            plan.layout.marker = {"role": "user", "content": text}
            assert plan.marker_tokens() == sum(notice_tokens(plan, m) for m in plan.marker_parts())
            assert counted
            counted.clear()


@pytest.mark.parametrize("settings", [{}, {"fold_index_refill": True, "headroom_used": 0.3, "reuse_room": "keep"}])
def test_a_partial_re_render_passed_over_could_not_have_been_taken(tmp_path, monkeypatch, settings):
    """The cost-aware choice makes and selects a partial re-render only when the upper bound of
    its objective (`_worth_trying`: what it shows, and the fractional knapsack of U - price * cost
    after its cut) is not below the best so far: on long sessions, with the fold index's refill
    and the headroom for used results too, every part's objective is at most its bound, some parts
    are passed over, and every render is the one made when none is."""
    import math

    import engine.stability as stability

    (worth_trying, cache_objective) = (stability._worth_trying, stability.cache_objective)
    (pending, pairs, inside) = ([], [], [False])

    def every_part(base, cuts, usefulness, price):
        bound = worth_trying(base, cuts, usefulness, price)

        def recorded(cut, prefix, choice):
            inside[0] = True
            pending.append(bound(cut, prefix, choice))
            inside[0] = False
            return math.inf
        return recorded

    def objective(usefulness, shown, resent, price):
        value = cache_objective(usefulness, shown, resent, price)
        if pending and not inside[0]:
            pairs.append((pending.pop(), value))
        return value

    def rendered(folder):
        return [(r.mode, r.mode_reason, json.dumps(r.messages, sort_keys=True)) for r in replay(Engine(folder), session(60), 1200, **settings)]

    (asked, made) = ([], [])
    monkeypatch.setattr(stability, "_worth_trying", lambda *a: (lambda bound: lambda *b: asked.append(1) or bound(*b))(worth_trying(*a)))
    from engine.plan import RenderPlan

    kept_prefixes = RenderPlan.kept_prefixes
    monkeypatch.setattr(RenderPlan, "kept_prefixes", lambda *a: (made.append(1) or part for part in kept_prefixes(*a)))
    pruned = rendered(tmp_path / "pruned")
    monkeypatch.setattr(stability, "_worth_trying", every_part)
    monkeypatch.setattr(stability, "cache_objective", objective)
    (made_all, made[:]) = (len(made), [])
    assert rendered(tmp_path / "every") == pruned
    assert len(pairs) == len(made) > made_all and len(asked) > made_all
    assert all(value <= bound for (bound, value) in pairs)
