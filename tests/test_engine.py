"""The in-process engine: what a call acknowledged survives a crash (kill -9)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from contextrender import Engine, InvalidRequest, core

WRITER = textwrap.dedent(
    """
    import json, os, signal, sys
    from contextrender import Engine
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


def _turns(tag: str, rounds: int) -> list[list[dict]]:
    """The message list an agent sends at each of `rounds` tool rounds."""
    messages = [{"role": "system", "content": "You are a test agent."}, {"role": "user", "content": f"task {tag}"}]
    lists = []
    for n in range(rounds):
        call_id = f"{tag}-c{n}"
        messages = messages + [
            {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "step", "arguments": json.dumps({"n": n})}}]},
            {"role": "tool", "tool_call_id": call_id, "content": f"VALUE_{tag}_{n:04d} " * 40},
        ]
        lists.append(messages)
    return lists


def test_threads_on_different_sessions_all_succeed_with_nothing_lost(engine):
    from concurrent.futures import ThreadPoolExecutor

    rounds = 6

    def agent(tag: str) -> int:
        for messages in _turns(tag, rounds):
            result = engine.render(tag, messages, budget=400)
            assert result.messages[-1] == messages[-1] or result.selected
        return engine.get_session(tag)["events"]

    tags = [f"t{n}" for n in range(8)]
    with ThreadPoolExecutor(len(tags)) as pool:
        events = list(pool.map(agent, tags))
    assert events == [1 + 2 * rounds] * len(tags)
    # Every write reached the store: a new engine (another process's view) sees it all.
    fresh = Engine(engine.store)
    for tag in tags:
        assert fresh.get_session(tag, include_messages=True)["messages"] == _turns(tag, rounds)[-1]
    assert sorted(s["session_id"] for s in fresh.list_sessions()) == sorted(tags)
    assert len(engine._locks) == 0  # the lock table holds only sessions with calls in flight


def test_calls_on_one_session_take_turns_and_other_sessions_do_not_wait(engine, monkeypatch):
    import threading
    import time

    engine.ingest("a", [{"role": "user", "content": "a"}])
    engine.ingest("b", [{"role": "user", "content": "b"}])
    inside: dict[str, int] = {"a": 0, "b": 0}
    most: dict[str, int] = {"a": 0, "b": 0}
    both = threading.Event()
    counters = threading.Lock()  # the test's own counters, updated from several threads
    real = engine._attempt

    def attempt(walker):
        session = walker.session_id
        with counters:
            inside[session] += 1
            most[session] = max(most[session], inside[session])
            if inside["a"] and inside["b"]:
                both.set()
        time.sleep(0.2)
        try:
            return real(walker)
        finally:
            with counters:
                inside[session] -= 1

    monkeypatch.setattr(engine, "_attempt", attempt)
    threads = [threading.Thread(target=engine.get_session, args=(s,)) for s in ("a", "a", "a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most == {"a": 1, "b": 1}  # never two calls inside one session at once
    assert both.is_set()  # while "a" was busy, "b" ran


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


def test_a_render_adds_the_usage_report_it_carries_and_a_bad_one_changes_nothing(engine):
    """The proxy stores an answer's usage with the next request's render (the answer re-sent)."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    engine.render("r", messages, budget=1000, usage={"input_tokens": 90, "output_tokens": 5, "estimated_input_tokens": 110})
    engine.render("r", messages, budget=1000)
    info = engine.get_session("r")
    assert (info["events"], info["usage"]["requests"], info["usage"]["input_tokens"], info["usage"]["output_tokens"]) == (2, 1, 90, 5)
    for bad in ({"input_tokens": -1}, {"prompt_tokens": 3}, ["input_tokens"]):
        with pytest.raises(InvalidRequest, match="usage"):
            engine.render("r", messages + [{"role": "user", "content": "more"}], budget=1000, usage=bad)
    after = engine.get_session("r")
    assert after["usage"]["requests"] == 1 and after["events"] == 2


def _reading(task: str = "fix the bug in src/") -> list[dict]:
    return [
        {"role": "user", "content": task},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.py"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "def f(): return 1  # ORDER_123456"},
    ]


def test_a_caller_decorating_what_it_was_given_changes_nothing_of_its_own_or_stored(engine):
    messages = _reading()
    result = engine.render("s", messages, budget=2000)
    # As an Anthropic caller marks a cache breakpoint on what it sends, turn after turn.
    for message in result.messages:
        message["cache_control"] = {"type": "ephemeral"}
        (message.get("tool_calls") or [{}])[0]["decorated"] = True
    engine.get_session("s", include_messages=True)["messages"][0]["content"] = "changed"
    assert messages == _reading()  # the caller's own history is its own
    later = messages + [{"role": "assistant", "content": "ORDER_123456 fixed"}, {"role": "user", "content": "thanks"}]
    again = engine.render("s", later, budget=2000)
    assert again.messages == later  # no breakpoint left behind, nothing seen as a rewrite
    assert engine.get_session("s")["events"] == 5 and engine.get_session("s")["branch"] == 0


def test_a_caller_decorating_its_render_leaves_the_next_renders_cache_share_as_it_was(engine):
    # The session keeps its last render to count what the next request shares with it (the
    # render log's cached tokens): what the caller got is a copy, not that render's messages.
    messages = _reading()
    given = engine.render("s", messages, budget=2000, explain=True)
    for message in given.messages:
        message["cache_control"] = {"type": "ephemeral"}
    given.decisions.clear()
    shown = engine.explain("s")
    assert shown.decisions and not any("cache_control" in message for message in shown.messages)
    engine.render("s", messages + [{"role": "assistant", "content": "done"}, {"role": "user", "content": "next"}], budget=2000)
    (first, second) = engine.inspect("s")["renders"]
    assert second["mode"] == "passthrough" and second["cached_tokens"] >= first["history_tokens"] > 0


def _renders_share_messages(engine, promised: bool) -> int:
    """How many messages two renders of one history hand the caller as the same objects, with or
    without its promise never to change a message (engine/messages.jac SENT_UNCHANGED)."""
    token = core.SENT_UNCHANGED.set(promised)
    try:
        first = engine.render("s", _reading(), budget=2000)
        again = engine.render("s", _reading(), budget=2000)
    finally:
        core.SENT_UNCHANGED.reset(token)
    assert first.messages == again.messages and first.messages is not again.messages
    return sum(a is b for (a, b) in zip(first.messages, again.messages))


def test_a_caller_that_promises_never_to_change_a_message_is_given_the_index_s_own(engine, tmp_path):
    # Promised (the proxy): a render's messages are the index's own, not copied (adapters/local.py
    # `_unshared`); the list is the caller's. Not promised: copies, as a decorating caller needs.
    assert _renders_share_messages(engine, True) == len(_reading())
    assert _renders_share_messages(Engine(tmp_path / "other"), False) == 0


def test_a_message_the_caller_rewrites_in_place_is_a_rewrite(engine, tmp_path):
    messages = _reading()
    engine.render("s", messages, budget=2000)
    messages[0]["content"] = "a different task"  # the same dict, sent again
    result = engine.render("s", messages, budget=2000)
    assert result.messages[0]["content"] == "a different task"
    # What this Engine now holds is what a fresh one reads from the store: the rewrite forked it.
    assert engine.get_session("s")["branch"] == 1
    fresh = Engine(engine.store)
    assert fresh.get_session("s", include_messages=True)["messages"] == messages


class _Counted(dict):
    """A message that counts how often it is compared by value (`==`): a list comparison asks
    `is` first, so a message compared with itself is never counted."""

    compared = 0

    def __eq__(self, other):
        _Counted.compared += 1
        return dict.__eq__(self, other)

    __hash__ = None


def _history_compared(engine, promised: bool) -> int:
    """How many messages the second call of a growing history compares by value, with or
    without the caller's promise never to change what it sent (engine/messages.jac SENT_UNCHANGED)."""
    messages = [_Counted(message) for message in _reading()]
    more = messages + [_Counted(role="assistant", content="done"), _Counted(role="user", content="next")]
    token = core.SENT_UNCHANGED.set(promised)
    try:
        engine.render("s", messages, budget=2000)
        _Counted.compared = 0
        engine.render("s", more, budget=2000)
    finally:
        core.SENT_UNCHANGED.reset(token)
    assert engine.get_session("s")["branch"] == 0 and engine.get_session("s")["events"] == len(more)
    return _Counted.compared


def test_a_caller_that_promises_never_to_change_a_message_has_its_history_compared_by_identity(engine, tmp_path):
    # Promised: the index keeps the caller's own messages, and the resent history meets the same
    # objects (none compared by value). Not promised: copies, each resent message compared by value.
    assert _history_compared(engine, True) == 0
    assert _history_compared(Engine(tmp_path / "other"), False) >= len(_reading())
