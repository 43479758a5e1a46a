"""Selectors (engine/selector.jac, one file each in engine/selectors/): the registry that finds them
(engine/registry.jac), shared budget accounting and validity, the B.2 baselines' orderings, and the
summary selectors (byLLM typed slots, or the labelled stand-in)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from byllm.lib import MockLLM

import engine.summaries as compact
from contextrender import InvalidRequest, RenderConfig
from contextrender.testing.checks import pairing_problems
from engine.measure import get_tokenizer
from tests.conftest import assistant, call, in_new_process, tool, user
from tests.test_render import PAPER, filler
from engine.registry import SELECTORS, find_selectors, render_settings, selector_modules

TOK = get_tokenizer()
ALL = ["full", "prune", "semantic", "recency-summary", "compact", "cr-recency", "cr-relevance", "cr-recency-relevance", "contextrender"]


def rendered_history(result, messages) -> list[dict]:
    """Rendered history: minus the system prompt and the current (trailing) user message."""
    system = len([m for m in messages if m["role"] in ("system", "developer")])
    current = 1 if messages[-1]["role"] == "user" else 0
    return result.messages[system:len(result.messages) - current]


def session(turns: int = 10, size: int = 150) -> list[dict]:
    messages = [{"role": "system", "content": "you are an agent"}, user("fix the parser in src/parse.py")]
    for i in range(turns):
        messages += [assistant(f"step {i}", call(f"c{i}", "read", {"path": f"src/mod{i}.py"})),
                     tool(f"c{i}", f"VALUE_{i}000 " + filler(f"t{i}x", size))]
    return messages + [user("continue")]


def test_the_registry_is_what_render_settings_accept():
    assert sorted(SELECTORS) == sorted(ALL)
    for name in SELECTORS:
        assert render_settings({"selector": name, "summariser": "offline"}).selector == name
    with pytest.raises(InvalidRequest, match="unknown selector 'lru'"):
        render_settings({"selector": "lru"})
    # B.3: the ablations keep their terms at full weight and zero the others.
    ablated = SELECTORS["cr-recency-relevance"]
    assert ablated.weights(render_settings({"selector": "cr-recency-relevance"})) == (1.0, 0.0, 1.0)
    assert SELECTORS["contextrender"].weights(RenderConfig.build({"w_reuse": 2.0})) == (1.0, 2.0, 1.0)


def test_the_registry_is_the_files_of_engine_selectors():
    # Each file declares its own selectors; the registry lists none of its own.
    folder = Path(__file__).resolve().parent.parent / "engine" / "selectors"
    files = sorted(p.stem for p in folder.glob("*.jac") if p.is_file())
    assert [m.rsplit(".", 1)[1] for m in selector_modules()] == files
    declared = {}
    for stem in files:
        module = importlib.import_module(f"engine.selectors.{stem}")
        declared.update({s.name: s for s in module.SELECTORS})
    assert declared == SELECTORS
    registry = (folder.parent / "registry.jac").read_text()
    assert not [name for name in ALL if f'"{name}"' in registry]
    # A name declared twice is refused when the registry is built.
    with pytest.raises(ValueError, match="'prune' is declared twice"):
        find_selectors(["engine.selectors.prune", "engine.selectors.prune"])


# A selector written outside the package, as a user (or a new file in engine/selectors/) would.
THROWAWAY = '''"""The oldest complete results that fit (a selector the registry finds by its module)."""

import from engine.plan { RenderPlan }
import from engine.render_values { Choice }
import from engine.selector { Selector, newest_first, by_age }

obj OldestFirst(Selector) {
    def select(plan: RenderPlan) -> Choice {
        choice = plan.start_choice();
        ages = by_age(plan);
        plan.take(choice, list(reversed(newest_first(plan))), choice.remaining, [-a for a in ages]);
        return choice;
    }
}

glob SELECTORS: list[Selector] = [OldestFirst(name="oldest-first", description="oldest complete results that fit")];
'''


def test_a_new_selector_is_one_file_selectable_by_name(tmp_path):
    (tmp_path / "oldest_first_selector.jac").write_text(THROWAWAY)
    script = (
        "import sys, json; from contextrender import Engine; "
        "from contextrender.core import SELECTORS, render_settings; from tests.test_selectors import session; "
        "assert render_settings({'selector': 'oldest-first'}).selector == 'oldest-first'; "
        "e = Engine(sys.argv[1]); "
        "runs = {s: e.render(s, session(), budget=2500, selector=s, omitted='drop', explain=True) for s in ('oldest-first', 'prune')}; "
        "print(json.dumps({s: sorted(d.call_id for d in r.decisions if d.status == 'kept') for s, r in runs.items()}))"
    )
    env = dict(os.environ, CONTEXTRENDER_SELECTORS="oldest_first_selector",
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "store")], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    kept = json.loads(done.stdout.strip().splitlines()[-1])
    # It chose as it says: the oldest results, where prune keeps the newest.
    assert kept["oldest-first"] and "c0" in kept["oldest-first"] and "c9" not in kept["oldest-first"]
    assert "c9" in kept["prune"] and "c0" not in kept["prune"]
    # Without the module named, the name is unknown.
    with pytest.raises(InvalidRequest, match="unknown selector 'oldest-first'"):
        render_settings({"selector": "oldest-first"})


@pytest.mark.parametrize("omitted", ["stub", "drop"])
@pytest.mark.parametrize("selector", ALL)
def test_every_selector_fits_the_budget_and_pairs_calls(engine, selector, omitted):
    messages = session()
    budget = 900
    for end in range(4, len(messages) + 1, 2):
        part = messages[:end]
        result = engine.render("s", part, budget=budget, selector=selector, omitted=omitted, summariser="offline")
        history = rendered_history(result, part)
        assert result.history_tokens == TOK.history_tokens(history), (selector, end)
        if selector != "full":
            assert result.history_tokens <= budget, (selector, end)
        assert pairing_problems(result.messages) == [], (selector, end)
    assert result.selected == (selector != "full")


def test_full_passes_everything_through_even_above_the_budget(engine):
    messages = session()
    result = engine.render("s", messages, budget=300, selector="full")
    assert result.messages == messages and not result.selected
    assert result.history_tokens > 300


def kept(result) -> set[str]:
    return {d.call_id for d in result.decisions if d.status == "kept"}


def test_prune_keeps_the_newest_results_that_fit_and_skips_one_that_does_not(engine):
    messages = [user("go")]
    sizes = [40, 40, 40, 100, 40]  # the 100-word result is smaller than B: not compacted
    for i, n in enumerate(sizes):
        messages += [assistant(None, call(f"c{i}", "t", {})), tool(f"c{i}", filler(f"p{i}q", n))]
    messages.append(user("next"))
    # Exactly the room for the newest small results (each with its call), not for the big one.
    pair = {i: TOK.message_tokens(messages[1 + 2 * i]) + TOK.message_tokens(messages[2 + 2 * i]) for i in range(5)}
    budget = TOK.message_tokens(messages[0]) + pair[4] + pair[2] + pair[1] + 2
    result = engine.render("s", messages, budget=budget, selector="prune", omitted="drop", explain=True, **PAPER)
    assert kept(result) == {"c4", "c2", "c1"}
    picks = sorted((d.pick, d.call_id) for d in result.decisions if d.pick >= 0)
    assert [h for _, h in picks] == ["c4", "c2", "c1"]  # newest first; c3 skipped, not a stop


def test_semantic_takes_recent_turns_first_then_the_closest_older_result(engine):
    messages = [user("start")]
    messages += [assistant(None, call("old_fruit", "search", {})), tool("old_fruit", "apple banana cherry orchard harvest fruit " * 12)]
    messages += [assistant(None, call("old_space", "search", {})), tool("old_space", "galaxy nebula quasar telescope orbit star " * 12)]
    for i in range(3):
        messages += [assistant(None, call(f"r{i}", "noop", {})), tool(f"r{i}", filler(f"n{i}m", 30))]
    messages.append(user("which apple banana cherry fruit was in the orchard harvest?"))
    cost = TOK.message_tokens(messages[2])
    base = sum(TOK.message_tokens(m) for m in messages[:-1] if m["role"] != "tool")
    recent = sum(TOK.message_tokens(m) for m in messages[6:12] if m["role"] == "tool")
    budget = base + recent + cost + 20
    # The whole recent quota (recent_share=1) so that all three recent results come first.
    result = engine.render("s", messages, budget=budget, selector="semantic", omitted="drop", recent_share=1.0, explain=True, **PAPER)
    assert kept(result) == {"r0", "r1", "r2", "old_fruit"}
    picks = [h for _, h in sorted((d.pick, d.call_id) for d in result.decisions if d.pick >= 0)]
    assert picks == ["r2", "r1", "r0", "old_fruit"]


def test_semantic_recent_results_use_at_most_their_share_of_the_budget(engine):
    messages = [user("start")]
    messages += [assistant(None, call("old", "search", {})), tool("old", "apple banana cherry orchard harvest fruit " * 15)]
    for i in range(3):
        messages += [assistant(None, call(f"r{i}", "noop", {})), tool(f"r{i}", filler(f"n{i}m", 25))]
    messages.append(user("which apple banana cherry fruit was in the orchard harvest?"))
    pair = {i: TOK.message_tokens(messages[i]) + TOK.message_tokens(messages[i + 1]) for i in (1, 3, 5, 7)}
    base = TOK.message_tokens(messages[0])
    # Room for two recent results and one more (r0 or the older relevant one), not both.
    budget = base + pair[5] + pair[7] + max(pair[1], pair[3]) + 2
    quota = (pair[5] + pair[7] + 1) / budget  # r2 and r1 fit the recent quota, r0 does not
    tight = engine.render("s", messages, budget=budget, selector="semantic", omitted="drop", recent_share=quota, explain=True, **PAPER)
    assert kept(tight) == {"r2", "r1", "old"}
    assert sum(d.cost for d in tight.decisions if d.pick in (0, 1)) <= quota * budget
    loose = engine.render("s", messages, budget=budget, selector="semantic", omitted="drop", recent_share=1.0, explain=True, **PAPER)
    assert kept(loose) == {"r2", "r1", "r0"}


def test_summary_selectors_refuse_without_a_model(engine, monkeypatch):
    monkeypatch.setattr(compact, "compact_llm", None)
    for selector in ("recency-summary", "compact"):
        with pytest.raises(InvalidRequest, match="CONTEXTRENDER_MODEL"):
            engine.render("s", session(), budget=600, selector=selector)


@pytest.mark.parametrize("selector", ["recency-summary", "compact"])
def test_the_offline_stand_in_says_what_it_is(engine, selector):
    messages = session()
    result = engine.render("s", messages, budget=1500, selector=selector, summariser="offline")
    summary = next(m for m in result.messages if "summary of earlier history" in str(m.get("content")))
    assert "NOT an LLM" in summary["content"] and "offline extractive stand-in" in summary["content"]
    assert result.summariser == "offline" and result.summary_tokens == TOK.message_tokens(summary)
    assert summary["content"].index("Files read:") < summary["content"].index("Unresolved questions:")


# The budgets at which each summary selector renders a summary of this session (below them the
# summary's label alone does not fit beside what the selector keeps, and it renders none).
SUMMARISED_AT = {"recency-summary": (200, 300), "compact": (120, 200, 300)}


@pytest.mark.parametrize("selector", sorted(SUMMARISED_AT))
def test_the_stand_in_label_survives_small_budgets(engine, selector):
    messages = session()
    for budget in (64, 80, 120, 200, 300):
        result = engine.render(f"s{budget}", messages, budget=budget, selector=selector, summariser="offline")
        summaries = [m for m in result.messages if "summary of earlier history" in str(m.get("content"))]
        if budget in SUMMARISED_AT[selector]:
            assert len(summaries) == 1, (budget, result.messages)
        assert all("NOT an LLM" in m["content"] for m in summaries), budget
        assert result.history_tokens <= budget and not any(m.get("content") == "" for m in result.messages)


def slots(tag: str) -> "model_calls.HistorySummary":
    import engine.model_calls as model_calls

    return model_calls.HistorySummary(
        files_read=["src/parse.py"], key_observations=[f"{tag}: VALUE_1000 seen"], commands_run=["read src/mod1.py"],
        decisions=["fix the parser"], unresolved_questions=["why does VALUE_2000 fail?"],
    )


def test_compact_summarises_with_the_model_once_and_keeps_it_on_the_graph(engine, monkeypatch):
    mock = MockLLM(model_name="mockllm", config={"outputs": [slots("first"), slots("second")]})
    monkeypatch.setattr(compact, "compact_llm", mock)
    messages = session()
    budget = 700
    first = engine.render("s", messages, budget=budget, selector="compact")
    history = rendered_history(first, messages)
    assert len(history) == 1 and "first: VALUE_1000 seen" in history[0]["content"]
    for slot in ("Files read:", "Key observations:", "Commands run:", "Decisions:", "Unresolved questions:"):
        assert slot in history[0]["content"]
    assert first.summary_calls == 1 and first.summariser == "llm" and first.history_tokens <= budget
    # A re-render reuses the stored summary: no model call.
    again = engine.render("s", messages, budget=budget, selector="compact")
    assert again.summary_calls == 0 and rendered_history(again, messages) == history
    assert len(mock.seen_prompts) == 1
    # New turns follow the summary verbatim while they fit ...
    grown = messages + [assistant("step 10", call("c10", "read", {})), tool("c10", "short"), user("more")]
    later = engine.render("s", grown, budget=budget, selector="compact")
    assert later.summary_calls == 0 and [m.get("tool_call_id") for m in rendered_history(later, grown)][-1] == "c10"
    assert pairing_problems(later.messages) == []
    # ... and when they no longer fit, the earlier summary is merged into a new one.
    grown = grown + [assistant("step 11", call("c11", "read", {})), tool("c11", filler("big", 300)), user("and more")]
    merged = engine.render("s", grown, budget=budget, selector="compact")
    assert merged.summary_calls == 1 and "second: VALUE_1000 seen" in rendered_history(merged, grown)[0]["content"]
    assert "first: VALUE_1000 seen" in mock.seen_prompts[1]  # the earlier summary was in the prompt


def test_recency_summary_keeps_recent_results_and_merges_its_earlier_summary(engine, monkeypatch):
    mock = MockLLM(model_name="mockllm", config={"outputs": [slots("first"), slots("second")]})
    monkeypatch.setattr(compact, "compact_llm", mock)
    messages = session(size=60)
    budget = 2000
    result = engine.render("s", messages, budget=budget, selector="recency-summary", explain=True)
    assert result.summary_calls == 1 and result.history_tokens <= budget
    shown = {d.call_id for d in result.decisions if d.status == "kept"}
    assert "c9" in shown and "c0" not in shown  # recent kept, older summarised
    assert all("summarised" in d.reason for d in result.decisions if d.status == "omitted")
    assert engine.render("s", messages, budget=budget, selector="recency-summary").summary_calls == 0
    grown = messages + [assistant("step 10", call("c10", "read", {})), tool("c10", filler("new", 150)), user("more")]
    later = engine.render("s", grown, budget=budget, selector="recency-summary")
    assert later.summary_calls == 1 and pairing_problems(later.messages) == []
    assert "first: VALUE_1000 seen" in mock.seen_prompts[1]


def test_explain_says_which_results_compact_summarised(engine):
    result = engine.render("s", session(), budget=700, selector="compact", summariser="offline", explain=True)
    assert {d.status for d in result.decisions} == {"omitted"}
    assert all(d.reason == "summarised (compact), not shown in full" for d in result.decisions)
    # Turns after the summary are shown verbatim, and explain says so.
    grown = session() + [assistant("step 10", call("c10", "read", {})), tool("c10", "short"), user("more")]
    later = engine.render("s", grown, budget=700, selector="compact", summariser="offline", explain=True)
    after = [d for d in later.decisions if d.call_id == "c10"]
    assert [d.status for d in after] == ["kept"] and "shown verbatim" in after[0].reason


def test_renders_with_different_settings_keep_their_own_summaries(engine):
    messages = session()
    variants = [{"selector": "compact", "budget": 3000, "summariser": "offline", "summary_share": share} for share in (0.3, 0.05)]
    engine.ingest("s", messages)
    (large, small) = engine.render_variants("s", variants)
    alone = engine.render("other", messages, budget=3000, selector="compact", summariser="offline", summary_share=0.05)
    assert small.summary_tokens == alone.summary_tokens < large.summary_tokens


def test_summaries_stored_before_they_moved_to_graph_still_load(tmp_path):
    """SummaryNote and Summarised were declared in walkers.selectors; stores name them so."""
    import sqlite3

    from contextrender import Engine

    messages = session()
    Engine(tmp_path).render("s", messages, budget=700, selector="compact", summariser="offline")
    with sqlite3.connect(next((tmp_path / ".jac" / "data").glob("*.db"))) as db:
        # As the old layout wrote them: the old module (in the row and in its archetype data) and
        # another schema fingerprint.
        # (Counted by reading the rows back: SQLite counts no row that the view's trigger changes.)
        for kind in ("SummaryNote", "Summarised"):
            db.execute(
                "UPDATE anchors SET arch_module = 'walkers.selectors', fingerprint = 'before-the-move', "
                "data = replace(data, ?, ?) WHERE arch_type = ?",
                (f'"__type__": "{kind}", "__module__": "graph.context"', f'"__type__": "{kind}", "__module__": "walkers.selectors"', kind),
            )
            moved = db.execute("SELECT count(*) FROM anchors WHERE arch_type = ? AND arch_module = 'walkers.selectors'"
                               " AND instr(data, '\"__module__\": \"walkers.selectors\"') > 0", (kind,)).fetchone()[0]
            assert moved == 1
    # A new process, as after an upgrade: it finds the stored summary and can delete the session.
    script = (
        "import sys, json; from contextrender import Engine; from tests.test_selectors import session; "
        "e = Engine(sys.argv[1]); "
        "r = e.render('s', session(), budget=700, selector='compact', summariser='offline'); "
        "print(json.dumps([r.summary_calls, e.delete_session('s')['deleted']]))"
    )
    assert in_new_process(script, tmp_path) == [0, True]
