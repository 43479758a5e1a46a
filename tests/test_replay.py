"""`contextrender replay` / `sweep` (adapters/replay.py): turn-by-turn replay through the engine,
recall against known events, token accounting, cost reference, the CLI and the sweep's outputs."""

from __future__ import annotations

import json

import pytest

import engine.summaries as compact
from contextrender_adapters.cli import main
from contextrender_adapters.replay import Replayer, load_traces, summarise
from engine.measure import get_tokenizer
from tests.conftest import TRACES, assistant, call, tool, user
from tests.test_render import filler

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


def test_replay_refuses_summary_selectors_without_a_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(compact, "compact_llm", None)
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(hand_trace()) + "\n")
    assert main(["replay", str(path), "--budget", "300", "--selector", "compact", "--no-progress"]) == 2
    assert "CONTEXTRENDER_MODEL" in capsys.readouterr().err


def test_sweep_writes_a_report_and_figures(tmp_path, capsys):
    path = tmp_path / "tiny_tau.jsonl"
    path.write_text("".join(json.dumps(hand_trace(f"h{i}")) + "\n" for i in range(2)))
    out = tmp_path / "results"
    code = main(["sweep", str(path), "--tau-budgets", "200,5000", "--selector", "prune,contextrender,compact",
                 "--summariser", "offline", "--out", str(out), "--no-progress"])
    assert code == 0
    report = (out / "report.md").read_text()
    assert "## tiny_tau" in report and "| contextrender | 200 |" in report and "offline extractive stand-in" in report
    for png in ("recall_vs_budget.png", "recall_vs_cost.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    raw = json.loads((out / "raw" / "tiny_tau.json").read_text())
    assert raw["traces"] == 2 and {s["selector"] for s in raw["stats"]} == {"full", "prune", "contextrender", "compact"}


@pytest.mark.skipif(not TRACES.exists(), reason="../shared/traces is not beside the checkout")
def test_replay_of_shared_traces_end_to_end(capsys):
    tau, demos = str(TRACES / "tau_bench.jsonl"), str(TRACES / "swe_agent_demos.jsonl")
    code = main(["replay", tau, demos, "--limit", "1", "--budget", "1000,3000",
                 "--selector", "prune,semantic,recency-summary,contextrender", "--summariser", "offline", "--json", "--no-progress"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["traces"] == 2
    rows = data["rows"]
    assert {r["selector"] for r in rows} == {"full", "prune", "semantic", "recency-summary", "contextrender"}
    events = {r["events"] for r in rows}
    assert len(events) == 1 and events.pop() > 0          # one event set for every selector
    for r in rows:
        if r["selector"] == "full":
            assert r["recall"] == 100.0
        else:
            assert r["history_max"] <= r["budget"] and 0.0 <= r["recall"] <= 100.0
    assert row(rows, "prune", 1000)["recall"] <= row(rows, "prune", 3000)["recall"]
    traces = load_traces([tau, demos], limit=1)
    assert [t["dataset"] for t in traces] == ["tau_bench", "swe_agent_demos"]


def test_a_result_kept_in_full_by_a_managed_render_counts_as_visible(tmp_path):
    # The last turn reuses the newest result: prune keeps it at a budget that holds one result
    # (so the render is managed), and cannot at one that holds none.
    trace = hand_trace()
    trace["messages"][-1] = assistant("the order is KEY_2_ID")
    stats = Replayer([("prune", 700), ("prune", 200)], store=tmp_path / "r", progress=False).run([trace])
    rows = summarise(stats)
    assert row(rows, "prune", 700)["managed_share"] > 0 and row(rows, "prune", 700)["recall"] == 100.0
    assert row(rows, "prune", 200)["recall"] == 0.0
