"""Tok(H) <= B and valid tool-call pairing on renders of recorded traces: every trace of the tests'
fixture (tests/fixtures/traces: three tau runs, two SWE-agent demonstrations, one mini-SWE run).

A few traces keep this test quick; `contextrender replay` and `contextrender sweep` replay the full
sets (../shared/traces beside a development checkout)."""

from __future__ import annotations

import pytest

from contextrender import Engine
from contextrender.testing.checks import pairing_problems
from engine.measure import get_tokenizer
from tests.conftest import TRACES, load_traces
from tests.test_render import history_of

TOK = get_tokenizer()
FILES = sorted(p.name for p in TRACES.glob("*.jsonl"))


def test_the_fixture_holds_the_three_trace_sets():
    assert FILES == ["mini_swe_agent_deepseek.jsonl", "swe_agent_demos.jsonl", "tau_bench.jsonl"]


@pytest.mark.parametrize("budget", [2000, 6000])
@pytest.mark.parametrize("omitted", ["stub", "drop"])
@pytest.mark.parametrize("name", FILES)
def test_every_render_fits_and_pairs(tmp_path, name, budget, omitted):
    engine = Engine(tmp_path / "store")
    for trace in load_traces(name):
        messages = trace["messages"]
        turns = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
        for j in turns:
            result = engine.render(trace["id"], messages[:j], budget=budget, omitted=omitted)
            history = history_of(result)
            assert result.history_tokens == TOK.history_tokens(history) <= budget, (trace["id"], j)
            assert pairing_problems(result.messages) == [], (trace["id"], j)
