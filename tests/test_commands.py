"""The command line: `contextrender replay` and `contextrender sweep` (evaluation/commands.py)
with settings refused with what to fix, the sweep's report, figures and raw results, and a replay
of recorded traces (the tests' fixture) end to end; `contextrender --help`, and what `proxy` and
`serve` refuse at start (adapters/start_checks.py) before they load anything slow."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

import engine.summaries as compact
from contextrender.cli import main
from contextrender_eval.replay import load_traces
from contextrender.testing.loopback import free_port
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
    code = main(["proxy", "--upstream", "http://127.0.0.1:9/v1", "--port", str(free_port()), *flags])
    assert code == 2
    err = capsys.readouterr().err
    assert said in err
    # One line naming the flag (it said "... (--budget / --selector)" for either).
    assert err.count("\n") == 1 and "(--budget / --selector)" not in err
    assert err.startswith(f"contextrender proxy: error: {flags[-2]}: ")


def test_replay_refuses_a_bad_budget(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(hand_trace()) + "\n")
    assert main(["replay", str(path), "--budget", "10", "--selector", "prune", "--no-progress"]) == 2
    assert "budget must be" in capsys.readouterr().err


def test_the_proxy_refuses_a_bad_client_timeout_at_start(monkeypatch, capsys):
    monkeypatch.setenv("CONTEXTRENDER_TIMEOUT", "-1")
    code = main(["proxy", "--upstream", "http://127.0.0.1:9/v1", "--port", str(free_port()), "--budget", "6000",
                 "--server", "http://127.0.0.1:9", "--token", "t"])
    assert code == 2
    assert "CONTEXTRENDER_TIMEOUT must be a positive number of seconds (got '-1')" in capsys.readouterr().err


def _command(argv: list[str], cwd) -> tuple[int, str, bool]:
    """`contextrender ARGV` in a new process: its exit status, its stderr, and whether it had
    imported jaclang (the slow part of any start) by the time it returned."""
    program = ("import sys; from contextrender.cli import main; code = main(sys.argv[1:]); "
               "print(code, 'jaclang' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", program, *argv], cwd=cwd, capture_output=True, text=True, timeout=120)
    (code, loaded) = done.stdout.split()
    return int(code), done.stderr, loaded == "True"


def test_help_loads_no_engine(tmp_path):
    # The replay's parser imported the evaluation harness, and with it jaclang: 15 s for a first --help.
    program = "import sys; from contextrender.cli import build_parser; build_parser(); print('jaclang' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr


def test_every_proxy_flag_has_help_and_the_port_a_default():
    from contextrender.cli import build_parser
    from contextrender.proxy.defaults import DEFAULT_PORT

    proxy = build_parser()._subparsers._group_actions[0].choices["proxy"]
    flags = [a for a in proxy._actions if a.option_strings and a.dest != "help"]
    assert [a.dest for a in flags if not a.help] == []
    args = proxy.parse_args(["--upstream", "http://127.0.0.1:9/v1", "--budget", "600"])
    assert args.port == DEFAULT_PORT and args.log_level == "info"


def _not_a_folder(tmp_path):
    """A store path that cannot be made (its parent is a file): unwritable even for root."""
    (tmp_path / "a-file").write_text("")
    return str(tmp_path / "a-file" / "store")


@pytest.mark.parametrize("command", ["proxy", "serve"])
def test_a_taken_port_stops_the_command_with_one_line(command, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        flags = ["--upstream", "http://127.0.0.1:9/v1", "--budget", "600"] if command == "proxy" else []
        (code, err, loaded) = _command([command, *flags, "--port", str(port), "--store", str(tmp_path / "s")], tmp_path)
    # serve moved to the next free port (the docs' curls then reached another server); the proxy
    # said it listened on the port, then failed with [Errno 98].
    assert code == 2 and not loaded
    assert err == f"contextrender {command}: error: port {port} on 127.0.0.1 is in use: choose another with --port N (or stop what listens there)\n"


@pytest.mark.parametrize("command", ["proxy", "serve"])
def test_an_unwritable_store_stops_the_command_with_one_line(command, tmp_path):
    flags = ["--upstream", "http://127.0.0.1:9/v1", "--budget", "600"] if command == "proxy" else []
    (code, err, loaded) = _command([command, *flags, "--port", str(free_port()), "--store", _not_a_folder(tmp_path)], tmp_path)
    # It was a 26-line PermissionError traceback, after the engine had loaded.
    assert code == 2 and not loaded
    assert err.count("\n") == 1 and "the store folder" in err and "cannot be written" in err and "--store" in err


@pytest.mark.parametrize("upstream", ["not-a-url", "ftp://example.com/v1", "http://", "http://host:port/v1"])
def test_a_malformed_upstream_stops_the_proxy_with_one_line(upstream, tmp_path):
    (code, err, loaded) = _command(["proxy", "--upstream", upstream, "--budget", "600", "--port", str(free_port()),
                                    "--store", str(tmp_path / "s")], tmp_path)
    assert code == 2 and not loaded
    assert err == (f"contextrender proxy: error: --upstream must be an http:// or https:// URL such as "
                   f"https://api.openai.com/v1 (got {upstream!r})\n")


def test_replay_counts_one_trace_as_one(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(hand_trace()) + "\n")
    assert main(["replay", str(path), "--budget", "300", "--selector", "prune", "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith(f"1 trace from {path};")


def test_serve_relays_jac_starts_lines_without_its_banner_and_notes_a_moved_port(capsys):
    """jac-scale moves to the next free port when the asked one is taken between serve's check and
    its bind: serve notes it (and stops the server, exit 2); its own banner replaces jac start's."""
    from contextrender.server import serve

    class Child:
        stdout = iter(["  Port 8000 is in use, using port 8001 instead\n", "INFO - Admin portal is disabled\n",
                       "INFO - Ops self-check endpoint registered: /admin/ops/health\n", "  🚀 Server ready (no client)\n",
                       "WARNING - something the operator should see\n"])

    moved = []
    serve._relay(Child(), False, moved)
    err = capsys.readouterr().err
    assert moved == ["8000"]
    assert err == "WARNING - something the operator should see\n"


def test_load_traces_parts_split_each_file_in_two_halves(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"id": f"t{k}", "messages": []}) + "\n" for k in range(5)))
    ids = lambda part, limit=0: [t["id"] for t in load_traces([path], limit, part)]
    assert ids("train") == ["t0", "t2", "t4"]
    assert ids("held-out") == ["t1", "t3"]
    assert ids("all") == [f"t{k}" for k in range(5)]
    assert ids("held-out", 1) == ["t1"]                  # the limit counts within the part
    assert sorted(ids("train") + ids("held-out")) == ids("all")
    with pytest.raises(ValueError, match="held-out"):
        load_traces([path], 0, "test")


def test_the_proxy_on_the_engine_keeps_python_s_young_threshold(tmp_path):
    """The proxy serves agents side by side: its Engine's higher young threshold (fewer young
    collections) lengthened their waits, so the command gives Python's back (engine/courtesy.jac)."""
    import argparse
    import gc

    from contextrender.proxy.command import _backend

    before = gc.get_threshold()
    gc.set_threshold(700, *before[1:])
    try:
        engine = _backend(argparse.Namespace(server=None, store=tmp_path / "store"))
        assert gc.get_threshold()[0] == 700
        engine.close()
    finally:
        gc.set_threshold(*before)
