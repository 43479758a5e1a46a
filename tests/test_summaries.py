"""Oversized-result fallback through byLLM (A.4), with byLLM's MockLLM instead of a real model."""

from __future__ import annotations

from byllm.lib import MockLLM

import engine.summaries as compact
from tests.conftest import assistant, call, tool, user
from tests.test_render import TOK, filler


def test_oversized_result_is_compacted_by_the_configured_model(engine, monkeypatch):
    monkeypatch.setattr(compact, "compact_llm", MockLLM(model_name="mockllm", config={"outputs": ["ERR_4242 at src/app.py:17 (compacted)"]}))
    big = filler("trace", 4000)
    messages = [user("run it"), assistant(None, call("c1", "run", {})), tool("c1", big), user("why?")]
    result = engine.render("s", messages, budget=1000, explain=True)
    assert result.decisions[0].status == "compacted"
    shown = next(m for m in result.messages if m.get("tool_call_id") == "c1")
    # The model's compaction, under the line that names the handle of the complete result and
    # the size of that result (its message's tokens, as B counts them).
    assert shown["content"] == (
        f'[ContextRender: compacted from {TOK.message_tokens(messages[2])} tokens. To see it in full, call contextrender_restore with handle "r1".]\n'
        "ERR_4242 at src/app.py:17 (compacted)"
    )
    assert result.history_tokens <= 1000
    # Cached on the result node: a second render does not ask the model again (no outputs left).
    again = engine.render("s", messages, budget=1000)
    assert next(m for m in again.messages if m.get("tool_call_id") == "c1")["content"] == shown["content"]
    assert engine.render("s", messages, budget=100_000).messages[2]["content"] == big
