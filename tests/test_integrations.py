"""The integration recipes (docs/proxy-and-protocols.md), each run for real on loopback: the OpenAI
Python SDK and litellm through the proxy, and the OpenClaw provider entry (the opencode plugin:
tests/test_integrations_opencode.py)."""

from __future__ import annotations

import json
from pathlib import Path

from contextrender.testing.checks import pairing_problems
from contextrender.testing.fake_upstream import FakeUpstream
from engine.measure import get_tokenizer
from tests.conftest import call
from tests.proxy_fixtures import proxy_url_at
from tests.test_proxy import BUDGET, SYSTEM, conversation, history

ROOT = Path(__file__).resolve().parent.parent
TOK = get_tokenizer()


proxy_url = proxy_url_at(BUDGET)


def assert_rendered(upstream: FakeUpstream, sent: list[dict]) -> None:
    rendered = upstream.requests[-1].json["messages"]
    assert rendered[0] == SYSTEM and rendered[-1] == sent[-1]
    assert TOK.history_tokens(history(sent)) > BUDGET >= TOK.history_tokens(history(rendered))
    assert pairing_problems(rendered) == []


# ---------------------------------------------------------------- OpenAI SDK and litellm


def test_openai_sdk_through_the_proxy(proxy_url, upstream):
    import openai

    client = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key="sk-test")
    messages = conversation()
    upstream.enqueue(content="Here is the fix.")
    answer = client.chat.completions.create(model="gpt-4.1", messages=messages, temperature=0.1)
    assert answer.choices[0].message.content == "Here is the fix."
    assert upstream.requests[-1].headers["authorization"] == "Bearer sk-test"
    assert_rendered(upstream, messages)

    upstream.enqueue(content="Streamed through the proxy.", tool_calls=[call("call_sdk", "read_file", {"path": "a.py"})])
    stream = client.chat.completions.create(model="gpt-4.1", messages=messages, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Streamed through the proxy."
    arguments = "".join(c.choices[0].delta.tool_calls[0].function.arguments or "" for c in chunks if c.choices and c.choices[0].delta.tool_calls)
    assert json.loads(arguments) == {"path": "a.py"}
    assert upstream.requests[-1].json["stream"] is True
    assert_rendered(upstream, messages)


def test_litellm_through_the_proxy(proxy_url, upstream):
    import litellm

    messages = conversation()
    upstream.enqueue(content="litellm answer")
    answer = litellm.completion(model="openai/gpt-4.1", api_base=f"{proxy_url}/v1", api_key="sk-lite", messages=messages)
    assert answer.choices[0].message.content == "litellm answer"
    assert upstream.requests[-1].headers["authorization"] == "Bearer sk-lite"
    assert_rendered(upstream, messages)

    upstream.enqueue(content="litellm streamed answer")
    stream = litellm.completion(model="openai/gpt-4.1", api_base=f"{proxy_url}/v1", api_key="sk-lite", messages=messages, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == "litellm streamed answer"
    assert upstream.requests[-1].json["stream"] is True
    assert_rendered(upstream, messages)


# ---------------------------------------------------------------- OpenClaw


def test_openclaw_provider_entry_points_at_the_proxy_and_its_api_works(proxy_url, upstream):
    import openai

    config = json.loads((ROOT / "integrations" / "openclaw" / "openclaw.json").read_text())
    provider = config["models"]["providers"]["contextrender"]
    assert provider["api"] == "openai-completions"
    assert provider["baseUrl"] == "http://127.0.0.1:8800/v1"  # the recipe's `contextrender proxy --port 8800`
    model = provider["models"][0]
    assert config["agents"]["defaults"]["model"]["primary"] == f"contextrender/{model['id']}"
    # "openai-completions": OpenAI chat completions at baseUrl, streamed, with the key as a bearer token.
    base_url = provider["baseUrl"].replace("http://127.0.0.1:8800", proxy_url)
    client = openai.OpenAI(base_url=base_url, api_key="sk-claw")
    messages = conversation()
    upstream.enqueue(content="claw")
    stream = client.chat.completions.create(model=model["id"], messages=messages, stream=True, max_tokens=model["maxTokens"])
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "claw"
    assert upstream.requests[-1].json["model"] == model["id"]
    assert_rendered(upstream, messages)


def test_align_tells_the_fold_index_apart_from_the_frameworks_messages():
    """The fold index is sent as its own user message after the selected results of folded turns
    (engine/notices.jac marker_messages): aligned to no original, so the framework's next user
    message and the assistant's restore call keep theirs (a LangChain run sent a restore call as an
    empty user message when the index took the next user original's place)."""
    from contextrender.core import FOLD_INDEX_HEADING
    from contextrender_integrations.common import align

    originals = [
        {"role": "user", "content": "Read the files."},
        {"role": "assistant", "content": None, "tool_calls": [call("c1", "read_file", {"path": "a.py"})]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py body"},
        {"role": "assistant", "content": "Read them."},
        {"role": "user", "content": "What was in a.py?"},
        {"role": "assistant", "content": None, "tool_calls": [call("c2", "contextrender_restore", {"handle": "r1"})]},
        {"role": "tool", "tool_call_id": "c2", "content": "a.py body"},
    ]
    rendered = [
        {"role": "user", "content": "[ContextRender: the oldest messages of this conversation are left out ...]"},
        originals[1], originals[2],
        {"role": "user", "content": FOLD_INDEX_HEADING + "\nread_file results: r1"},
        *originals[3:],
    ]
    found = [(a.origin, a.same) for a in align(originals, rendered)]
    assert found == [(None, False), (1, True), (2, True), (None, False), (3, True), (4, True), (5, True), (6, True)]
    # The task kept above the marker: the marker is still a notice, and the rest keep their originals
    # (it took the next user original's place, and LangChain sent the turns out of order).
    with_task = [originals[0], *rendered]
    found = [(a.origin, a.same) for a in align(originals, with_task)]
    assert found == [(0, True), (None, False), (1, True), (2, True), (None, False), (3, True), (4, True), (5, True), (6, True)]
