"""What the protocol format layers share: event streams, canonical parts, finding origins."""

from __future__ import annotations

import json

from contextrender.proxy.formats import EventReader, origins_of, plain, usage_counts


def test_events_come_whole_however_the_bytes_are_cut():
    stream = (b'event: message_start\r\ndata: {"a": 1}\r\n\r\n: keep-alive\n\n'
              b'event: content_block_delta\ndata: {"text": "h\xc3\xa9llo"}\n\ndata: [DONE]\n\n')
    expected = [("message_start", '{"a": 1}'), ("content_block_delta", '{"text": "h\u00e9llo"}'), ("", "[DONE]")]
    for size in (1, 2, 3, 7, len(stream)):
        reader = EventReader()
        got = [e for i in range(0, len(stream), size) for e in reader.feed(stream[i : i + size])]
        assert got == expected, size
    unfinished = EventReader()
    assert unfinished.feed(b"data: tail") == [] and unfinished.close() == [("", "tail")]


def test_plain_drops_nulls_and_named_keys_at_every_depth():
    block = {"type": "text", "text": "x", "citations": None, "cache_control": {"type": "ephemeral"},
             "content": [{"type": "text", "text": "y", "cache_control": {"type": "ephemeral"}, "extra": None}]}
    assert plain(block, frozenset({"cache_control"})) == {"type": "text", "text": "x", "content": [{"type": "text", "text": "y"}]}
    assert usage_counts(10, None, 3, True) == {"input_tokens": 10, "cache_creation_input_tokens": 3}


def test_recurring_texts_find_their_own_position_from_the_end():
    reminder = {"role": "user", "content": "<reminder/>"}
    prepared = [{"role": "user", "content": "task"}, reminder, {"role": "assistant", "content": "a"}, reminder,
                {"role": "assistant", "content": "b", "tool_calls": [{"id": "c1"}]}, {"role": "tool", "tool_call_id": "c1", "content": "r"},
                reminder]
    # The fold left out the first five: a marker, then the end of the conversation.
    rendered = [{"role": "user", "content": "[marker]"}, {"role": "tool", "tool_call_id": "c1", "content": "stub"}, reminder]
    assert origins_of(rendered, prepared, [True] * len(prepared)) == [None, 5, 6]
    assert origins_of(prepared[1:], prepared, [True] * len(prepared)) == [1, 2, 3, 4, 5, 6]
    assert origins_of([reminder], prepared, [True, True, True, True, True, True, False]) == [3]
    assert json.dumps(prepared[1]) == json.dumps(reminder)


def test_a_call_the_render_cut_is_sent_cut_on_messages_and_responses():
    """A call over results of a folded turn may be cut (`folded_call_room`): the format layers
    rebuild the client's own call part with the rendered arguments, not the client's whole ones."""
    from contextrender.proxy.messages.wire import to_messages, to_normal as messages_normal
    from contextrender.proxy.responses.wire import to_items, to_normal as responses_normal

    whole, cut = {"command": "x" * 400, "cwd": "/repo"}, {"command": "xx [... cut ...] xx", "cwd": "/repo"}
    body = {"messages": [
        {"role": "user", "content": "task"},
        {"role": "assistant", "content": [{"type": "text", "text": "writing it"},
                                          {"type": "tool_use", "id": "c1", "name": "bash", "input": whole}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "ok"}]},
    ]}
    (normal, origins) = messages_normal(body)
    wrapper = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": json.dumps(cut)}}]}
    rendered = [normal[0], wrapper, normal[2]]
    turns = to_messages(rendered, normal, origins, body["messages"])
    assert [b["input"] for t in turns for b in t["content"] if isinstance(b, dict) and b.get("type") == "tool_use"] == [cut]
    # Uncut, the client's own block goes.
    turns = to_messages(normal, normal, origins, body["messages"])
    assert [b["input"] for t in turns for b in t["content"] if isinstance(b, dict) and b.get("type") == "tool_use"] == [whole]

    items = [{"role": "user", "content": "task"},
             {"type": "function_call", "call_id": "c1", "name": "bash", "arguments": json.dumps(whole)},
             {"type": "function_call_output", "call_id": "c1", "output": "ok"}]
    (normal, origins) = responses_normal({"input": items})
    rendered = [normal[0], wrapper, normal[2]]
    sent = [i for i in to_items(rendered, normal, origins) if i.get("type") == "function_call"]
    assert [json.loads(i["arguments"]) for i in sent] == [cut]


def test_verbatim_calls_the_render_cut_are_sent_cut_with_their_turns_text_and_thinking(engine):
    """`verbatim_call_room` cuts the calls of verbatim turns (the text beside them): the Messages
    and Responses layers send each as the render cut it, the turn's other parts as the client sent
    them, so the request holds what was counted. A turn carrying thinking blocks keeps its calls
    whole (the provider checks a tool loop's signed thinking with its turn), its thinking as sent."""
    from contextrender.proxy.messages.wire import to_messages, to_normal as messages_normal
    from contextrender.proxy.responses.wire import to_items, to_normal as responses_normal

    script = lambda i: f"cat <<'EOF' > mod_{i}.py\n" + "\n".join(f"line_{i}_{k} = {k}" for k in range(40)) + "\nEOF"
    turns = [{"role": "user", "content": "fix the bug"}]
    items = [{"role": "user", "content": "fix the bug"}]
    for i in range(6):
        thinking = [{"type": "thinking", "thinking": f"plan {i}", "signature": f"sig{i}"}] if i == 5 else []
        turns += [{"role": "assistant", "content": thinking + [
                      {"type": "text", "text": f"step {i}"},
                      {"type": "tool_use", "id": f"c{i}", "name": "bash", "input": {"command": script(i)}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"c{i}", "content": f"wrote mod_{i}.py"}]}]
        items += [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"step {i}"}]},
                  {"type": "function_call", "call_id": f"c{i}", "name": "bash", "arguments": json.dumps({"command": script(i)})},
                  {"type": "function_call_output", "call_id": f"c{i}", "output": f"wrote mod_{i}.py"}]
    turns.append({"role": "user", "content": "go on"})
    items.append({"role": "user", "content": "go on"})
    settings = {"budget": 2000, "policy": "per-call", "prose_share": 0.5, "verbatim_call_room": 48, "verbatim_call_newest": True}

    (normal, origins) = messages_normal({"messages": turns})
    rendered = engine.render("messages", normal, **settings)
    shown = {c["id"]: json.loads(c["function"]["arguments"]) for m in rendered.messages for c in m.get("tool_calls") or []}
    assert len(shown) == 6 and all("tokens cut by ContextRender" in shown[f"c{i}"]["command"] for i in range(5))
    assert shown["c5"] == {"command": script(5)}, "a turn with thinking keeps its calls whole"
    sent = to_messages(rendered.messages, normal, origins, turns)
    blocks = [b for t in sent if t["role"] == "assistant" for b in t["content"]]
    assert {b["id"]: b["input"] for b in blocks if b["type"] == "tool_use"} == shown
    assert [b["text"] for b in blocks if b["type"] == "text"] == [f"step {i}" for i in range(6)]
    assert blocks[-3] == turns[-3]["content"][0], "the last turn's thinking as the client sent it"

    (normal, origins) = responses_normal({"input": items})
    rendered = engine.render("responses", normal, **settings)
    shown = {c["id"]: c["function"]["arguments"] for m in rendered.messages for c in m.get("tool_calls") or []}
    assert len(shown) == 6 and all("tokens cut by ContextRender" in a for a in shown.values())
    sent = to_items(rendered.messages, normal, origins)
    assert {i["call_id"]: i["arguments"] for i in sent if i.get("type") == "function_call"} == shown
    assert [i["content"][0]["text"] for i in sent if i.get("role") == "assistant"] == [f"step {i}" for i in range(6)]
