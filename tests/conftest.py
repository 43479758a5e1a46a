from __future__ import annotations

import json
from pathlib import Path

import pytest

from contextrender_adapters import Engine

TRACES = Path(__file__).resolve().parent.parent.parent / "shared" / "traces"


@pytest.fixture
def engine(tmp_path):
    return Engine(tmp_path / "store")


def call(call_id: str, name: str, arguments: dict | str) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def assistant(text: str | None = None, *calls: dict) -> dict:
    message: dict = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = list(calls)
    return message


def tool(call_id: str, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def load_traces(name: str) -> list[dict]:
    with open(TRACES / name) as f:
        return [json.loads(line) for line in f]


@pytest.fixture
def upstream():
    """A scripted fake OpenAI server on loopback that records what it receives."""
    from contextrender_adapters.fakeupstream import FakeUpstream

    with FakeUpstream() as fake:
        yield fake


@pytest.fixture(scope="session")
def jac_server(tmp_path_factory):
    """One real server for the session's HTTP tests (bodies over 1 MB are refused, to test 413; a
    body that stalls 3 s gets 408)."""
    from jacserver import JacServer

    server = JacServer(tmp_path_factory.mktemp("jac_server"), CONTEXTRENDER_MAX_BODY_MB="1", CONTEXTRENDER_BODY_TIMEOUT="3").start()
    yield server
    server.stop()
