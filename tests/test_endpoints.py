"""adapters/endpoints.py: the endpoint table matches what the server serves and what core.py
loads, and Engine, Client and AsyncClient each have one method per endpoint (made from its row)
that sends exactly its fields."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
from pathlib import Path

import subprocess
import sys
from functools import cache

import httpx
import pytest

from contextrender import AsyncClient, Client, Engine, InvalidRequest, Restoration, core
from contextrender.core import IngestSummary, RenderConfig, RenderResult
from contextrender.endpoints import ENDPOINTS
from tests.conftest import assistant, call, tool, user

REPO = Path(__file__).resolve().parent.parent
# A value for each required parameter of an endpoint method.
SAMPLES = {
    "session_id": "s1",
    "messages": [user("find the order"), assistant(None, call("c1", "lookup", {"q": "order"})),
                 tool("c1", "ORDER_0001 shipped"), assistant("ORDER_0001 has shipped")],
    "variants": [{"budget": 1000}, {"budget": 2000, "selector": "prune"}],
    "budget": 1000,
    "handle": "r1",
    "query": "ORDER_0001",
}


# In a process that imported jaclang first (as `jac start` does), `contextrender` is the entry module.
SERVED = """
import dataclasses, json, jaclang
from jaclang.runtimelib.server import ModuleIntrospector
introspector = ModuleIntrospector(module_name="contextrender", base_path=".")
def default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else "<required>"
print(json.dumps({name: {"module": cls.__module__, "login": introspector.is_auth_required_for_walker(name),
                         "fields": sorted(f.name for f in dataclasses.fields(cls) if not f.name.startswith("_") and f.name != "reports"),
                         "defaults": {f.name: default(f) for f in dataclasses.fields(cls) if not f.name.startswith("_") and f.name != "reports"}}
                  for (name, cls) in introspector.get_walkers().items()}, default=repr))
"""


@cache
def served_walkers() -> dict[str, dict]:
    """The walkers `jac start contextrender.jac` serves, found as jaclang's server finds them: each
    one's module, whether it needs a login, and its request fields."""
    done = subprocess.run([sys.executable, "-c", SERVED], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def call_every_method(target: object) -> list:
    """Call each endpoint method of `target` with its required parameters only."""
    outcomes = []
    for endpoint in ENDPOINTS.values():
        method = getattr(target, endpoint.method)
        required = {
            name: SAMPLES[name]
            for (name, p) in inspect.signature(method).parameters.items()
            if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        }
        outcomes.append((endpoint, method(**required)))
    return outcomes


def test_the_table_is_what_the_server_serves():
    walkers = served_walkers()
    assert set(ENDPOINTS) == set(walkers)
    for name, served in walkers.items():
        assert set(ENDPOINTS[name].fields) == set(served["fields"]), name
        # core.py loads each walker from the module its row names.
        assert served["module"] == ENDPOINTS[name].module, name
        assert getattr(core, name).__module__ == ENDPOINTS[name].module, name


def test_a_methods_defaults_are_its_walkers_defaults():
    # The method declares each field's default for the Python side; the walker declares it again
    # for the server: the two agree (a field the method requires may still have a walker default).
    for (name, served) in served_walkers().items():
        spec = ENDPOINTS[name]
        for (parameter, declared) in spec.signature.parameters.items():
            if declared.kind is inspect.Parameter.VAR_KEYWORD or declared.default is inspect.Parameter.empty:
                continue
            assert served["defaults"][spec.renamed.get(parameter, parameter)] == declared.default, (name, parameter)


def test_only_health_is_served_without_a_login():
    assert [name for (name, served) in served_walkers().items() if not served["login"]] == ["health"]


def test_the_entry_module_names_no_endpoint_but_the_one_served_without_a_login():
    # A new endpoint is its walker and its row: contextrender.jac serves what
    # walkers/served.jac finds. It names `health` only so that jaclang reads its `walker:pub`.
    import re

    from walkers.served import endpoint_walkers

    entry = (REPO / "contextrender.jac").read_text()
    named = {n.strip().split(" as ")[0] for names in re.findall(r"^import from walkers\.\w+ \{([^}]*)\}", entry, re.M)
             for n in names.split(",")}
    assert named == {"health", "endpoint_walkers"}
    assert set(endpoint_walkers()) == set(served_walkers()) == set(ENDPOINTS)


WALKERS = {
    "ping.jac": """import from walkers.session { Endpoint }
walker ping(Endpoint) { has word: str = ""; can answer with Root entry { self.deliver(self.word); } }
walker Echo { can go with Root entry { report 1; } }
""",
    "helpers.jac": "def nothing_here() -> int { return 0; }\n",
}


def test_a_new_endpoint_walker_is_found_and_a_pass_is_not(tmp_path, monkeypatch):
    from walkers.served import endpoint_walkers

    folder = tmp_path / "more_walkers"
    folder.mkdir()
    for name, text in WALKERS.items():
        (folder / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    found = endpoint_walkers(folder, "more_walkers")
    assert list(found) == ["ping"] and found["ping"].__module__ == "more_walkers.ping"


def test_core_loads_every_endpoint_walker_by_its_module():
    assert set(ENDPOINTS) <= set(core.__all__)


def test_a_method_reads_as_it_is_declared():
    signature = inspect.signature(Client.render)
    assert list(signature.parameters)[:3] == ["self", "session_id", "messages"]
    assert signature.parameters["budget"].kind is inspect.Parameter.KEYWORD_ONLY
    assert signature.parameters["budget"].default is inspect.Parameter.empty
    assert Client.render.__doc__.startswith("Ingest what is new") and Client.render.__name__ == "render"
    sent: list = []

    class Recording(Engine):
        def _call(self, walker, **fields):
            sent.append((walker, fields))

    recording = Recording.__new__(Recording)
    recording.render("s", budget=900, explain=True, verbosity=2)
    recording.ingest("s", [], usage=None)
    recording.ingest("s", [])
    assert sent[0] == ("render_context", {"session_id": "s", "messages": [], "budget": 900, "selector": "",
                                          "include_decisions": True, "usage": {}, "params": {"verbosity": 2}})
    # None, or nothing, sends the declared default, a fresh copy each call.
    assert sent[1][1]["usage"] == {} and sent[1][1]["usage"] is not sent[2][1]["usage"]
    with pytest.raises(TypeError):
        recording.render("s")  # budget is required
    with pytest.raises(TypeError):
        recording.get_session("s", include_mesages=True)  # no such field


@pytest.mark.parametrize("cls", [Engine, Client, AsyncClient])
def test_every_endpoint_is_a_method(cls):
    for endpoint in ENDPOINTS.values():
        assert callable(getattr(cls, endpoint.method, None)), f"{cls.__name__} has no {endpoint.method}()"


def test_each_method_sends_its_endpoint_and_exactly_its_fields():
    sent: list[tuple[str, dict]] = []

    class Recording(Engine):
        def _call(self, walker, **fields):
            sent.append((walker, fields))

    call_every_method(Recording.__new__(Recording))
    assert [w for (w, _) in sent] == list(ENDPOINTS)
    for walker, fields in sent:
        assert set(fields) == set(ENDPOINTS[walker].fields), walker


def fake_server(sent: list) -> httpx.MockTransport:
    """Answers each walker with a report of the kind the table names."""

    def answer(request: httpx.Request) -> httpx.Response:
        walker = request.url.path.removeprefix("/walker/")
        sent.append((walker, json.loads(request.content)))
        render = {"messages": [user("hi")], "budget": 1000, "history_tokens": 5}
        restoration = {"session_id": "s", "handle": "r1", "call_id": "c1", "tool_name": "lookup", "position": 2,
                       "tokens": 7, "message": tool("c1", "ORD-1"), "restores": 1, "recorded": True}
        ingest = {"session_id": "s", "events": 4, "added": 4, "results": 1, "reuse_links": 1}
        report = {"render": render, "renders": [render, render], "restoration": restoration, "ingest": ingest,
                  "config": {"selector": "prune"}, "value": {"walker": walker}}[ENDPOINTS[walker].returns]
        return httpx.Response(200, json={"ok": True, "data": {"reports": [report]}})

    return httpx.MockTransport(answer)


def check_client_calls(sent: list, outcomes: list) -> None:
    assert [w for (w, _) in sent] == list(ENDPOINTS)
    for (walker, body), (endpoint, outcome) in zip(sent, outcomes):
        assert set(body) == set(endpoint.fields), walker
        if endpoint.returns == "render":
            assert type(outcome) is RenderResult and outcome.history_tokens == 5
        elif endpoint.returns == "renders":
            assert [type(r) for r in outcome] == [RenderResult, RenderResult]
        elif endpoint.returns == "restoration":
            # The same type Engine.restore returns, read from the report's fields.
            assert isinstance(outcome, Restoration) and (outcome.handle, outcome.message["content"]) == ("r1", "ORD-1")
        elif endpoint.returns == "ingest":
            assert isinstance(outcome, IngestSummary) and (outcome.added, outcome.forked_at) == (4, -1)
        elif endpoint.returns == "config":
            assert isinstance(outcome, RenderConfig) and outcome.selector == "prune"
        else:
            assert outcome == {"walker": walker}


def test_the_client_posts_each_endpoint():
    sent: list = []
    with Client("http://cr.test", token="t", transport=fake_server(sent)) as client:
        check_client_calls(sent, call_every_method(client))


def test_the_async_client_posts_each_endpoint():
    sent: list = []

    async def run() -> list:
        async with AsyncClient("http://cr.test", token="t", transport=fake_server(sent)) as client:
            return [(endpoint, await pending) for (endpoint, pending) in call_every_method(client)]

    check_client_calls(sent, asyncio.run(run()))


def test_every_engine_method_runs_in_process(engine):
    outcomes = dict((e.walker, outcome) for (e, outcome) in call_every_method(engine))
    assert outcomes["ingest_events"].results == 1
    assert outcomes["render_context"].history_tokens > 0
    assert [r.budget for r in outcomes["render_variants"]] == [1000, 2000]
    assert outcomes["explain_render"].selector == "prune"  # the last render was the second variant
    assert outcomes["restore_result"].message == SAMPLES["messages"][2] and outcomes["restore_result"].handle == "r1"
    assert [m["handle"] for m in outcomes["search_results"]["matches"]] == ["r1"]
    assert outcomes["get_session"]["session_id"] == "s1"
    assert [s["session_id"] for s in outcomes["list_sessions"]] == ["s1"]
    assert outcomes["export_graph"]["nodes"]
    assert [r["mode"] for r in outcomes["inspect_session"]["renders"]][-1] == outcomes["explain_render"].mode
    assert outcomes["health"]["status"] == "ok"
    assert outcomes["delete_session"]["deleted"] > 0
    assert engine.list_sessions() == []


def test_the_client_returns_what_the_engine_returns(engine):
    """Every method's value from a Client, given the report of the Engine's value (as jac-scale
    sends it: the dataclass's fields with its `_jac_type`), is the Engine's value: the same type,
    the same fields."""

    def reported(value):
        if dataclasses.is_dataclass(value):
            return {"_jac_type": type(value).__name__} | {f.name: reported(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, list):
            return [reported(v) for v in value]
        return value

    returned = {e.walker: outcome for (e, outcome) in call_every_method(engine)}

    def answer(request: httpx.Request) -> httpx.Response:
        report = reported(returned[request.url.path.removeprefix("/walker/")])
        return httpx.Response(200, json={"ok": True, "data": {"reports": [json.loads(json.dumps(report))]}})

    with Client("http://cr.test", token="t", transport=httpx.MockTransport(answer)) as client:
        for endpoint, outcome in call_every_method(client):
            expected = returned[endpoint.walker]
            assert type(outcome) is type(expected), endpoint.method
            assert reported(outcome) == reported(expected), endpoint.method  # (Jac objects compare by identity)


def test_a_variant_that_is_not_an_object_is_refused(engine):
    engine.ingest("s1", SAMPLES["messages"])
    with pytest.raises(InvalidRequest, match="variants must be a list of objects"):
        engine.render_variants("s1", [{"budget": 1000}, "prune"])
