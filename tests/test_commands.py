"""`contextrender replay` and `contextrender sweep` (evaluation/commands.py) through the command
line: settings refused with what to fix, the sweep's report, figures and raw results, and a replay
of recorded traces (the tests' fixture) end to end."""

from __future__ import annotations

import json

import pytest

import engine.summaries as compact
from contextrender.cli import main
from contextrender_eval.replay import load_traces
from tests.conftest import TRACES
from tests.test_replay import hand_trace, row


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


def test_replay_of_recorded_traces_end_to_end(capsys):
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


def test_replay_names_the_flag_for_an_offline_summariser(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(compact, "compact_llm", None)
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(hand_trace()) + "\n")
    assert main(["replay", str(path), "--budget", "300", "--selector", "compact", "--no-progress"]) == 2
    assert "--summariser offline" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "said"), [
    (["--budget", "10"], "budget must be an integer number of tokens >= 64"),
    (["--budget", "6000", "--selector", "contextrendr"], "contextrendr"),
])
def test_the_proxy_refuses_a_bad_setting_at_start_with_the_engines_message(flags, said, capsys):
    # Before this check the proxy started and forwarded every request unmanaged.
    code = main(["proxy", "--upstream", "http://127.0.0.1:9/v1", "--port", "1", *flags])
    assert code == 2
    assert said in capsys.readouterr().err


def test_replay_refuses_a_bad_budget(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(hand_trace()) + "\n")
    assert main(["replay", str(path), "--budget", "10", "--selector", "prune", "--no-progress"]) == 2
    assert "budget must be" in capsys.readouterr().err


def test_the_proxy_refuses_a_bad_client_timeout_at_start(monkeypatch, capsys):
    monkeypatch.setenv("CONTEXTRENDER_TIMEOUT", "-1")
    code = main(["proxy", "--upstream", "http://127.0.0.1:9/v1", "--port", "1", "--budget", "6000",
                 "--server", "http://127.0.0.1:9", "--token", "t"])
    assert code == 2
    assert "CONTEXTRENDER_TIMEOUT must be a positive number of seconds (got '-1')" in capsys.readouterr().err
