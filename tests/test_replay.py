"""The replay (evaluation/replay.py): turn-by-turn replay through the engine, recall against
known events, token accounting and the cost reference."""

from __future__ import annotations

import pytest

from contextrender.core import get_tokenizer
from contextrender_eval.replay import Replayer, summarise
from tests.conftest import assistant, call, tool, user
from tests.test_render import PAPER, filler

TOK = get_tokenizer()


def hand_trace(trace_id: str = "h1") -> dict:
    """Three results of ~400 tokens; the last turn reuses the first result's id (age 3)."""
    messages = [{"role": "system", "content": "agent"}, user("find the order")]
    for i, name in enumerate(("lookup", "weather", "news")):
        messages += [assistant(None, call(f"c{i}", name, {})), tool(f"c{i}", f"KEY_{i}_ID " + filler(f"w{i}z", 100))]
    messages.append(assistant("the order is KEY_0_ID"))
    return {"id": trace_id, "messages": messages, "dataset": "hand"}


def row(rows: list[dict], selector: str, budget: int) -> dict:
    return next(r for r in rows if r["selector"] == selector and r["budget"] == budget)


def test_replay_measures_recall_tokens_and_cost_on_a_hand_made_trace(tmp_path):
    trace = hand_trace()
    selectors = ["full", "prune", "contextrender", "semantic"]
    budgets = [200, 5000]
    stats = Replayer([(s, b) for b in budgets for s in selectors], store=tmp_path / "r", progress=False).run([trace])
    rows = summarise(stats)
    for r in rows:
        # One event: the last turn repeats KEY_0_ID (the calls have no arguments).
        assert r["events"] == 1 and r["events_by_age"]["<=3"] == 1
    # Everything fits 5,000 tokens: every selector shows every result.
    assert all(row(rows, s, 5000)["recall"] == 100.0 for s in selectors)
    assert row(rows, "full", 5000)["managed_share"] == 0.0
    # No ~400-token result fits 200 tokens (each is compacted, which B.4 does not count).
    assert row(rows, "full", 200)["recall"] == 100.0
    for s in ("prune", "contextrender", "semantic"):
        assert row(rows, s, 200)["recall"] == 0.0 and row(rows, s, 200)["history_max"] <= 200
    # Input tokens of `full` are the whole prefix before each assistant turn, recounted here.
    turns = [j for j, m in enumerate(trace["messages"]) if m["role"] == "assistant"]
    expected = [TOK.history_tokens(trace["messages"][:j]) for j in turns]
    full = row(rows, "full", 200)
    assert full["input_mean"] == pytest.approx(sum(expected) / len(expected)) and full["input_max"] == max(expected)
    assert full["ratio_eq3"] == pytest.approx(1.0) and row(rows, "prune", 200)["ratio_eq3"] < 1.0
    # The last input of `full` extends the one before: all but the new messages were cached.
    usage = stats[("full", 200)].usage["hand/h1"]
    assert usage.input == sum(expected)
    assert usage.cached == sum(expected[:-1])
    assert usage.output == sum(TOK.message_tokens(trace["messages"][j]) for j in turns)


def test_a_result_kept_in_full_by_a_managed_render_counts_as_visible(tmp_path):
    # The last turn reuses the newest result: prune keeps it at a budget that holds one result
    # (so the render is managed), and cannot at one that holds none.
    trace = hand_trace()
    trace["messages"][-1] = assistant("the order is KEY_2_ID")
    stats = Replayer([("prune", 700), ("prune", 200)], store=tmp_path / "r", progress=False).run([trace])
    rows = summarise(stats)
    assert row(rows, "prune", 700)["managed_share"] > 0 and row(rows, "prune", 700)["recall"] == 100.0
    assert row(rows, "prune", 200)["recall"] == 0.0


def folding_trace() -> dict:
    """Long prose between six ~200-token results: a small budget folds the oldest turns; the last
    turn reuses the first result's id."""
    messages = [{"role": "system", "content": "agent"}, user("find the order")]
    for i in range(6):
        messages += [assistant(f"step {i} " + filler(f"p{i}q", 150), call(f"c{i}", "lookup", {"key": f"k{i}"})),
                     tool(f"c{i}", f"KEY_{i}_ID " + filler(f"w{i}z", 50))]
    messages.append(assistant("the order is KEY_0_ID"))
    return {"id": "f1", "messages": messages, "dataset": "hand"}


def test_an_event_whose_result_a_stub_names_is_one_restore_away(tmp_path):
    # At B = 700 one ~400-token result fits: the first result is left out under a stub naming
    # its handle (the paper's layout and per-call selection: nothing is folded, the newest is shown).
    stats = Replayer([("contextrender", 700)], settings=PAPER, store=tmp_path / "r", progress=False).run([hand_trace()])
    r = row(summarise(stats), "contextrender", 700)
    assert r["recall"] == 0.0 and r["named"] == 1 and r["reachable"] == 100.0
    assert r["restores"] == 0 and r["recall_after_restores"] != r["recall_after_restores"]  # NaN: no oracle


def test_a_folded_result_is_unreachable_without_the_fold_index_and_named_with_it(tmp_path):
    budget = 1500
    variants = [("contextrender", budget)]
    # The headroom before 2026-12-06's second round: at 0.45 the reused result fits in view here.
    old = {"headroom": 0.55, "keep_folded": False}
    without = Replayer(variants, settings={"fold_index_share": 0.0, **old}, store=tmp_path / "a", progress=False).run([folding_trace()])
    r = row(summarise(without), "contextrender", budget)
    assert r["recall"] == 0.0 and r["reachable"] == 0.0
    with_index = Replayer(variants, settings=old, store=tmp_path / "b", progress=False).run([folding_trace()])
    r = row(summarise(with_index), "contextrender", budget)
    assert r["recall"] == 0.0 and r["named"] == 1 and r["reachable"] == 100.0
    assert r["history_max"] <= budget


def test_the_oracle_restores_what_a_reuse_needs_and_pays_for_the_round(tmp_path):
    variants = [("full", 700), ("contextrender", 700)]
    plain = Replayer(variants, settings=PAPER, store=tmp_path / "a", progress=False).run([hand_trace()])
    oracle = Replayer(variants, settings=PAPER, store=tmp_path / "b", progress=False, oracle=True).run([hand_trace()])
    r = row(summarise(oracle), "contextrender", 700)
    assert r["recall"] == 0.0 and r["recall_after_restores"] == 100.0
    assert r["restores"] == 1 and r["restore_rounds"] == 1
    # The round: the restore call is output, the request sent again with it is input (all of the
    # rendered request cached, the round itself not).
    before, after = plain[variants[1]].usage["hand/h1"], oracle[variants[1]].usage["hand/h1"]
    restored = TOK.message_tokens(hand_trace()["messages"][3])
    assert after.output > before.output
    assert after.cached > before.cached
    assert (after.input - after.cached) - (before.input - before.cached) >= restored
    assert row(summarise(oracle), "full", 700)["restores"] == 0
