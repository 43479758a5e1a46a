"""engine/messages.jac: the message checks ingestion applies, and what it skips."""

from __future__ import annotations

import pytest

import engine.messages as messages_module
from contextrender import InvalidRequest
from tests.conftest import assistant, call, tool, user

# A system prompt, then one tool round and the answer.
HISTORY = [{"role": "system", "content": "you are an agent"}, user("read the file")]
HISTORY += [assistant(None, call("c1", "read", {"path": "a.py"})), tool("c1", "print('a')"), assistant("done")]


def checked(monkeypatch) -> list[str]:
    """The positions check_message sees from now on."""
    seen: list[str] = []
    real = messages_module.check_message
    monkeypatch.setattr(messages_module, "check_message", lambda where, message: seen.append(where) or real(where, message))
    return seen


def test_the_stored_chain_is_not_checked_again(monkeypatch):
    seen = checked(monkeypatch)
    (system, chain, same) = messages_module.split_messages(HISTORY + [user("next")], HISTORY[1:])
    assert system == HISTORY[:1] and chain == HISTORY[1:] + [user("next")] and same == len(HISTORY) - 1
    # The system prompt, the first chain message (it decides where the chain starts) and the new one.
    assert seen == ["messages[0]", "messages[1]", "messages[5]"]


def test_a_message_that_differs_from_the_stored_one_is_checked(monkeypatch):
    seen = checked(monkeypatch)
    changed = HISTORY[:3] + [tool("c1", [{"type": "text"}] * 2)] + HISTORY[4:]
    messages_module.split_messages(changed, HISTORY[1:])
    assert "messages[3]" in seen
    bad = HISTORY[:3] + [{"role": "tool", "tool_call_id": "", "content": "x"}] + HISTORY[4:]
    with pytest.raises(InvalidRequest, match=r"messages\[3\]: a tool message needs"):
        messages_module.split_messages(bad, HISTORY[1:])


def test_without_a_stored_chain_every_message_is_checked(monkeypatch):
    seen = checked(monkeypatch)
    messages_module.split_messages(HISTORY)
    assert seen == [f"messages[{i}]" for i in range(len(HISTORY))]


def test_an_engine_call_still_refuses_a_bad_new_message_after_the_stored_ones(engine):
    engine.ingest("s", HISTORY)
    with pytest.raises(InvalidRequest, match=r"messages\[5\]: role must be one of"):
        engine.render("s", HISTORY + [{"role": "robot", "content": "hi"}], budget=1000)
    assert engine.get_session("s")["events"] == len(HISTORY) - 1


def test_matching_run_counts_the_equal_pairs_a_block_at_a_time():
    stored = [{"role": "user", "content": f"m{i}"} for i in range(300)]
    resent = [dict(m) for m in stored]  # equal, not the same objects (as parsed from a request)
    run = messages_module.matching_run
    assert run(stored, 0, resent, 0) == 300
    assert run(stored, 0, resent[:7], 0) == 7 and run(stored, 290, resent, 290) == 10
    assert run(stored, 5, resent, 0) == 0 and run(stored, 300, resent, 0) == 0 and run([], 0, resent, 0) == 0
    for where in (0, 1, 15, 16, 17, 47, 48, 49, 200, 299):
        changed = resent[:where] + [{"role": "user", "content": "other"}] + resent[where + 1:]
        assert run(stored, 0, changed, 0) == where
        assert run(stored, 3, changed, 3) == (where - 3 if where >= 3 else 297)


def test_a_resent_history_with_a_changed_message_far_in_is_checked_there(monkeypatch):
    stored = HISTORY[1:] + [user(f"turn {i}") for i in range(100)]
    resent = [HISTORY[0]] + [dict(m) for m in stored]
    resent[70] = {"role": "user", "content": 7}
    seen = checked(monkeypatch)
    with pytest.raises(InvalidRequest, match=r"messages\[70\]"):
        messages_module.split_messages(resent, stored)
    resent[70] = user("changed")
    seen.clear()
    (_, chain, _) = messages_module.split_messages(resent + [user("new")], stored)
    assert chain == resent[1:] + [user("new")]
    assert seen == ["messages[0]", "messages[1]", "messages[70]", "messages[105]"]


def test_the_chain_holds_the_stored_objects_for_the_messages_equal_to_them():
    # Ingestion compares the chain with the stored one again (engine/messages.jac split_messages):
    # the same objects make that a pointer comparison a message, not a deep one.
    stored = HISTORY[1:] + [user(f"turn {i}") for i in range(100)]
    resent = [HISTORY[0]] + [dict(m) for m in stored]
    resent[40] = user("changed")
    (_, chain, _) = messages_module.split_messages(resent + [user("new")], stored)
    assert chain == resent[1:] + [user("new")]
    # The first chain message is checked (it decides where the chain starts), and the changed one.
    assert all(chain[k] is stored[k] for k in range(1, len(stored)) if k != 39)
    assert chain[0] is resent[1] and chain[39] is resent[40]


def test_ingestion_answers_the_same_for_an_edit_a_shortening_and_equal_copies(engine):
    import copy

    history = HISTORY + [user(f"turn {i}") for i in range(40)]
    engine.ingest("s", history)
    # Equal, not the same objects (as a server parses them): nothing written, then one new event.
    same = engine.ingest("s", copy.deepcopy(history))
    assert (same.added, same.forked_at, same.resent) == (0, -1, -1)
    grown = engine.ingest("s", copy.deepcopy(history) + [user("new")])
    assert (grown.added, grown.forked_at) == (1, -1)
    # Shortened: a resend of an earlier turn.
    short = engine.ingest("s", copy.deepcopy(history[:20]))
    assert (short.added, short.forked_at, short.resent) == (0, -1, 19)
    # Edited in the middle: a fork there, the rest written again after it.
    edited = copy.deepcopy(history) + [user("new")]
    edited[25] = user("edited")
    fork = engine.ingest("s", edited)
    assert (fork.forked_at, fork.added) == (24, len(edited) - 1 - 24)
    assert engine.get_session("s")["events"] == len(edited) - 1


def test_split_messages_counts_the_chain_messages_equal_to_the_stored_ones_from_the_first():
    stored = HISTORY[1:] + [user(f"turn {i}") for i in range(100)]
    resent = [HISTORY[0]] + [dict(m) for m in stored]
    split = messages_module.split_messages
    assert split(resent + [user("new")], stored)[2] == len(stored)
    assert split(resent[:30], stored)[2] == 29  # shortened: the 29 it sends
    for where in (1, 2, 3, 40, len(resent) - 1):
        changed = resent[:where] + [user("changed")] + resent[where + 1:]
        assert split(changed, stored)[2] == where - 1
    assert split(resent, [])[2] == 0 and split([HISTORY[0]], stored)[2] == 0
    # A stored system message mid-chain (ingestion's `at`) is still the caller's system prompt when it leads.
    middle = [{"role": "system", "content": "later rule"}, user("after it")]
    (system, chain, same) = split(middle, middle)
    assert system == middle[:1] and chain == middle[1:] and same == 0
