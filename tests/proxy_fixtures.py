"""What the protocol tests share (tests/test_anthropic*.py, tests/test_responses*.py,
tests/test_integrations.py): the proxy in front of the fake upstream at a module's budget, and a
forwarded request read without the restore tool the proxy offered."""

from __future__ import annotations

import json

import pytest

from contextrender.testing.fake_upstream import LoopbackServer
from contextrender.proxy import create_app


def proxy_url_at(budget: int):
    """A `proxy_url` fixture: the proxy with the engine in-process rendering to `budget`, in front
    of the fake upstream, on loopback (in a module: `proxy_url = proxy_url_at(BUDGET)`)."""

    @pytest.fixture
    def proxy_url(engine, upstream):
        with LoopbackServer(create_app(engine, upstream.base_url, budget)) as server:
            yield server.url

    return proxy_url


def without_restore_tool(sent: dict, tool: dict, turns: str) -> dict:
    """A forwarded request with the agent's tools only: `tool` (the restore tool in the protocol's
    shape), which the proxy adds after them when the render left a result out, is taken away; where
    it is not offered, no text of the request's `turns` names it."""
    tools = sent.get("tools") or []
    if tools and tools[-1] == tool:
        return dict(sent, tools=tools[:-1]) if len(tools) > 1 else {k: v for (k, v) in sent.items() if k != "tools"}
    assert "contextrender_restore" not in json.dumps(sent[turns])
    return sent


def objects_met(monkeypatch) -> list[tuple[int, int]]:
    """For each ingestion from now on: how many stored events it compared the request's history
    with, and how many of those are the very objects the request sent (the proxy's promise never
    to change a message it sent, interfaces.sent_unchanged, lets the in-process engine keep the
    proxy's own objects, and the next request's resent history is then compared by identity).
    Without the promise the engine keeps copies: none the same."""
    import walkers.ingest

    split = walkers.ingest.split_messages
    met: list[tuple[int, int]] = []

    def counting(messages, known=[]):  # noqa: B006 - split_messages' own default
        sent = {id(message) for message in messages}
        met.append((len(known), sum(id(stored) in sent for stored in known)))
        return split(messages, known)

    monkeypatch.setattr(walkers.ingest, "split_messages", counting)
    return met


def all_met(met: list[tuple[int, int]], renders: int) -> bool:
    """Whether each of the `renders` ingestions that compared a stored history met only the
    objects it stored (an answer appended alone compares none)."""
    compared = [(known, same) for (known, same) in met if known]
    return len(compared) == renders and all(same == known for (known, same) in compared)
