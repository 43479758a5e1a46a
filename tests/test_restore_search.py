"""Searches (walkers/restore.jac `search_results`): the restore tool's `query` form finds the
handles of stored results by what a model remembers of them, and writes nothing."""

from __future__ import annotations

import pytest

from contextrender import Engine, InvalidRequest, UnknownSession
from tests.conftest import assistant, call, tool, user
from tests.test_restore import graph_state


def history() -> list[dict]:
    """Six results; the one of c3 alone holds the value `E_QUOTA_7731`, and c1's call alone reads
    `src/billing/ledger.py`."""
    messages = [{"role": "system", "content": "You are a coding agent."}, user("Fix the billing bug.")]
    outputs = [
        ("bash", {"command": "ls src"}, "billing\nauth\nutil\n"),
        ("read_file", {"path": "src/billing/ledger.py"}, "class Ledger:\n    def post(self, entry):\n        return entry\n"),
        ("bash", {"command": "pytest -q"}, "3 passed, 1 failed\nFAILED tests/test_ledger.py::test_post\n"),
        ("bash", {"command": "grep -rn quota src"}, "src/auth/limits.py:12: raise QuotaError('E_QUOTA_7731 over the monthly quota')\n"),
        ("read_file", {"path": "src/auth/limits.py"}, "import os\n\nclass QuotaError(Exception):\n    pass\n"),
        ("bash", {"command": "git status"}, "On branch main\nnothing to commit\n"),
    ]
    for (i, (name, arguments, output)) in enumerate(outputs):
        messages += [assistant(None, call(f"c{i}", name, arguments)), tool(f"c{i}", output)]
    return messages + [assistant("Looking further."), user("Where did the quota error come from?")]


def test_a_value_from_one_result_finds_its_handle_first_and_nothing_is_written(engine: Engine):
    engine.ingest("s", history())
    before = graph_state(engine, "s")
    found = engine.search_results("s", "E_QUOTA_7731")
    assert [m["handle"] for m in found["matches"]] == ["r4"]  # the grep output holds it, nothing else does
    match = found["matches"][0]
    assert match["tool_name"] == "bash" and match["arguments"] == "grep -rn quota src"
    assert "E_QUOTA_7731" in match["preview"] and "\n" not in match["preview"]
    assert 'r4 bash (grep -rn quota src): ' in found["text"] and "contextrender_restore" in found["text"]
    # Words of the call's arguments count too, and rarer words weigh more: the ledger file's read first.
    ranked = [m["handle"] for m in engine.search_results("s", "ledger.py post")["matches"]]
    assert ranked[0] == "r2" and set(ranked) == {"r2", "r3"}
    assert len(engine.search_results("s", "src", limit=2)["matches"]) == 2
    # A search is not a restore: no Restored edge, no count, the same graph.
    assert graph_state(engine, "s") == before and engine.get_session("s")["restores"] == 0
    # The handle form works as before.
    assert "E_QUOTA_7731" in engine.restore("s", "r4").message["content"]


def test_no_match_and_bad_queries(engine: Engine):
    engine.ingest("s", history())
    nothing = engine.search_results("s", "kubernetes")
    assert nothing["matches"] == [] and "no stored result matches" in nothing["text"]
    for bad in ("", "  ", "a ?"):
        with pytest.raises(InvalidRequest, match="query must name"):
            engine.search_results("s", bad)
    with pytest.raises(UnknownSession):
        engine.search_results("nobody", "quota")


def test_a_value_goes_to_the_result_it_came_from_and_a_named_call_is_not_drowned(engine: Engine):
    """A value a later result repeats (a test run printing the id a grep found) is found first in
    the result it came from (Tool-Flow Analysis' attribution; newer results no longer win the tie),
    but not in a result whose own call passed it. A model's long question that names a call among
    many other words finds that call's result first."""
    messages = [user("Why does the invoice fail?")]
    outputs = [
        ("grep", {"pattern": "load_invoice"}, "ledger.py:4: INV_90412 = load_invoice()\n"),
        ("bash", {"command": "cat notes.txt"}, "the invoice ledger post total amount is checked twice\n" * 3),
        ("bash", {"command": "pytest -q tests/test_invoice.py"}, "FAILED test_total: INV_90412 total mismatch\n"),
        ("read_file", {"path": "src/INV_90412.json"}, "{\"id\": \"INV_90412\", \"total\": 12}\n"),
        ("bash", {"command": "git log -3"}, "commit 1 invoice ledger total fix\n"),
    ]
    for (i, (name, arguments, output)) in enumerate(outputs):
        messages += [assistant(None, call(f"c{i}", name, arguments)), tool(f"c{i}", output)]
    engine.ingest("v", messages)
    ranked = [m["handle"] for m in engine.search_results("v", "INV_90412")["matches"]]
    assert ranked[0] == "r1" and set(ranked) == {"r1", "r3", "r4"}  # r4's call passed the value: not its source
    question = ("I need the output of pytest -q tests/test_invoice.py again: the invoice ledger total is "
                "checked twice and the post amount may be wrong, see the notes and the git log")
    assert engine.search_results("v", question)["matches"][0]["handle"] == "r3"
