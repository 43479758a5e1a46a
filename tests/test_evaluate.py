"""Replay measurements (evaluation/evaluate.py): B.4 event labelling on hand-made transcripts whose
events are known, visibility, the simulated prefix cache, and equation 3 on worked examples."""

from __future__ import annotations

import pytest

from contextrender_eval.evaluate import (
    PrefixCache,
    Prices,
    ReuseEvent,
    Usage,
    VariantStats,
    age_bin,
    cost_cached,
    cost_eq3,
    cost_summary,
    call_arguments,
    named_handles,
    named_with_call,
    percentile,
    result_handles,
    reuse_events,
    visible_results,
)
from contextrender.core import get_tokenizer
from tests.conftest import assistant, call, tool, user

TOK = get_tokenizer()


def test_events_link_tokens_first_seen_in_a_result_once_per_turn_and_result():
    messages = [
        {"role": "system", "content": "policy mentions POLICY_ID_77"},
        user("my user id is user_42x"),                                              # 1
        assistant(None, call("a", "get_user", {"id": "user_42x"})),                   # 2 (turn 1)
        tool("a", '{"order": "ORD_1001", "zip": "AB12CD", "city": "Berlin", "note": "abc123"}'),  # 3
        assistant("Order ORD_1001 ships from Berlin to AB12CD; user_42x; POLICY_ID_77"),  # 4 (turn 2)
        assistant(None, call("b", "get_order", {"order": "ORD_1001"})),               # 5 (turn 3)
        tool("b", "status SHIPPED_OK for ORD_1001"),                                  # 6
        assistant("SHIPPED_OK and again ORD_1001"),                                   # 7 (turn 4)
    ]
    events = reuse_events(messages)
    assert events == [
        # One event for result 3 at turn 4 though three of its tokens (ORD_1001, Berlin, AB12CD)
        # appear; user_42x (user message) and POLICY_ID_77 (system) are not results' tokens, and
        # "abc123" has no uppercase letter or underscore.
        ReuseEvent(turn=4, result=3, call_id="a", age=1),
        ReuseEvent(turn=5, result=3, call_id="a", age=2),
        # ORD_1001 is also in result 6, but it was first seen in result 3; SHIPPED_OK is 6's.
        ReuseEvent(turn=7, result=3, call_id="a", age=3),
        ReuseEvent(turn=7, result=6, call_id="b", age=1),
    ]


def test_tokens_first_written_by_the_assistant_are_not_linked_to_a_later_result():
    messages = [
        user("go"),
        assistant("I will look for CONFIG_KEY_9"),
        assistant(None, call("a", "grep", {"q": "CONFIG_KEY_9"})),
        tool("a", "CONFIG_KEY_9 = 3 in settings_local.py"),
        assistant("settings_local has CONFIG_KEY_9"),
    ]
    assert reuse_events(messages) == [ReuseEvent(turn=4, result=3, call_id="a", age=1)]  # settings_local only


def test_short_or_unmarked_tokens_are_not_eligible():
    messages = [user("q"), assistant(None, call("a", "t", {})), tool("a", "Ab_1 lowercase12 ABCDE"), assistant("Ab_1 lowercase12 ABCDE")]
    assert reuse_events(messages) == []


def test_age_bins_follow_table_2():
    assert [age_bin(a) for a in (1, 3, 4, 10, 11, 25, 26, 90)] == ["<=3", "<=3", "4-10", "4-10", "11-25", "11-25", ">25", ">25"]


def test_only_the_complete_original_text_is_visible():
    originals = {"a": "RESULT_A full", "b": "RESULT_B full", "c": "RESULT_C"}
    rendered = [
        tool("a", "RESULT_A full"),
        tool("b", "[ContextRender: this tool result ... is omitted]"),
        tool("c", "RESULT_C\n[... 10 tokens cut by ContextRender ...]"),
        user("summary mentions RESULT_B full"),
    ]
    assert visible_results(rendered, originals) == {"a"}


def test_a_handle_counts_as_named_only_in_text_contextrender_wrote():
    originals = {"a": "result a mentions r9", "b": "result b"}
    texts = {"user asks about r8", "agent"}
    rendered = [
        {"role": "system", "content": "agent"},
        user("[ContextRender: the oldest messages ... left out]\nr3 bash: ls src/r4.py\nbash results: r1 r2"),
        user("user asks about r8"),                     # recorded text: names nothing
        tool("a", "result a mentions r9"),              # the recorded result
        tool("b", 'this result is omitted. call contextrender_restore with handle "r5".'),
    ]
    # r4 is part of a file name, not a handle.
    assert named_handles(rendered, originals, texts) == {"r1", "r2", "r3", "r5"}


def test_named_with_its_call_is_a_stub_in_place_or_a_handle_followed_by_a_word_of_its_arguments():
    messages = [
        user("q"),
        assistant(None, call("a", "bash", {"command": "cat src/alpha.py"})), tool("a", "ALPHA"),
        assistant(None, call("b", "bash", {"command": "cat src/beta.py"})), tool("b", "BETA"),
        assistant(None, call("c", "bash", {"command": "pytest tests/test_gamma.py"})), tool("c", "GAMMA"),
        assistant(None, call("d", "bash", {"command": "ls docs"})), tool("d", "DELTA"),
    ]
    originals = {m["tool_call_id"]: m["content"] for m in messages if m["role"] == "tool"}
    texts = {"q"}
    handles = {"a": "r1", "b": "r2", "c": "r3", "d": "r4"}
    calls = call_arguments(messages)
    assert calls["a"] == "cat src/alpha.py"
    rendered = [
        # r1 is followed by its own file; r2 only by r3's words (the entry after it is r3's);
        # r3 by its test file; r4 is a stub in its own place.
        user("[ContextRender: ... left out]\nbash results: r2 r1 (src/alpha.py) r3 (pytest tests/test_gamma.py)"),
        messages[7],
        tool("d", 'this bash result is omitted. call contextrender_restore with handle "r4".'),
    ]
    assert named_handles(rendered, originals, texts) == {"r1", "r2", "r3", "r4"}
    assert named_with_call(rendered, originals, texts, calls, handles) == {"a", "c", "d"}


def test_results_are_numbered_in_ingestion_order_once_per_call():
    messages = [user("q"), assistant(None, call("x", "f", {})), tool("x", "1"), tool("x", "1 again"),
                assistant(None, call("y", "f", {})), tool("y", "2")]
    assert result_handles(messages) == {"x": "r1", "y": "r2"}


def test_prefix_cache_counts_leading_messages_identical_to_the_previous_request():
    cache = PrefixCache(TOK)
    system = {"role": "system", "content": "sys prompt " * 50}
    first = [system, user("hello there")]
    second = first + [assistant("hi"), user("next")]
    third = [system, user("a summary replaced the history"), user("next")]
    size = [TOK.message_tokens(m) for m in second]
    assert cache.request(first) == (size[0] + size[1], 0)
    assert cache.request(second) == (sum(size), size[0] + size[1])
    assert cache.request(third) == (TOK.history_tokens(third), size[0])


def test_equation_3_worked_example():
    usage = Usage(input=1_000_000, cached=600_000, output=100_000, embedding=1_000_000)
    # ([2 (1 - 0.5) + 0.5 * 0.5] * 1M + 8 * 0.1M + 0.13 * 1M) / 1e6 = 1.25 + 0.8 + 0.13
    assert cost_eq3(usage, 0.5) == pytest.approx(2.18)
    assert cost_eq3(usage, 0.0) == pytest.approx(2.0 + 0.8 + 0.13)
    # Own cache: 0.4M uncached at 2, 0.6M cached at 0.5.
    assert cost_cached(usage) == pytest.approx(0.8 + 0.3 + 0.8 + 0.13)
    assert cost_eq3(usage, 0.5, Prices(input=4.0, cached_input=1.0, output=0.0, embedding=0.0)) == pytest.approx(2.5)


def test_cost_ratios_use_full_histories_cache_rate_on_tasks_that_needed_management():
    full = VariantStats("full", 1000)
    lean = VariantStats("prune", 1000)
    full.usage = {"t1": Usage(input=1_000_000, cached=500_000), "t2": Usage(input=10, cached=0)}
    lean.usage = {"t1": Usage(input=400_000, cached=0), "t2": Usage(input=10, cached=0)}
    for stats in (full, lean):
        stats.needs_management = {"t1": True, "t2": False}
    costs = cost_summary({"full": full, "prune": lean}, full)
    # Only t1 counts (C.1); rho = 0.5 from full; eq. 3 prices input at 1.25 for both methods.
    assert costs["prune"]["tasks"] == 1 and costs["prune"]["rho_full"] == pytest.approx(0.5)
    assert costs["prune"]["ratio_eq3"] == pytest.approx(0.4)
    assert costs["full"]["ratio_eq3"] == pytest.approx(1.0)
    # With its own (empty) cache prune pays 2 per token: 0.8 against full's 1.25.
    assert costs["prune"]["ratio_cached"] == pytest.approx(0.8 / 1.25)


def test_recall_and_percentiles():
    stats = VariantStats("x", 100)
    stats.events["<=3"], stats.hits["<=3"] = 4, 3
    stats.events[">25"], stats.hits[">25"] = 1, 0
    assert stats.recall() == pytest.approx(60.0) and stats.recall("<=3") == pytest.approx(75.0)
    assert stats.recall("4-10") != stats.recall("4-10")  # no events: NaN, not 0
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 50) == 3.0 and percentile([1.0, 2.0], 95) == 2.0
