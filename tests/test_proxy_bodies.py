"""Request bodies parsed reusing the last body of the same conversation (adapters/proxy/bodies.py):
every value and every error is `json.loads`'s, the messages a body re-sends byte for byte are the
last parse's objects, and nothing on the proxy's request path changes them in place."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from contextrender.proxy import SESSION_HEADER, create_app
from contextrender.proxy.bodies import Bodies
from contextrender.testing.fake_upstream import LoopbackServer
from tests.conftest import anthropic_conversation, responses_input
from tests.test_proxy import BUDGET, TOOLS, conversation


def _body(messages: list, **extra) -> bytes:
    return json.dumps({"model": "m", "messages": messages, **extra}, ensure_ascii=False).encode()


def _same_as_json(bodies: Bodies, raw: bytes, key: str = "k", array: str = "messages") -> None:
    try:
        expected = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        with pytest.raises(type(exc)) as raised:
            bodies.parse(raw, key, array)
        assert str(raised.value) == str(exc)
        return
    got = bodies.parse(raw, key, array)
    assert got == expected and type(got) is type(expected)
    assert json.dumps(got) == json.dumps(expected)  # key order, floats and ints alike


def test_a_growing_conversation_reuses_the_messages_it_resends():
    bodies = Bodies()
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    first = bodies.parse(_body(history, temperature=0), "run")
    history = history + [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "More é \u2603"}]
    raw = _body(history, temperature=0)
    second = bodies.parse(raw, "run")
    assert second == json.loads(raw)
    # The re-sent messages are the last parse's objects: not parsed again.
    assert all(a is b for (a, b) in zip(first["messages"], second["messages"][:2]))
    assert second["messages"][2] is not first["messages"][-1]


def test_a_rewritten_or_cut_history_reuses_only_what_is_the_same():
    bodies = Bodies()
    history = [{"role": "user", "content": f"message {i}"} for i in range(9)]
    first = bodies.parse(_body(history), "run")
    changed = history[:5] + [{"role": "user", "content": "rewritten"}] + history[6:]
    second = bodies.parse(_body(changed), "run")
    assert second == json.loads(_body(changed))
    assert [a is b for (a, b) in zip(first["messages"], second["messages"])] == [True] * 5 + [False] * 4
    third = bodies.parse(_body(changed[:3]), "run")
    assert third == json.loads(_body(changed[:3])) and third["messages"][0] is first["messages"][0]
    other = bodies.parse(_body(history, model_extra=1), "another run")  # another key: parsed whole
    assert other["messages"][0] is not first["messages"][0]


EDGES = [
    b'{}', b'[]', b'{"messages": []}', b'{"messages": [1, 2]}', b'{"messages": "text"}', b'{"model": "m"}',
    b' {"messages": [{}]}', b'{"messages":[{}]} ', b'{"messages": [{}]} x', b'{"messages": [{}]',
    b'{"messages": [{"role": "user"}], "messages": [{"role": "assistant"}]}',
    b'{"messages": [{"n": 123456789012345678901234567890, "f": 1e400, "g": NaN, "h": -Infinity}]}',
    b'{"messages": [{"content": "\\ud800 lone"}], "tools": [{"x": 1.0}]}',
    '{"messages": [{"content": "caf\u00e9 \u2603"}]}'.encode(), b'{"messages": [{"content": "\xff"}]}',
    '{"messages": [{"content": "x"}]}'.encode("utf-16-le"), '{"messages": [{"content": "x"}]}'.encode("utf-16"),
    b'\xef\xbb\xbf{"messages": [{}]}', b'{"messages": [{"content": "a\x01"}]}', b'{"messages" : [ {} , {"a":1} ] , "n" : 1 }',
    b'{"messages": [{}],}', b'{"messages": [{},]}', b'{"messages": [{}] "n": 1}', b'{"a": 1, }',
    b'{"messages": [' + b'[' * 100_000 + b']' * 100_000 + b']}',
    b'{"messages": [{"a": ' + b'[' * 100_000 + b']' * 100_000 + b'}]}',
]


@pytest.mark.parametrize("raw", EDGES)
def test_every_body_is_read_as_json_loads_reads_it(raw):
    bodies = Bodies()
    _same_as_json(bodies, raw)
    _same_as_json(bodies, raw)  # again, with the first parse kept (when there is one)


def test_a_body_that_extends_the_last_one_differently_is_still_read_exactly():
    """What follows a kept message decides: a longer value, a changed key after the messages, other
    whitespace, an error after the reused part."""
    bodies = Bodies()
    base = b'{"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}'
    for tail in [b']}', b'], "n": 1}', b'], "n": 12}', b'] , "messages": []}', b', {"x": 1}]}', b', 1]}', b']} [',
                 b', {"x": 1}] , "tools" : [ ] }', b', {"x": NaN}]}', b'', b', {"x": "\\ud83d\\ude00"}]}']:
        _same_as_json(bodies, base + tail)
    _same_as_json(bodies, base + b']}', array="input")


def test_bodies_are_forgotten_past_their_bounds():
    bodies = Bodies(keep=2)
    for key in ("a", "b", "c"):
        bodies.parse(_body([{"role": "user", "content": key}]), key)
    assert list(bodies._last) == ["b", "c"]
    raws = [_body([{"role": "user", "content": str(i) * 200}]) for i in range(5)]
    small = Bodies(chars=4 * len(raws[0]))  # a body up to a quarter of it is kept
    for (i, raw) in enumerate(raws):
        small.parse(raw, i)
    assert list(small._last) == [1, 2, 3, 4] and small._held == 4 * len(raws[0])
    tiny = Bodies(chars=8)
    assert tiny.parse(raws[0], 0) == json.loads(raws[0]) and not tiny._last  # too long to keep


def test_the_request_path_changes_no_message_it_was_given(engine, upstream):
    """Through the proxy in every protocol (chat completions with the restore tool offered,
    streamed or not, Messages, Responses), twice per session: every kept parse still equals its
    body, so a later request may reuse its messages."""
    messages = conversation()
    app = create_app(engine, upstream.base_url, BUDGET)
    with LoopbackServer(app) as server:
        chat = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-test", max_retries=0)
        for (turn, stream) in ((0, False), (1, True)):
            upstream.enqueue(content=f"Answer {turn}.")
            history = messages + [{"role": "assistant", "content": "Answer 0."}, {"role": "user", "content": "Again."}] if turn else messages
            answer = chat.chat.completions.create(model="gpt-4o", messages=history, tools=TOOLS, stream=stream,
                                                  extra_headers={SESSION_HEADER: "chat"})
            if stream:
                list(answer)
        claude = anthropic.Anthropic(base_url=server.url, api_key="sk-ant-test", max_retries=0)
        (system, turns) = anthropic_conversation(messages, thinking=False)
        for turn in range(2):
            upstream.enqueue(content=f"Answer {turn}.")
            claude.messages.create(model="claude-sonnet-4-5", max_tokens=64, system=system, messages=turns,
                                   extra_headers={SESSION_HEADER: "messages"})
            turns = turns + [{"role": "assistant", "content": "Answer 0."}, {"role": "user", "content": "Again."}]
        (instructions, items) = responses_input(messages)
        for turn in range(2):
            upstream.enqueue(content=f"Answer {turn}.")
            chat.responses.create(model="gpt-5", instructions=instructions, input=items, extra_headers={SESSION_HEADER: "responses"})
            items = items + [{"role": "assistant", "content": "Answer 0."}, {"role": "user", "content": "Again."}]
        kept = app.state.proxy.bodies._last
        assert {key[1] for key in kept} == {"chat", "messages", "responses"}
        for ((path, _), parsed) in kept.items():
            array = "input" if path.endswith("/responses") else "messages"
            assert parsed.messages == json.loads(parsed.text)[array]
        assert httpx.get(f"{server.url}/contextrender/ready").status_code == 200
