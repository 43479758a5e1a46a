"""The render plan's layout (engine/plan.jac, engine/impl/plan.impl.jac): the candidates of a
folded history listed from figures kept per index, the same as a walk over every result made
them, and without that walk (a stable re-render lays out twice, and the folded results grow
with the session)."""

from __future__ import annotations

from contextrender import Engine
from engine.measure import MESSAGE_OVERHEAD
from tests.conftest import assistant, call, recording_tokenizer, tool, user
from tests.test_render import assert_sound, filler


def long_session(rounds: int, big_every: int = 7) -> list[dict]:
    """Rounds of a call and its result; every `big_every`-th result larger than the budgets below
    (compacted when shown; none with 0), every third call with long arguments (cut in a folded turn)."""
    messages = [user("fix the failing test")]
    for i in range(rounds):
        arguments = {"path": f"src/mod_{i}.py"} | ({"pattern": filler(f"p{i}", 60)} if i % 3 == 0 else {})
        messages += [assistant(f"step {i}", call(f"c{i}", "read", arguments)),
                     tool(f"c{i}", f"VALUE_{i}00 " + filler(f"r{i}x", 900 if big_every and i % big_every == 0 else 50))]
    return messages


def walked(plan) -> tuple:
    """The candidates, costs, owners, wrappers and results always kept that lay_out made before
    2026-12-07 by walking every result (its loop, on the plan as laid out)."""
    (index, layout) = (plan.index, plan.layout)
    (candidates, costs, owners, wrappers, always) = ([], [], [], {}, set())
    for r in plan.results:
        event = index.result_event[r]
        full = plan.shown_tokens(r)
        folded = event < layout.fold_start
        if not folded and plan.config.omitted == "stub":
            if layout.base[event] == index.tokens[event] and r not in plan.compacted:
                always.add(r)
                continue
            (cost, owner) = (full - layout.base[event], -1)
        else:
            call_id = index.result_call[r]
            (cost, owner) = (full + plan.folded_call_tokens(call_id), index.call_event[call_id])
            if owner not in wrappers:
                wrappers[owner] = MESSAGE_OVERHEAD if folded or layout.base[owner] == 0 else 0
        candidates.append(r)
        costs.append(cost)
        owners.append(owner)
    return (candidates, costs, owners, list(wrappers.items()), always)


class Reads(list):
    """A list that counts the items read from it one by one."""

    reads = 0

    def __getitem__(self, key):
        if isinstance(key, int):
            Reads.reads += 1
        return super().__getitem__(key)


def rendered(engine: Engine, messages: list[dict], budget: int, **settings) -> set:
    """Render after each result, as an agent calls the model (each render checked): the modes."""
    modes = set()
    for j in range(2, len(messages) + 1):
        if messages[j - 1]["role"] == "tool":
            result = engine.render("s", messages[:j], budget=budget, **settings)
            assert_sound(result, budget)
            modes.add(result.mode)
    engine.close()
    return modes


def test_a_folded_layout_lists_its_candidates_as_the_walk_over_every_result_did(tmp_path, monkeypatch):
    """Every layout of a long session's stable renders (the full selections, the wider ones and
    the partial re-renders' bases; budgets under which results are compacted and calls cut, with
    stubs and with omitted results dropped) lists the same candidates, costs, owners and
    wrappers, in the same order, as the walk over every result."""
    from engine.plan import RenderPlan

    (lay_out, checked) = (RenderPlan.lay_out, [])

    def compared(plan):
        layout = lay_out(plan)
        (candidates, costs, owners, wrappers, always) = walked(plan)
        assert layout.candidates == candidates and layout.owners == owners
        assert list(layout.wrapper_cost.items()) == wrappers and layout.always_kept == always
        # keep_newest cuts the newest step's results to the room after the walk.
        assert [c for (r, c) in zip(candidates, layout.costs) if r not in layout.newest] == \
            [c for (r, c) in zip(candidates, costs) if r not in layout.newest]
        checked.append(layout.fold_start > 0 and bool(plan.compacted))
        return layout

    monkeypatch.setattr(RenderPlan, "lay_out", compared)
    for (budget, settings) in ((1500, {}), (800, {"omitted": "drop"})):
        assert "re-render" in rendered(Engine(tmp_path / f"s{budget}"), long_session(60), budget, **settings)
    assert sum(checked) > 40


def test_a_layout_of_a_long_folded_history_does_not_walk_every_result(tmp_path, monkeypatch):
    """A layout reads the results' events (`SessionIndex.result_event`) a few dozen times however
    many results are folded: lay_out took every folded result's figures one by one, and
    keep_newest walked every candidate to reach the newest step's (about two reads a result
    before 2026-12-07)."""
    from engine.plan import RenderPlan

    (lay_out, reads) = (RenderPlan.lay_out, [])

    def counted(plan):
        events = plan.index.result_event
        (plan.index.result_event, Reads.reads) = (Reads(events), 0)
        try:
            layout = lay_out(plan)
        finally:
            plan.index.result_event = events
        reads.append((layout.fold_start, len(plan.results), Reads.reads))
        return layout

    monkeypatch.setattr(RenderPlan, "lay_out", counted)
    assert "re-render" in rendered(Engine(tmp_path / "s"), long_session(150, big_every=0), 1500)
    folded = [(n, count) for (fold, n, count) in reads if fold > 0]
    assert max(n for (n, _) in folded) == 150
    assert all(count < 60 for (n, count) in folded if n >= 100)


def test_a_condensed_text_is_made_once_per_index_until_a_result_introduces_a_value_it_names(tmp_path, monkeypatch):
    """The condensed text of an old assistant message and its tokens are kept per index: the same
    history laid out again makes none again. A result that introduces a value the message names
    makes it again, listing the value, as a render of that history on a fresh index does."""
    import importlib

    plan_module = importlib.import_module("engine.plan")
    made = []
    condensed_text = plan_module.condensed_text
    monkeypatch.setattr(plan_module, "condensed_text", lambda text, index, tokenizer: made.append(text) or condensed_text(text, index, tokenizer))
    settings = {"prose_share": 0.5, "condense": True, "policy": "per-call"}
    messages = [user("find the config")]
    for i in range(12):
        messages += [assistant(f"Reading src/app/settings_{i}.py, then LATER_{i}X9 perhaps. " + filler("reasoning", 80),
                               call(f"c{i}", "read", {"path": f"src/app/settings_{i}.py"})),
                     tool(f"c{i}", f"src/app/settings_{i + 1}.py ORDER_{i + 1}000 " + filler("cfg", 100))]
    engine = Engine(tmp_path / "kept")
    first = engine.render("s", messages, budget=4000, **settings)
    condensed = [m["content"] for m in first.messages if m["role"] == "assistant" and "is left out" in str(m.get("content"))]
    assert made and condensed and not any("LATER_" in text.split("…")[1] for text in condensed)
    made[:] = []
    again = engine.render("s", messages, budget=4000, **settings)
    assert again.messages == first.messages and made == []
    # A result that introduces LATER_<i>X9 for every step: each condensed message names its own.
    later = messages + [assistant("one more", call("c99", "read", {"path": "notes"})),
                        tool("c99", " ".join(f"LATER_{i}X9" for i in range(12)) + " " + filler("note", 40)), user("and?")]
    grown = engine.render("s", later, budget=4000, **settings)
    afresh = Engine(tmp_path / "fresh").render("s", later, budget=4000, **settings)
    assert grown.messages == afresh.messages and made
    named = [m["content"] for m in grown.messages if m["role"] == "assistant" and "is left out" in str(m.get("content"))]
    assert named and all("LATER_" in text.split("…")[1] for text in named)


def test_a_long_call_s_value_is_encoded_once_for_its_cuts_at_both_rooms(monkeypatch):
    """cut_call weighs a long call's string value by its ids (engine/measure.jac `cut_ids`), and
    cut_middle cuts it from them: the value is encoded once for its cut to `verbatim_call_room`
    and its later cut to `folded_call_room` (three times before: weighed, then cut at each room),
    and each cut call is the one a fresh process makes."""
    import engine.measure as measure
    import engine.plan as plan_module
    from engine.measure import Tokenizer, get_tokenizer

    tok = get_tokenizer()
    value = "cat <<'EOF' > src/app.py\n" + "\n".join(f"def handler_{i}(x):\n    return x * {i}" for i in range(200)) + "\nEOF"
    long_call = call("c1", "bash", {"command": value, "timeout": "30"})
    (counted, encoded) = recording_tokenizer(tok)
    cuts = [plan_module.cut_call(long_call, room, counted) for room in (64, 48)]
    assert encoded.count(value) == 1
    monkeypatch.setattr(measure, "_cuts", {})
    monkeypatch.setattr(measure, "_cut_ids", {})
    fresh = Tokenizer(encoding=tok.encoding, scale=tok.scale, _enc=tok._enc)
    assert cuts == [plan_module.cut_call(long_call, room, fresh) for room in (64, 48)]
    assert cuts[0] != cuts[1] and all(tok.call_tokens(c) < tok.call_tokens(long_call) for c in cuts)
