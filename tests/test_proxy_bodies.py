"""The request body parsed reusing the last body of its session (adapters/proxy/bodies.py): every
value and error is json.loads's, on fresh bodies and on bodies that extend a kept one; and each of
the five faults found in an earlier form (docs/performance.md, tenth pass) is tested: the bound in
bytes, no session named no reuse (in `Bodies`: the proxy keys such a request by its first bytes,
test 6), a fresh body parsed by json.loads alone, nesting at json's limit, and the kept objects
unchanged by the request path in every protocol."""

from __future__ import annotations

import copy
import json
import sys
import tracemalloc

import httpx
import pytest

from contextrender.proxy import SESSION_HEADER, create_app
from contextrender.proxy import bodies as bodies_module
from contextrender.proxy.bodies import Bodies
from contextrender.testing.fake_upstream import LoopbackServer
from tests.conftest import anthropic_conversation, assistant, call, responses_input, tool, user
from tests.test_proxy import TOOLS, conversation

MB = 1 << 20


def outcome(parse, raw: bytes):
    """A parse's value (with its key order and types) or its error (type and message)."""
    try:
        value = parse(raw)
    except (ValueError, RecursionError) as exc:
        return ("error", type(exc), str(exc))
    return ("value", json.dumps(value, sort_keys=False, default=repr), _types(value))


def _types(value) -> list:
    out, stack = [], [value]
    while stack:
        item = stack.pop()
        out.append(type(item).__name__)
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return out


def same_as_json(bodies: Bodies, sequence: list[bytes], key="s", history: str = "messages") -> None:
    for raw in sequence:
        assert outcome(lambda r: bodies.parse(r, key, history), raw) == outcome(json.loads, raw), raw[:200]


def body(messages: list, **rest) -> bytes:
    return json.dumps({"model": "m", "messages": messages} | rest).encode()


BASE = [user("Fix the test."), assistant(None, call("c1", "read", {"path": "a.py"})), tool("c1", "x = 1")]


def kept_base() -> Bodies:
    """A Bodies whose session "s" keeps BASE's end (two requests: the second finds it)."""
    bodies = Bodies(16 * MB)
    bodies.parse(body(BASE[:2]), "s", "messages")
    bodies.parse(body(BASE), "s", "messages")
    return bodies


EXTENSIONS = [
    body(BASE + [assistant("done")]),  # a message added
    body(BASE + [assistant("done"), user("thanks")], temperature=0.5, tools=TOOLS),  # keys after the history
    body(BASE)[:-1] + b' ,\n {"role": "user", "content": "x"} ] , "stream" : true }  ',  # whitespace
    body(BASE)[:-2] + b', 5]}',  # a non-object item
    body(BASE)[:-2] + b'.5]}',  # a number's continuation right after the kept part
    body(BASE)[:-2] + b'e5]}',
    body(BASE)[:-2] + b', {"a": 1,}]}',  # an error after the kept part
    body(BASE)[:-2] + b', {"a": NaN, "b": Infinity, "c": 123456789012345678901234567890}]}',
    body(BASE)[:-2] + b', {"a": "\\ud800 lone"}]}',
    body(BASE)[:-2] + b', {"\\u0000": 1}], "\\u0000": 2}',  # the key the rest is read under
    body(BASE)[:-2] + b', {"a": "\xff\xfe"}]}',  # invalid UTF-8 after the kept part
    body(BASE)[:-2] + b', {"a": "\xc3\xa9 \xf0\x9f\x98\x80"}]}',
    body(BASE)[:-2] + b'], "messages": [{"role": "user", "content": "again"}]}',  # the history's key twice
    body(BASE)[:-2] + b'], "model": "other"}',  # a key before the history again
    body(BASE)[:-2] + b']} extra',
    body(BASE)[:-2] + b'], "x": [1, 2',  # truncated
    body(BASE)[:-2],
    body(BASE) + b"\n",
    body(BASE),  # the same body again
    body(BASE[:2] + [tool("c1", "x = 2")]),  # the last message rewritten
    body(BASE[:1]),  # shorter
]


@pytest.mark.parametrize("raw", EXTENSIONS)
def test_a_body_that_extends_the_kept_one_parses_as_json_does(raw):
    same_as_json(kept_base(), [raw, raw, body(BASE + [assistant("later")])])


FRESH = [
    b"", b"{}", b"[]", b"null", b"{", b'{"messages": []}', b'{"messages": "text"}', b'{"messages": [1, 2]}',
    b'{"messages": [{}], "messages": [{"a": 1}]}', b' {"messages": [{}]}', b'\xef\xbb\xbf{"messages": [{}]}',
    json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode("utf-16"),
    json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode("utf-16-le"),
    json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode("utf-32"),
    b'{"messages": [{"a": NaN}], "t": -Infinity}', b'{"messages": [{"a": "\x01"}]}', b'{"messages": [{},]}',
    b'{"model": "m", "messages": [{"a": 1}]} x', b'{"a": 1, "a": 2, "messages": [{"b": 1}], "a": 3}',
    b'{"messages": [{"deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]}",
]


@pytest.mark.parametrize("raw", FRESH)
def test_every_body_parses_as_json_does_once_and_again(raw):
    # Each body alone, then after a kept one, then twice (the second read after the first was kept).
    same_as_json(Bodies(16 * MB), [raw, raw, raw])
    same_as_json(kept_base(), [raw, raw])


def test_a_growing_history_reuses_the_last_parse_and_a_rewrite_only_what_is_before_it():
    bodies = Bodies(16 * MB)
    first = bodies.parse(body(BASE[:1]), "s", "messages")
    second = bodies.parse(body(BASE[:2]), "s", "messages")  # finds where the first ends: parsed again
    assert second["messages"][0] is not first["messages"][0]
    third = bodies.parse(body(BASE), "s", "messages")
    assert all(a is b for (a, b) in zip(third["messages"], second["messages"]))
    fourth = bodies.parse(body(BASE + [assistant("done")], tools=TOOLS), "s", "messages")
    assert all(a is b for (a, b) in zip(fourth["messages"], third["messages"]))
    assert fourth == json.loads(body(BASE + [assistant("done")], tools=TOOLS))
    # Rewritten: nothing reused, and the list a request gets is its own.
    rewritten = bodies.parse(body([user("Another task.")] + BASE[1:]), "s", "messages")
    assert not any(a is b for (a, b) in zip(rewritten["messages"], fourth["messages"]))
    assert fourth["messages"] is not third["messages"]


def test_1_the_kept_bodies_are_bounded_in_bytes_objects_included():
    # Many sessions of large bodies: the total (bytes kept and the objects' sizes) stays in the bound.
    bodies = Bodies(16 * MB)
    history = [user("word " * 2000 + "\U0001F600")] * 30  # non-BMP: four bytes a character in a str
    for session in range(40):
        for n in (10, 20, 30):
            bodies.parse(body(history[:n]), session, "messages")
    assert 12 * MB < bodies.total <= 16 * MB and 0 < len(bodies._kept) < 40
    assert bodies.total == sum(k.size + bodies_module._key_bytes(key) for (key, k) in bodies._kept.items())
    # An entry counts at least what its objects hold (measured), and a body of tiny objects
    # (18 bytes of objects a byte of JSON) counts them: over a quarter of the bound, not kept.
    for messages in (history, [{"a": [{}] * 20}] * 400, [{"role": "user", "content": "\u00e9" * 500}] * 200):
        bodies = Bodies(64 * MB)
        bodies.parse(body(messages[:-1]), "s", "messages")
        tracemalloc.start()
        bodies.parse(body(messages), "s", "messages")
        (held, _) = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert bodies._kept["s"].size >= 0.9 * held
    bodies = Bodies(4 * MB)
    tiny = [{}] * 100_000  # 400 kB of JSON, about 7 MB of objects
    bodies.parse(body(tiny[:-2]), "s", "messages")
    bodies.parse(body(tiny[:-1]), "s", "messages")
    assert bodies.total < 1000 and bodies._kept["s"].raw == b"" and bodies._kept["s"].prefix is None
    # and not searched again (a search of such a body would cost a scan at every other request).
    for n in range(3):
        assert bodies.parse(body(tiny + [{}] * n), "s", "messages") == json.loads(body(tiny + [{}] * n))
    assert bodies.total < 1000 and bodies._kept["s"].raw == b""


def test_1_a_session_s_name_is_counted_and_a_body_too_large_for_its_objects_is_not_searched(monkeypatch):
    # Names of 4,000 characters on tiny bodies (refused later by the proxy, kept here): the
    # names' bytes are in the bound.
    bodies = Bodies(4 * MB)
    for n in range(5000):
        bodies.parse(b"{}", ("/v1/chat/completions", f"{n:04d}" + "x" * 4000), "messages")
    assert bodies.total <= 4 * MB and len(bodies._kept) < 1000
    held = sum(sys.getsizeof(name) for (_, name) in bodies._kept)
    assert bodies.total >= held
    # A body whose bytes alone show its objects cannot fit a quarter of the bound: its history is
    # never searched (the search would parse it again only to drop it).
    scans: list = []
    real = bodies_module._SCAN
    monkeypatch.setattr(bodies_module, "_SCAN", lambda text, at: scans.append(at) or real(text, at))
    bodies = Bodies(4 * MB)
    big = [user("word " * 200)] * 800  # about 0.8 MB of JSON: 1.2 MB of objects at least
    for n in (798, 799, 800):
        assert bodies.parse(body(big[:n]), "s", "messages") == json.loads(body(big[:n]))
    assert scans == [] and bodies._kept["s"].raw == b"" and bodies.total < 1000


def test_2_no_session_named_no_reuse_and_sessions_share_no_objects():
    bodies = Bodies(16 * MB)
    for n in (1, 2, 3):
        bodies.parse(body(BASE[:n]), None, "messages")
    assert not bodies._kept
    # Two sessions sending the same bodies: each its own objects.
    parsed = {key: [bodies.parse(body(BASE[:n]), key, "messages") for n in (1, 2, 3)] for key in ("a", "b")}
    assert not any(x is y for (x, y) in zip(parsed["a"][-1]["messages"], parsed["b"][-1]["messages"]))


def test_3_a_fresh_body_is_parsed_by_json_loads_alone_and_a_vain_search_is_not_made_again(monkeypatch):
    scans: list = []
    real = bodies_module._SCAN
    monkeypatch.setattr(bodies_module, "_SCAN", lambda text, at: scans.append(at) or real(text, at))
    bodies = Bodies(16 * MB)
    for session in range(5):
        bodies.parse(body(BASE, session=session), session, "messages")
    assert scans == []  # first bodies: json.loads alone
    # The second body of a session starts with the first's first half: the end is searched once (one
    # scan of the model's value, one of the whole history: not message by message), then reused
    # (the added message scanned again for its end).
    bodies.parse(body(BASE + [assistant("done")], session=0), 0, "messages")
    assert len(scans) == 3
    scans.clear()
    bodies.parse(body(BASE + [assistant("done"), user("more")], session=0), 0, "messages")
    assert len(scans) == 1  # the added message's end
    # A session that rewrites its last message at every request: searched once, then never again.
    ephemeral = [body(BASE[:2] + [tool("c1", f"x = {n}")], session=1) for n in range(6)]
    scans.clear()
    for raw in ephemeral:
        assert bodies.parse(raw, 1, "messages") == json.loads(raw)
    assert len(scans) == 2
    # A history that cannot be kept (its last item is not an object): searched once too.
    scans.clear()
    for n in range(1, 6):
        raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}, 5] * n}).encode()
        assert bodies.parse(raw, 2, "messages") == json.loads(raw)
    assert len(scans) == 2


def test_4_nesting_at_json_s_limit_raises_where_json_loads_raises():
    def deep(levels: int) -> bytes:
        return body(BASE)[:-2] + b', {"deep": ' + b"[" * levels + b"]" * levels + b"}]}"

    def fails(parse, levels: int) -> bool:
        try:
            parse(deep(levels))
        except RecursionError:
            return True
        return False

    (low, high) = (1, 100_000)  # the deepest json.loads accepts from here
    while low < high:
        middle = (low + high + 1) // 2
        (low, high) = (low, middle - 1) if fails(json.loads, middle) else (middle, high)
    for levels in (low - 2, low - 1, low, low + 1, low + 2):
        same_as_json(kept_base(), [deep(levels)])
    assert fails(lambda raw: kept_base().parse(raw, "s", "messages"), low + 1)


@pytest.fixture
def proxy_app(engine, upstream):
    app = create_app(engine, upstream.base_url, 1200)
    with LoopbackServer(app) as server:
        yield (app, server)


def _chat(messages):
    return "/v1/chat/completions", {"model": "m", "messages": messages, "tools": TOOLS}


def _messages(messages):
    (system, turns) = anthropic_conversation(messages)
    return "/v1/messages", {"model": "claude-x", "system": system, "messages": turns, "max_tokens": 100}


def _responses(messages):
    (instructions, items) = responses_input(messages)
    return "/v1/responses", {"model": "m", "input": items} | ({"instructions": instructions} if instructions else {})


@pytest.mark.parametrize("shape", [_chat, _messages, _responses])
@pytest.mark.parametrize("stream", [False, True])
def test_5_the_request_path_changes_no_kept_object_in_any_protocol(proxy_app, upstream, shape, stream):
    # The kept items are handed to the next request of the session: after every request (the
    # restore tool offered, whole and streamed, in each protocol) they still read as their bytes do.
    (app, server) = proxy_app
    bodies = app.state.proxy.bodies
    messages = conversation()  # results far over the budget: the restore tool is offered
    reused = 0
    for n in (len(messages) - 7, len(messages) - 5, len(messages) - 3, len(messages) - 1, len(messages)):
        (path, sent) = shape(messages[:n])
        upstream.enqueue(content="Looked.")
        response = httpx.post(f"{server.url}{path}", json=sent | {"stream": stream}, headers={SESSION_HEADER: "run"}, timeout=60)
        assert response.status_code == 200, response.text[:300]
        assert "contextrender_restore" in upstream.requests[-1].body.decode()
        kept = bodies._kept.get((path, "run"))
        if kept is not None and kept.prefix is not None:
            reused += 1
            history = "input" if path == "/v1/responses" else "messages"
            as_sent = json.loads(kept.prefix + b"]}")
            assert as_sent == kept.head | {history: kept.items}
    assert reused >= 2


class Snapshots:
    """The engine, each render's messages kept as returned and as a deep copy made then."""

    def __init__(self, engine):
        self.engine = engine
        self.renders: list[tuple[list, list]] = []

    def render(self, session_id, messages, **options):
        result = self.engine.render(session_id, messages, **options)
        self.renders.append((result.messages, copy.deepcopy(result.messages)))
        return result

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.mark.parametrize("shape", [_chat, _messages, _responses])
@pytest.mark.parametrize("stream", [False, True])
def test_5_the_request_path_changes_no_rendered_message_in_any_protocol(engine, upstream, shape, stream):
    # What a render returns is built into the forwarded body (the restore tool offered, the Messages
    # layer's cache breakpoints placed, the tool's hints rewritten where it is not): copied where
    # it changes, never changed in place, so that a render's messages could be the index's own.
    backend = Snapshots(engine)
    messages = conversation()  # results far over the budget: the restore tool is offered
    with LoopbackServer(create_app(backend, upstream.base_url, 1200)) as server:
        for n in (len(messages) - 7, len(messages) - 5, len(messages) - 3):
            (path, sent) = shape(messages[:n])
            upstream.enqueue(content="Looked.")
            response = httpx.post(f"{server.url}{path}", json=sent | {"stream": stream}, headers={SESSION_HEADER: "run"}, timeout=60)
            assert response.status_code == 200, response.text[:300]
    assert len(backend.renders) == 3
    assert all(returned == copied for (returned, copied) in backend.renders)


def test_6_a_request_without_a_session_name_reuses_the_last_body_that_starts_like_it(proxy_app, upstream):
    # An agent that names no session: its bodies share their first bytes, so the kept body of the
    # last request is found by them and extended (before: every such body parsed whole).
    (app, server) = proxy_app
    bodies = app.state.proxy.bodies
    messages = conversation()  # about 36 kB a body: past the key's bytes
    other = [messages[0], user("Another task, in module_beta.")] + messages[2:]
    reused = 0
    for n in (len(messages) - 7, len(messages) - 5, len(messages) - 3, len(messages) - 1, len(messages)):
        for sent in (messages[:n], other[:n]):  # two agents, one after the other
            upstream.enqueue(content="Looked.")
            raw = json.dumps({"model": "m", "messages": sent, "tools": TOOLS}).encode()
            response = httpx.post(f"{server.url}/v1/chat/completions", content=raw, timeout=60,
                                  headers={"content-type": "application/json"})
            assert response.status_code == 200, response.text[:300]
            kept = bodies._kept.get(bodies_module.unnamed_key("/v1/chat/completions", raw))
            if kept is not None and kept.prefix is not None:
                reused += 1
                assert raw.startswith(kept.prefix)
                assert json.loads(kept.prefix + b"]}") == kept.head | {"messages": kept.items}
    assert reused >= 6
    assert len(bodies._kept) == 2  # one a beginning: the two agents' bodies differ in their first bytes


def test_6_the_key_of_a_body_without_a_session_name_is_its_first_bytes():
    head = body([user("x" * bodies_module.UNNAMED_KEY_BYTES)])
    key = bodies_module.unnamed_key("/v1/chat/completions", head)
    assert key == bodies_module.unnamed_key("/v1/chat/completions", head[:-2] + b', {"role": "user"}]}')
    assert key != bodies_module.unnamed_key("/v1/messages", head)
    assert key != bodies_module.unnamed_key("/v1/chat/completions", b" " + head)
    # Keyed so, the parse is json's whichever body was kept (one agent's, then another's).
    bodies = Bodies(16 * MB)
    same_as_json(bodies, [body(BASE[:2]), body(BASE), body(BASE[:1] + [assistant("other")]), body(BASE)], key=key)


def test_7_a_body_is_encoded_as_json_dumps_writes_it_its_lists_items_kept_by_identity():
    # restores.encoded_body: byte for byte json.dumps(ensure_ascii=False); an item that is the
    # very object the last body held takes its text from then, any other (an equal copy, 1.0 for
    # 1) is encoded again; what is kept is the last body's items.
    from contextrender.proxy import restores

    kept: dict = {}
    (a, b) = ({"role": "user", "content": "é \u2028 \"q\""}, {"role": "tool", "content": "x", "n": 1})
    bodies = [
        {"model": "m", "messages": [a, b], "tools": TOOLS, "stream": False, "n": None, "t": 0.5},
        {"model": "m", "messages": [a, dict(b, n=1.0), b, [1, [2]], "s", 3], "tools": TOOLS, "empty": []},
        {},
        {"messages": [b, dict(b, n=True)], "stop": ["\n"]},
    ]
    for body in bodies:
        assert restores.encoded_body(body, kept) == json.dumps(body, ensure_ascii=False).encode()
        assert all(kept[id(item)][0] is item for value in body.values() if isinstance(value, list) for item in value)
        assert len(kept) == len({id(item) for value in body.values() if isinstance(value, list) for item in value})
    assert restores.encoded_body(bodies[0], None) == json.dumps(bodies[0], ensure_ascii=False).encode()


@pytest.mark.parametrize("shape", [_chat, _messages, _responses])
def test_7_a_session_s_bodies_go_upstream_as_json_dumps_writes_them_the_history_s_texts_reused(engine, upstream, shape, monkeypatch):
    # Each body sent upstream is json.dumps's text of what was rendered, whether offered the
    # restore tool or not; in chat completions the rendered messages are the engine's own, and
    # the items the last body held are not encoded again (the other protocols build their items).
    from contextrender.proxy import restores

    items_encoded: list[int] = []
    real = restores._ENCODE

    def counting(value):
        items_encoded[-1] += isinstance(value, dict) and "role" in value
        return real(value)

    monkeypatch.setattr(restores, "_ENCODE", counting)
    messages = conversation()
    with LoopbackServer(create_app(engine, upstream.base_url, 1200)) as server:
        steps = ((len(messages) - 9, 1200), (len(messages) - 7, 1200), (len(messages) - 5, 100000), (len(messages) - 3, 100000))
        for (n, budget) in steps:
            (path, sent) = shape(messages[:n])
            # The model answers what the next request re-sends: the session goes on as one chain.
            upstream.enqueue(content=messages[n].get("content"), tool_calls=messages[n].get("tool_calls"))
            items_encoded.append(0)
            response = httpx.post(f"{server.url}{path}", json=sent, headers={SESSION_HEADER: "run", "x-contextrender-budget": str(budget)}, timeout=60)
            assert response.status_code == 200, response.text[:300]
            body = upstream.requests[-1].body
            assert body == json.dumps(json.loads(body), ensure_ascii=False).encode()
            history = json.loads(body)["input" if path == "/v1/responses" else "messages"]
            if shape is _chat and len(items_encoded) == len(steps):  # the whole history sent, as the last one
                assert 0 < items_encoded[-1] < len(history)
