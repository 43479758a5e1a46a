"""The in-process engine: what a call acknowledged survives a crash (kill -9)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from contextrender_adapters import Engine, InvalidRequest

WRITER = textwrap.dedent(
    """
    import json, os, signal, sys
    from contextrender_adapters import Engine
    engine = Engine(sys.argv[1])
    engine.ingest("s", json.loads(sys.argv[2]))
    engine.ingest("s", [{"role": "assistant", "content": "KEY_123456 found"}], append=True)
    print("acknowledged", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_acknowledged_events_survive_kill_9(tmp_path):
    messages = [
        {"role": "user", "content": "find the key"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "find", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "KEY_123456"},
    ]
    store = tmp_path / "store"
    done = subprocess.run([sys.executable, "-c", WRITER, str(store), json.dumps(messages)], capture_output=True, text=True)
    assert done.returncode == -9 and "acknowledged" in done.stdout
    engine = Engine(store)
    result = engine.render("s", budget=1000, explain=True)
    assert result.messages[:3] == messages and result.messages[3]["content"] == "KEY_123456 found"
    assert [d.reuse_count for d in result.decisions] == [1.0]


def test_a_failed_call_stores_nothing(engine):
    engine.ingest("s", [{"role": "user", "content": "first"}])
    new = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ORDER_123456 noted"}]
    with pytest.raises(InvalidRequest, match="budget"):
        engine.render("s", new, budget=10)  # ingests, then the render refuses the budget
    assert engine.get_session("s", include_messages=True)["messages"] == new[:1]


def test_usage_reports_add_up_and_a_bad_one_changes_nothing(engine):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    engine.ingest("u", messages, usage={"input_tokens": 90, "cache_read_input_tokens": 10, "output_tokens": 5, "estimated_input_tokens": 110})
    engine.ingest("u", [], append=True, usage={"input_tokens": 100, "estimated_input_tokens": 90})
    usage = engine.get_session("u")["usage"]
    assert usage == {"input_tokens": 190, "cache_read_input_tokens": 10, "output_tokens": 5, "estimated_input_tokens": 200,
                     "requests": 2, "reported_input_tokens": 200, "estimate_ratio": 1.0}
    for bad in ({"input_tokens": -1}, {"input_tokens": 1.5}, {"input_tokens": True}, {"prompt_tokens": 3}, ["input_tokens"]):
        with pytest.raises(InvalidRequest, match="usage"):
            engine.ingest("u", messages + [{"role": "user", "content": "more"}], usage=bad)
    after = engine.get_session("u")
    assert after["usage"]["requests"] == 2 and after["events"] == 2
