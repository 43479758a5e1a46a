"""Tok(H) <= B and valid tool-call pairing on renders of the shared recorded traces.

A sample of traces keeps this test quick; benchmarks/replay_all.py checks every trace."""

from __future__ import annotations

import pytest

from contextrender_adapters import Engine
from contextrender_adapters.checks import pairing_problems
from engine.measure import get_tokenizer
from tests.conftest import TRACES, load_traces
from tests.test_render import history_of

TOK = get_tokenizer()
SAMPLE = {"tau_bench.jsonl": [0, 150, 296], "mini_swe_agent_deepseek.jsonl": [3], "swe_agent_demos.jsonl": [0, 11]}

pytestmark = pytest.mark.skipif(not TRACES.exists(), reason="../shared/traces is not beside the checkout")


@pytest.mark.parametrize("budget", [2000, 6000])
@pytest.mark.parametrize("omitted", ["stub", "drop"])
@pytest.mark.parametrize("name", sorted(SAMPLE))
def test_every_render_fits_and_pairs(tmp_path, name, budget, omitted):
    engine = Engine(tmp_path / "store")
    traces = load_traces(name)
    for i in SAMPLE[name]:
        trace = traces[i]
        messages = trace["messages"]
        turns = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
        for j in turns:
            result = engine.render(trace["id"], messages[:j], budget=budget, omitted=omitted)
            history = history_of(result)
            assert result.history_tokens == TOK.history_tokens(history) <= budget, (trace["id"], j)
            assert pairing_problems(result.messages) == [], (trace["id"], j)
