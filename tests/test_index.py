"""Tool-Flow Analysis on the session index (paper 3.2, A.2): attribution, counting, 1/n."""

import numpy as np
import pytest

from contextrender import local as engine  # noqa: F401
from engine.index import SessionIndex
from tests.conftest import assistant, call, tool, user


def build(messages: list[dict]) -> tuple[SessionIndex, list]:
    index = SessionIndex(key="t")
    matches = []
    for message in messages:
        calls = message.get("tool_calls") or []
        index.add(message, None, 10, {c["id"]: 5 for c in calls}, {c["id"]: None for c in calls}, np.zeros(4))
        matches.append(index.track(len(index.messages) - 1))
    return index, matches


def test_customer_id_reused_twice_credits_first_result():
    index, matches = build([
        user("look up the customer"),
        assistant(None, call("c1", "lookup", {"q": "acme"})),
        tool("c1", "customer_id=C142XYZ"),
        assistant("The customer is C142XYZ."),          # a model output reuses it
        assistant(None, call("c2", "orders", {"customer": "C142XYZ"})),  # and a tool call
    ])
    assert [m.result for m in matches[3]] == [0] and matches[3][0].values == ["C142XYZ"]
    assert matches[4][0].call_id == "c2" and matches[4][0].values == ["C142XYZ"]
    assert index.reuse_scores()[0] == pytest.approx(2.0)


def test_attribution_goes_to_first_result_despite_intermediate_copies():
    index, matches = build([
        assistant(None, call("c1", "a", {})),
        tool("c1", "token AB-99887 issued"),
        assistant("copying AB-99887"),                   # intermediate copy in a model output
        assistant(None, call("c2", "b", {})),
        tool("c2", "echo AB-99887"),                     # a later result holds it too
        assistant(None, call("c3", "c", {"t": "AB-99887"})),
    ])
    assert matches[5][0].result == 0                     # still the first result
    # c = 1/1 (use before the copy existed) + 1/2 (now two results hold it), recomputed with current n.
    assert index.reuse_scores()[0] == pytest.approx(0.5 + 0.5)
    assert index.reuse_scores()[1] == 0


def test_each_value_counts_once_per_operation():
    index, matches = build([
        assistant(None, call("c1", "a", {})),
        tool("c1", "ids: ORDER_1234 and ORDER_5678"),
        assistant("ORDER_1234 ORDER_1234 ORDER_1234 and ORDER_5678"),
    ])
    assert matches[2][0].values == ["ORDER_1234", "ORDER_5678"]
    assert index.reuse_scores()[0] == pytest.approx(2.0)  # two distinct values, not four occurrences


def test_three_contacts_sharing_a_value_in_one_result_add_one_to_n():
    index, _ = build([
        assistant(None, call("c1", "contacts", {})),
        tool("c1", "a_person@gmail.com b_person@gmail.com c_person@gmail.com"),
        assistant(None, call("c2", "other", {})),
        tool("c2", "mirror at gmail.com"),
        assistant("send to gmail.com"),
    ])
    assert index.value_results["gmail.com"] == [0, 1]
    assert index.reuse_scores()[0] == pytest.approx(0.5)  # n = 2 results, not 4 occurrences


def test_a_reuse_weight_does_not_depend_on_the_order_values_come_in(monkeypatch):
    # Values held by 1, 1 and 3 results, all first held by result 0: 1 + 1 + 1/3 summed in
    # another order differs in the last digit (2.3333333333333335 against 2.333333333333333).
    # extract_values gives a set, whose order changes with the process's hash seed; the value
    # counts' order (which c_t sums in) must not follow it either.
    import engine.index as index_module

    real = index_module.extract_values
    weights = []
    for order in (["AAA_111", "BBB_222", "CCC_333"], ["CCC_333", "AAA_111", "BBB_222"]):
        monkeypatch.setattr(index_module, "extract_values", lambda text, order=order: [v for v in order if v in text] if "reply" in text else real(text))
        index, matches = build([
            assistant(None, call("c1", "a", {})),
            tool("c1", "AAA_111 BBB_222 CCC_333"),
            assistant(None, call("c2", "b", {})),
            tool("c2", "CCC_333"),
            assistant(None, call("c3", "c", {})),
            tool("c3", "CCC_333"),
            assistant("reply AAA_111 BBB_222 CCC_333"),
        ])
        weights.append((matches[6][0].weight, list(index.value_uses)))
    assert weights[0] == weights[1]
    assert weights[0][0] == pytest.approx(7 / 3)


def test_values_seen_before_any_result_attribute_to_first_result_holding_them():
    index, matches = build([
        user("my id is USER_4242"),
        assistant("checking USER_4242"),                 # no result holds it yet: no match
        assistant(None, call("c1", "get", {"id": "USER_4242"})),
        tool("c1", "USER_4242: active"),
        assistant("USER_4242 is active"),
    ])
    assert matches[1] == [] and matches[2] == []
    assert matches[4][0].result == 0


def test_user_messages_and_results_are_not_operations():
    index, _ = build([
        assistant(None, call("c1", "a", {})),
        tool("c1", "KEY_123456"),
        user("KEY_123456"),
        assistant(None, call("c2", "b", {})),
        tool("c2", "KEY_123456 again"),
    ])
    assert index.reuse_scores()[0] == 0


# ---------------------------------------------------------------- the cache of indexes


def swe_history(results: int) -> list[dict]:
    from tests.conftest import load_traces

    messages = load_traces("mini_swe_agent_deepseek.jsonl")[0]["messages"]
    history = [m for m in messages if m["role"] != "system"]
    calls = [i for i, m in enumerate(history) if m["role"] == "tool"]
    return messages[:1] + history[: calls[results - 1] + 1] + [user("Continue.")]


@pytest.fixture
def empty_cache():
    """The process-wide cache without the indexes of earlier tests."""
    from engine.index import SESSION_CACHE

    for key in list(SESSION_CACHE._indexes):
        SESSION_CACHE.drop(key)
    return SESSION_CACHE


def test_an_evicted_session_renders_the_same_after_its_rebuild(engine, monkeypatch, empty_cache):
    cache = empty_cache

    first, second = swe_history(30), swe_history(20)
    assert engine.render("first", first, budget=2500).selected
    # The same request again, before any eviction: under the stable policy an append of nothing,
    # from the render state the first call left (on its RenderEpoch node and in the index).
    before = engine.render("first", first, budget=2500, explain=True)
    # A cap that holds one of these indexes: rendering the second evicts the first.
    monkeypatch.setattr(cache, "max_bytes", int(cache.total_bytes * 1.2))
    engine.render("second", second, budget=2500)
    assert len(cache) == 1 and cache.total_bytes <= cache.max_bytes
    after = engine.render("first", first, budget=2500, explain=True)
    assert after.messages == before.messages
    assert [vars(d) for d in after.decisions] == [vars(d) for d in before.decisions]
    assert (after.kept, after.omitted, after.history_tokens) == (before.kept, before.omitted, before.history_tokens)
    # And what comes next extends the rebuilt index as it would have the first.
    more = first + [assistant("Done with KEY_1.")]
    assert engine.render("first", more, budget=2500).messages[-1] == more[-1]
    engine.render("second", second, budget=2500)  # evicts "first" again
    assert engine.explain("first").messages == engine.render("first", more, budget=2500).messages


def test_the_cache_size_setting_must_be_a_positive_number(monkeypatch):
    from engine.index import cache_bytes_setting

    monkeypatch.setenv("CONTEXTRENDER_INDEX_CACHE_MB", "64")
    assert cache_bytes_setting() == 64 * 1024 * 1024
    for bad in ("0", "-5", "lots", "nan", "inf"):
        monkeypatch.setenv("CONTEXTRENDER_INDEX_CACHE_MB", bad)
        with pytest.raises(SystemExit, match="CONTEXTRENDER_INDEX_CACHE_MB must be a positive number"):
            cache_bytes_setting()


def test_two_engines_on_copies_of_one_store_keep_apart(tmp_path, empty_cache):
    """A copied store holds the same node ids: each engine's index is its own store's (the
    process-wide cache is keyed by the store as well as the session node)."""
    import shutil

    from contextrender import Engine

    conversation = [user("find the order"), assistant(None, call("c1", "lookup", {"q": "order"})), tool("c1", "ORDER_0001 shipped")]
    original = Engine(tmp_path / "original")
    original.ingest("s", conversation)
    original.close()
    shutil.copytree(tmp_path / "original", tmp_path / "copy")
    a, b = Engine(tmp_path / "original"), Engine(tmp_path / "copy")
    a.ingest("s", [assistant("Order ORDER_0001 has shipped.")], append=True)
    b.ingest("s", [assistant("Which order do you mean?")], append=True)
    assert a.render("s", budget=500).messages[-1]["content"] == "Order ORDER_0001 has shipped."
    assert b.render("s", budget=500).messages[-1]["content"] == "Which order do you mean?"
    assert b.get_session("s", include_messages=True)["messages"][-1]["content"] == "Which order do you mean?"


def test_each_assistant_event_keeps_the_results_its_operations_were_attributed_to():
    """TFA's attribution per event (`reuse_sources`: the Reuses edges' targets), the one place the
    stable policy's `reused_since` reads it from (engine/stability.jac)."""
    index, matches = build([
        assistant(None, call("c1", "a", {})),
        tool("c1", "token AB-99887 issued"),
        assistant(None, call("c2", "b", {"t": "AB-99887"})),
        tool("c2", "echo AB-99887 and ORDER_5678"),
        assistant("ORDER_5678 and AB-99887", call("c3", "c", {"t": "ORDER_5678"})),
        assistant("nothing reused here"),
    ])
    assert index.reuse_sources == {2: [0], 4: [0, 1]}
    assert index.reuse_sources[4] == sorted({m.result for m in matches[4]})


def test_a_messages_footprint_is_the_estimate_of_its_decoded_json():
    import engine.index as index_module

    json_bytes = vars(index_module).get("_json_bytes") or next(
        m._json_bytes for m in __import__("sys").modules.values() if hasattr(m, "_json_bytes")
    )
    # A dict: 64 + 100 an entry; a list: 56 + 8 a slot; a string 49 + its length; a number 28.
    assert json_bytes({"role": "tool", "tool_call_id": "c1", "content": "abc"}) == 64 + 3 * 100 + 53 + 51 + 52
    message = assistant(None, call("c1", "read", {"path": "a.py"}))
    calls = message["tool_calls"]
    function = calls[0]["function"]
    expected_function = 64 + 2 * 100 + 49 + len(function["name"]) + 49 + len(function["arguments"])
    expected_call = 64 + 100 * len(calls[0]) + 49 + 2 + 49 + len(calls[0]["type"]) + expected_function
    assert json_bytes(message) == 64 + 100 * len(message) + 49 + len("assistant") + (0 if message["content"] is None else 49 + len(message["content"])) + 56 + 8 + expected_call
    assert json_bytes([1, None, True, 2.5]) == 56 + 4 * 8 + 28 + 0 + 0 + 28


def test_the_render_figures_kept_on_an_index_are_counted_in_its_size(engine, empty_cache):
    """The render plan keeps figures per event and per result on the index (`_fold_entries`):
    the cache's bound counts them, an estimate of at least a slot and a small object an item."""
    from engine.index import SESSION_CACHE

    history = swe_history(40)
    engine.render("figures", history, budget=1500)
    (index,) = [SESSION_CACHE._indexes[key] for key in SESSION_CACHE._indexes]
    items = sum(len(part) for value in index._fold_entries.values()
                for part in (value if isinstance(value, tuple) else (value,)) if isinstance(part, (list, dict, set)))
    assert items > 0
    with_figures = index.size_bytes()
    (kept, index._fold_items) = (index._fold_items, 0)
    assert with_figures - index.size_bytes() >= 56 * items
    index._fold_items = kept


def test_the_render_figures_are_counted_as_they_are_kept_not_walked_at_each_size(engine, empty_cache):
    """`size_bytes` reads the count of the figures' items kept as they are written and grown: after
    every render it is the count a walk over every figure gives, and asking the size walks none."""
    from engine import index as index_module
    from engine.index import SESSION_CACHE

    history = swe_history(40)
    for end in range(8, len(history) + 1, 3):
        engine.render("counted", history[:end], budget=1200)
        (index,) = [SESSION_CACHE._indexes[key] for key in SESSION_CACHE._indexes]
        walked = sum(index_module.fold_items(value) for value in index._fold_entries.values())
        assert index._fold_items == walked > 0

    class Unwalked(dict):
        def values(self):
            raise AssertionError("size_bytes walked every figure")

        def items(self):
            raise AssertionError("size_bytes walked every figure")

    (index._fold_entries, kept) = (Unwalked(index._fold_entries), index._fold_entries)
    try:
        assert index.size_bytes() > 0
    finally:
        index._fold_entries = kept


def test_the_matrix_grows_with_the_results_and_copies_no_earlier_row_again():
    index = SessionIndex(key="t")
    rng = np.random.default_rng(0)
    seen = []
    for r in range(40):
        index.add(assistant(None, call(f"c{r}", "a", {})), None, 10, {f"c{r}": 5}, {f"c{r}": None}, None)
        # float64 and float32 rows, as a cast of the stacked rows makes them.
        vector = rng.standard_normal(8) if r % 2 else rng.standard_normal(8).astype(np.float32)
        index.add(tool(f"c{r}", f"result {r}"), None, 10, {}, {}, vector)
        matrix = index.matrix()
        expected = np.vstack(index.vectors).astype(np.float32)
        assert matrix.dtype == np.float32 and matrix.shape == expected.shape
        assert matrix.tobytes() == expected.tobytes()
        seen.append(matrix)
    # A new result's row is written beside the others while the buffer has room (twice the rows
    # needed when it grew, at the 35th): the 36th result's matrix shares its memory with the
    # 40th's (a restack would make a new array).
    assert np.shares_memory(seen[35], seen[39])
    assert SessionIndex(key="e").matrix().shape == (0, 1)


def test_the_tokens_by_message_id_are_extended_as_events_arrive():
    index, _ = build([user("look up the customer"), assistant(None, call("c1", "lookup", {}))])
    counted = index.tokens_by_id()
    assert counted == {id(m): 10 for m in index.messages}
    counted["kept"] = 0  # the same map, extended: not made again from every event
    index.add(tool("c1", "customer_id=C142XYZ"), None, 7, {}, {}, np.zeros(4))
    assert index.tokens_by_id() is counted and counted[id(index.messages[-1])] == 7 and "kept" in counted
