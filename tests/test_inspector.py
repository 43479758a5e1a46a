"""The session inspector (adapters/inspector/routes.py, static/inspector.*, walkers/inspector.jac) in a
real browser: Debian's headless Chromium, driven by Selenium through chromium-driver, loads the
page from a real proxy (its engine in-process) and from a real `jac start` server behind a real
proxy, after the fake upstream played a tool-using conversation through them (reads, a grep that
reuses their values, a restore the model asked for), and checks what is drawn against that
conversation: the handles, statuses, counts and renders. Another user's session stays out of
reach of the page and of its data routes.

Scripts/setup.sh installs chromium and chromium-driver when missing (as root); without them these
tests skip, except under CI (CI set), where a missing browser fails them.

INSPECTOR_SCREENSHOTS=<folder> saves a PNG of each view there (docs/inspector.md's pictures:
`INSPECTOR_SCREENSHOTS=docs/inspector .venv/bin/python -m pytest -q tests/test_inspector.py`).
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import time
import zlib
from pathlib import Path

import httpx
import pytest

from contextrender.client import Client
from contextrender.testing.fake_upstream import FakeUpstream, LoopbackServer
from contextrender.inspector.routes import loopback_problem
from contextrender.proxy import SESSION_HEADER, create_app
from contextrender.proxy.chat.restore import RESTORE_TOOL
from tests.conftest import assistant, call, tool, user

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
SHOTS = os.environ.get("INSPECTOR_SCREENSHOTS")
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "grep", "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}}}}},
]
# Six reads of 700-token files and a grep at B = 2,000: the early reads leave stubs (prose share off,
# so nothing folds and every omitted result names its handle), later renders append or re-render.
BUDGET = 2000
SETTINGS = {"prose_share": 1.0, "condense": False}
READS = 6
WAIT = 60


def file_body(i: int) -> str:
    return "\n".join(f"def total_{i}_{j}(invoice):  # ledger_{i}_{j}\n    return invoice.amount * {j}" for j in range(40))


# ---------------------------------------------------------------- the browser


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (CHROMIUM and CHROMEDRIVER):
        message = "chromium and chromium-driver are not installed (scripts/setup.sh installs them as root: apt-get install chromium chromium-driver)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1500,1100",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(WAIT)
    yield driver
    driver.quit()


def wait_for(driver, css: str, text: str = "") -> list:
    """The elements `css` finds once one of them is drawn (and holds `text`, when given)."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def found(d):
        elements = d.find_elements(By.CSS_SELECTOR, css)
        return elements if elements and (not text or any(text in e.text for e in elements)) else False

    # An element found while the page replaced its view is stale: look again.
    wait = WebDriverWait(driver, WAIT, poll_frequency=0.1, ignored_exceptions=(StaleElementReferenceException,))
    return wait.until(found, f"{css!r} with {text!r} never drawn")


def cells(driver, table: str) -> list[dict]:
    """Each row of a drawn table as {column header: cell text}, with the row's data attributes."""
    return driver.execute_script("""
        const t = document.getElementById(arguments[0]);
        const heads = [...t.querySelectorAll('thead th')].map(h => h.textContent);
        return [...t.querySelectorAll('tbody tr')].map(tr => Object.assign(
            Object.fromEntries([...tr.children].map((td, i) => [heads[i], td.textContent])), {...tr.dataset}));
    """, table)


def shoot(driver, name: str) -> None:
    """A PNG of the whole page (INSPECTOR_SCREENSHOTS), through Chromium's DevTools protocol."""
    if SHOTS:
        import base64

        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        size = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": min(size["height"], 4000), "scale": 1}
        shot = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip})
        (Path(SHOTS) / f"{name}.png").write_bytes(base64.b64decode(shot["data"]))


# ---------------------------------------------------------------- the conversation


def play(proxy_url: str, upstream: FakeUpstream, session_id: str) -> dict:
    """A tool-using conversation through the proxy: READS file reads, a grep whose pattern and
    text reuse values of the first file, then the model asks (through the proxy's restore tool)
    for a result its request showed as a stub. Returns what it did."""
    messages = [{"role": "system", "content": "You are a careful coding agent."}, user("The invoice totals are wrong: find why.")]
    headers = {SESSION_HEADER: session_id, "authorization": "Bearer sk-test"}
    with httpx.Client(base_url=proxy_url, timeout=60) as http:

        def ask() -> dict:
            response = http.post("/v1/chat/completions", headers=headers, json={"model": "fake-model", "messages": messages, "tools": TOOLS})
            assert response.status_code == 200, response.text
            assert response.headers["x-contextrender-status"] == "managed"
            return response.json()["choices"][0]["message"]

        for i in range(READS):
            upstream.enqueue(content=f"Reading part {i}.", tool_calls=[call(f"read_{i}", "read_file", {"path": f"billing/part_{i}.py"})])
            answer = ask()
            messages.append(assistant(answer["content"], *answer["tool_calls"]))
            messages.append(tool(f"read_{i}", file_body(i)))
        upstream.enqueue(content="total_0_3 and ledger_0_3 disagree.", tool_calls=[call("grep_0", "grep", {"pattern": "ledger_0_3"})])
        answer = ask()
        messages.append(assistant(answer["content"], *answer["tool_calls"]))
        messages.append(tool("grep_0", "billing/part_0.py:7: def total_0_3(invoice):  # ledger_0_3"))
        # The model asks back a result that the last request showed as a stub, then answers.
        stubs = [m["content"].rsplit('handle "', 1)[1].split('"')[0] for m in upstream.requests[-1].json["messages"]
                 if m.get("role") == "tool" and m["content"].startswith("[ContextRender")]
        assert stubs, "the conversation should leave stubs at this budget"
        upstream.enqueue(content=None, tool_calls=[call("restore_0", RESTORE_TOOL, {"handle": stubs[0]})])
        upstream.enqueue(content="Fixed: total_0_3 multiplies by the wrong factor.")
        answer = ask()
        assert answer["content"].startswith("Fixed")
        messages.append(assistant(answer["content"]))
    # The last render is the request before the restore round.
    last = upstream.requests[-2].json["messages"]
    last_stubs = [m["content"].rsplit('handle "', 1)[1].split('"')[0] for m in last
                  if m.get("role") == "tool" and m["content"].startswith("[ContextRender")]
    return {"session_id": session_id, "restored": stubs[0], "last_stubs": last_stubs, "messages": messages}


def wait_until_stored(backend, session_id: str, events: int) -> None:
    """The proxy ingests each answer after responding: until the session holds `events` events."""
    deadline = time.monotonic() + 30
    while backend.get_session(session_id)["events"] < events:
        assert time.monotonic() < deadline, "the proxy never stored the last answer"
        time.sleep(0.05)


def check_session_page(driver, url: str, backend, done: dict, shots: str = "") -> None:
    """The session view draws the conversation as the store keeps it: every render of the
    timeline, every result's handle and status in the last render (explain's), the counts, the
    restore; an earlier render shows its own statuses; the graph view draws the chain."""
    session_id = done["session_id"]
    truth = backend.inspect(session_id)
    driver.get(f"{url}#/session/{session_id}")
    wait_for(driver, "#results")
    wait_for(driver, "h1", done["session_id"])
    # Timeline: one row per render kept, in order, with its mode.
    rows = cells(driver, "timeline")
    assert [int(r["render"]) for r in rows] == [r["n"] for r in truth["renders"]]
    assert [r["mode"] for r in rows] == [r["mode"] for r in truth["renders"]]
    assert {r["mode"] for r in rows} & {"append", "re-render"}, "the budget should make the renders selective"
    assert len(rows) >= READS + 2
    last = truth["renders"][-1]
    assert rows[-1]["kept"] == f"{last['kept']:,}" and rows[-1]["stubbed"] == f"{last['stubbed']:,}"
    # Results: the conversation's handles, r1..r7 (six reads, one grep), with the last render's statuses.
    results = cells(driver, "results")
    assert [r["handle"] for r in results] == [f"r{i}" for i in range(1, READS + 2)]
    assert [r["tool"] for r in results] == ["read_file"] * READS + ["grep"]
    statuses = {r["handle"]: r["status"] for r in results}
    assert statuses == {r["handle"]: r["status"] for r in truth["results"]}
    # The stubs are those the last request forwarded upstream showed as stubs (nothing folds here).
    assert {h for (h, s) in statuses.items() if s == "stub"} == set(done["last_stubs"]) != set()
    assert "kept" in statuses.values()
    counts = {s: list(statuses.values()).count(s) for s in ("kept", "stub", "folded", "dropped", "compacted")}
    assert driver.find_element("id", "count-kept").text.endswith(f"{last['kept']:,}")
    assert counts["kept"] == last["kept"] and counts["stub"] + counts["folded"] + counts["dropped"] == last["omitted"]
    assert counts["stub"] == last["stubbed"] and counts["folded"] == last["folded"] == 0
    # r1 was reused by the grep: its reuse edges name the values.
    assert "ledger_0_3" in next(r["reuse edges"] for r in results if r["handle"] == "r1")
    # The restore the model asked, in the restores table and on its result's row.
    restores = cells(driver, "restores")
    assert [r["handle"] for r in restores] == [done["restored"]]
    assert next(r["restores"] for r in results if r["handle"] == done["restored"]) == "1"
    assert wait_for(driver, "#card-restores")[0].text.endswith("1")
    shoot(driver, f"{shots}session") if shots else None
    # An earlier render (the third): its statuses, from the log, and the note that says so.
    third = truth["renders"][2]
    driver.find_elements("css selector", f'#timeline tr[data-render="{third["n"]}"]')[0].click()
    wait_for(driver, "#render-title", f"Render #{third['n']}")
    wait_for(driver, "#older-note")
    earlier = {r["handle"]: r["status"] for r in cells(driver, "results")}
    expected = {r["handle"]: r["status"] for r in backend.inspect(done["session_id"], render=third["n"])["results"]}
    assert earlier == expected and "not rendered" in earlier.values()  # results after that render
    shoot(driver, f"{shots}render") if shots else None
    # The graph: the chain with its handles and statuses, the reuse and restore edges, a legend.
    driver.find_element("id", "tab-graph").click()
    svg = wait_for(driver, "#graph svg")[0]
    text = svg.text
    for handle, status in statuses.items():
        assert f"{handle} " in text and status in text
    assert "reuses w=" in text and "restore at turn" in text and "legend" in text
    assert "shelf" not in text
    shoot(driver, f"{shots}graph") if shots else None


# ---------------------------------------------------------------- on the proxy


def test_the_proxy_inspector_draws_a_tool_using_conversation(browser, engine):
    with FakeUpstream() as upstream, LoopbackServer(create_app(engine, upstream.base_url, BUDGET)) as proxy:
        engine.configure("billing-run", **SETTINGS)
        engine.ingest("an-idle-session", [user("hello")])
        done = play(proxy.url, upstream, "billing-run")
        wait_until_stored(engine, "billing-run", len(done["messages"]) - 1)
        url = f"{proxy.url}/contextrender/"
        browser.get(url)
        listed = wait_for(browser, "#sessions")
        rows = cells(browser, "sessions")
        assert {r["session"] for r in rows} == {"billing-run", "an-idle-session"}
        assert next(r for r in rows if r["session"] == "billing-run")["events"] == str(engine.get_session("billing-run")["events"])
        shoot(browser, "proxy-sessions")
        assert listed
        check_session_page(browser, url, engine, done, shots="proxy-")
        # A session that does not exist: the page says so.
        browser.get(f"{url}#/session/no-such-session")
        assert "no-such-session" in wait_for(browser, "#error")[0].text


def walkthrough(proxy_url: str) -> list[dict]:
    """README.md's walkthrough: the fake model reads a file at every call, B = 600, 12 rounds;
    the oldest turns fold behind the marker. Returns the agent's messages."""
    messages = [{"role": "user", "content": "Fix the bug in src/."}]
    with httpx.Client(base_url=proxy_url, timeout=60) as http:
        for n in range(1, 13):
            response = http.post("/v1/chat/completions", headers={SESSION_HEADER: "walkthrough"}, json={"model": "fake", "messages": messages})
            assert response.status_code == 200, response.text
            answer = response.json()["choices"][0]["message"]
            text = "files: " + " ".join(f"src/module_{k}.py" for k in range(2, 13)) if n == 1 else f"def step_{n}(x):\n" + "    x = x + 1\n" * 20
            messages += [{k: v for k, v in answer.items() if v is not None}, {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"], "content": text}]
    return messages


def test_the_inspector_shows_each_result_as_the_forwarded_request_showed_it(browser, engine):
    """After the walkthrough, every result's status on the page is what the last request the
    proxy forwarded showed: in full (kept), a stub naming its handle, or absent behind the fold
    marker (folded); the tiles count them, each row says why, and the page shows the messages as
    the model received them, the marker included (the page said "stubbed 8" and "did
    not fit: needs 0 tokens" for the seven folded results)."""
    with FakeUpstream(default_tool="read_file") as upstream, LoopbackServer(create_app(engine, upstream.base_url, 600)) as proxy:
        messages = walkthrough(proxy.url)
        forwarded = httpx.get(upstream.base_url.rsplit("/v1", 1)[0] + "/_fake/last").json()["messages"]
        wait_until_stored(engine, "walkthrough", len(messages) - 1)
        originals = {m["tool_call_id"]: m["content"] for m in messages if m["role"] == "tool"}
        sent = {m["tool_call_id"]: m["content"] for m in forwarded if m["role"] == "tool"}
        browser.get(f"{proxy.url}/contextrender/#/session/walkthrough")
        wait_for(browser, "#received")
        rows = cells(browser, "results")
        assert len(rows) == 11
        for row in rows:
            call_id = next(r["call_id"] for r in engine.inspect("walkthrough")["results"] if r["handle"] == row["handle"])
            if call_id not in sent:
                expected = "folded"
            elif sent[call_id] == originals[call_id]:
                expected = "kept"
            else:
                assert f'handle "{row["handle"]}"' in sent[call_id]
                expected = "stub"
            assert row["status"] == expected, (row, sent.get(call_id, "")[:80])
        statuses = [r["status"] for r in rows]
        assert statuses.count("folded") >= 1
        # The task above the marker (which folds what lies between).
        assert forwarded[0] == messages[0]
        assert forwarded[1]["role"] == "user" and forwarded[1]["content"].startswith("[ContextRender")  # the marker
        # The tiles count what the model met.
        assert browser.find_element("id", "count-stubbed").text.endswith(str(statuses.count("stub")))
        assert browser.find_element("id", "count-folded-results").text.endswith(str(statuses.count("folded")))
        # Each folded row says it is folded, not that it "did not fit".
        for row in rows:
            if row["status"] == "folded":
                assert row["reason"].startswith("folded behind the marker") and "did not fit" not in row["reason"]
            if row["status"] == "stub":
                assert "stub" in row["reason"]
        # What the model received: the forwarded history, message by message, the task and the marker first.
        received = cells(browser, "received")
        history = [m for m in forwarded if m["role"] != "system"]
        assert [r["role"] for r in received] == [m["role"] for m in history]
        assert received[1]["kind"] == "marker" and forwarded[1]["content"] in received[1]["text"]
        for r, m in zip(received, history):
            if m["role"] == "tool":
                assert r["kind"] in ("kept", "stub", "compacted") and m["content"] in r["text"]
        shoot(browser, "walkthrough")


def test_the_proxy_inspector_answers_loopback_only(engine):
    app = create_app(engine, "http://127.0.0.1:9/v1", BUDGET)
    with LoopbackServer(app) as proxy:
        ok = httpx.post(f"{proxy.url}/contextrender/walker/list_sessions", json={})
        assert ok.status_code == 200 and ok.json()["ok"] is True
        # A page on another site whose name was rebound to 127.0.0.1 names its own host.
        rebound = httpx.post(f"{proxy.url}/contextrender/walker/list_sessions", json={}, headers={"host": "evil.example:8800"})
        assert rebound.status_code == 403 and "loopback host" in rebound.json()["error"]["message"]
        assert httpx.get(f"{proxy.url}/contextrender/", headers={"host": "evil.example"}).status_code == 403
        # Only the read endpoints; fields are checked; engine errors keep their status.
        assert httpx.post(f"{proxy.url}/contextrender/walker/delete_session", json={"session_id": "x"}).status_code == 404
        unknown = httpx.post(f"{proxy.url}/contextrender/walker/inspect_session", json={"session_id": "x", "oops": 1})
        assert unknown.status_code == 400 and "oops" in unknown.json()["error"]["message"]
        missing = httpx.post(f"{proxy.url}/contextrender/walker/inspect_session", json={"session_id": "nobody"})
        assert missing.status_code == 404 and "nobody" in missing.json()["error"]["message"]
        assert httpx.get(f"{proxy.url}/contextrender/inspector.js").headers["content-type"].startswith("text/javascript")
        assert httpx.get(f"{proxy.url}/contextrender/secrets.txt").status_code == 404
        # The page names its icon (none), so a browser asks no /favicon.ico, which the proxy forwards upstream.
        assert '<link rel="icon" href="data:,">' in httpx.get(f"{proxy.url}/contextrender/").text
    # A client on another interface (as a proxy bound to 0.0.0.0 would see it).
    from starlette.requests import Request

    remote = Request({"type": "http", "client": ("192.0.2.7", 5000), "headers": [(b"host", b"127.0.0.1:8800")]})
    assert "loopback clients only" in loopback_problem(remote)
    for host in (b"localhost:8800", b"[::1]:8800", b"127.0.0.1"):
        assert loopback_problem(Request({"type": "http", "client": ("127.0.0.1", 5000), "headers": [(b"host", host)]})) == ""
    with LoopbackServer(create_app(engine, "http://127.0.0.1:9/v1", BUDGET, inspect=False)) as proxy:
        assert httpx.get(f"{proxy.url}/contextrender/").status_code != 200  # forwarded upstream (unreachable)


# ---------------------------------------------------------------- on the server, two users


def test_the_server_inspector_shows_the_logged_in_users_own_sessions(browser, jac_server):
    suffix = secrets.token_hex(4)
    (alice, bob) = (f"alice-{suffix}", f"bob-{suffix}")
    password = secrets.token_urlsafe(12)
    clients = {}
    for name in (alice, bob):
        clients[name] = Client(jac_server.url)
        clients[name].register(name, password)
    clients[alice].configure("alice-run", **SETTINGS)
    clients[bob].ingest("bob-secret", [user("bob's private question"), assistant("bob's private answer")])
    # Alice's agent goes through a proxy whose backend is her client of the server.
    with FakeUpstream() as upstream, LoopbackServer(create_app(clients[alice], upstream.base_url, BUDGET)) as proxy:
        done = play(proxy.url, upstream, "alice-run")
        wait_until_stored(clients[alice], "alice-run", len(done["messages"]) - 1)
    url = f"{jac_server.url}/contextrender/"
    browser.get(url)
    browser.execute_script("sessionStorage.clear()")
    browser.get(url + "#/")
    wait_for(browser, "#login")
    shoot(browser, "server-login")
    browser.find_element("id", "username").send_keys(alice)
    browser.find_element("id", "password").send_keys("wrong password")
    browser.find_element("id", "login-button").click()
    wait_for(browser, "#login-status", "Login refused")
    browser.find_element("id", "password").clear()
    browser.find_element("id", "password").send_keys(password)
    browser.find_element("id", "login-button").click()
    wait_for(browser, "#sessions")
    assert [r["session"] for r in cells(browser, "sessions")] == ["alice-run"]
    check_session_page(browser, url, clients[alice], done, shots="server-")
    # Bob's session, asked for by name on Alice's page: unknown to her.
    browser.get(f"{url}#/session/bob-secret")
    error = wait_for(browser, "#error")[0].text
    assert "404" in error and "bob-secret" in error and "private" not in browser.page_source
    browser.get(f"{url}#/session/bob-secret/graph")
    assert "bob-secret" in wait_for(browser, "#error")[0].text and "private" not in browser.page_source
    # The data routes themselves: Alice's token reaches none of Bob's session; no token, no data.
    headers = {"authorization": f"Bearer {clients[alice].token}"}
    for walker, fields in (("inspect_session", {"session_id": "bob-secret"}),
                           ("export_graph", {"session_id": "bob-secret", "format": "svg"}),
                           ("export_graph", {"session_id": "bob-secret", "format": "dot"})):
        answer = httpx.post(f"{jac_server.url}/walker/{walker}", json=fields, headers=headers, timeout=60)
        assert answer.status_code == 404 and "private" not in answer.text
        assert httpx.post(f"{jac_server.url}/walker/{walker}", json=fields, timeout=60).status_code == 401
    assert "bob-secret" not in json.dumps(clients[alice].list_sessions())
    assert clients[bob].inspect("bob-secret")["session"]["events"] == 2  # Bob's own is there
    # Logging out forgets the token.
    browser.get(url + "#/")
    wait_for(browser, "#sessions")
    browser.find_element("id", "logout").click()
    wait_for(browser, "#login")


# ---------------------------------------------------------------- the render log and the picture, in-process


def reads(count: int) -> list[dict]:
    messages = [{"role": "system", "content": "agent"}, user("The invoice totals are wrong: find why.")]
    for i in range(count):
        messages.append(assistant(f"Reading part {i}.", call(f"read_{i}", "read_file", {"path": f"billing/part_{i}.py"})))
        messages.append(tool(f"read_{i}", file_body(i)))
    return messages


def test_the_render_log_keeps_what_each_render_sent(engine):
    engine.configure("log", **SETTINGS)
    sent = []
    for i in range(1, READS + 1):
        sent.append(engine.render("log", reads(i), budget=BUDGET))
    # A small step that uses a value of the newest read, which is in view (one of a result left out
    # would ask for a re-render: `reuse_rerender`).
    last = f"ledger_{READS - 1}_3"
    grep = [assistant(f"{last}?", call("grep_0", "grep", {"pattern": last})), tool("grep_0", f"part_{READS - 1}: {last}")]
    sent.append(engine.render("log", reads(READS) + grep, budget=BUDGET))  # small enough to append
    log = engine.inspect("log")["renders"]
    assert [r["n"] for r in log] == list(range(1, READS + 2))
    assert [r["mode"] for r in log] == [s.mode for s in sent]
    assert [(r["history_tokens"], r["full_history_tokens"], r["kept"], r["omitted"]) for r in log] == [
        (s.history_tokens, s.full_history_tokens, s.kept, s.omitted) for s in sent]
    # Statuses: one per result of the render, as many kept and omitted as it counted.
    for r in log:
        detail = engine.inspect("log", render=r["n"])
        statuses = [x["status"] for x in detail["results"]]
        omitted = statuses.count("stub") + statuses.count("folded") + statuses.count("dropped")
        assert statuses.count("kept") == r["kept"] and omitted == r["omitted"] and statuses.count("stub") == r["stubbed"]
        assert statuses.count("not rendered") == READS + 1 - r["results"]
    # The cache: an append repeats the whole previous request; a re-render shares less of it.
    for before, now in zip(log, log[1:]):
        assert 0 <= now["cached_tokens"] <= now["history_tokens"]
        if now["mode"] in ("append", "passthrough"):
            assert now["cached_tokens"] >= before["history_tokens"]
        assert now["cost"] <= now["full_cost"] or now["mode"] == "passthrough"
    assert log[0]["cached_tokens"] is None and log[0]["cache_share"] is None  # no request before it
    assert {"append", "re-render"} <= {r["mode"] for r in log}
    # The same history again (a retried call) adds nothing; a new budget is a new render.
    engine.render("log", reads(READS) + grep, budget=BUDGET)
    assert len(engine.inspect("log")["renders"]) == READS + 1
    engine.render("log", reads(READS) + grep, budget=BUDGET + 1)
    assert [r["budget"] for r in engine.inspect("log")["renders"]][-2:] == [BUDGET, BUDGET + 1]


def test_the_log_keeps_the_latest_renders_and_refuses_a_render_it_does_not_keep(engine):
    from walkers.renderlog import RENDER_LOG

    messages = reads(2)
    for i in range(RENDER_LOG + 3):
        engine.render("many", messages, budget=1000 + i)
    log = engine.inspect("many")["renders"]
    assert len(log) == RENDER_LOG and log[0]["n"] == 4 and log[-1]["n"] == RENDER_LOG + 3
    from contextrender.core import InvalidRequest

    with pytest.raises(InvalidRequest, match=r"keeps no render #2 \(renders kept: 4 to"):
        engine.inspect("many", render=2)
    with pytest.raises(InvalidRequest, match="render must be"):
        engine.inspect("many", render=-1)
    engine.ingest("unrendered", [user("hi")])
    empty = engine.inspect("unrendered")
    assert empty["renders"] == [] and empty["render"] is None and empty["results"] == []


def test_the_graph_picture_draws_the_chain_with_statuses_reuse_and_restores(engine):
    engine.configure("pic", **SETTINGS)
    messages = reads(READS)
    engine.render("pic", messages, budget=BUDGET)
    messages += [assistant("ledger_0_3 is wrong", call("grep_0", "grep", {"pattern": "ledger_0_3"})), tool("grep_0", "part_0: ledger_0_3")]
    rendered = engine.render("pic", messages, budget=BUDGET, explain=True)
    omitted = [d.handle for d in rendered.decisions if d.status == "omitted"]
    engine.restore("pic", omitted[0])
    dot = engine.export_graph("pic", format="dot")["dot"]
    shown = {r["handle"]: r["status"] for r in engine.inspect("pic")["results"]}
    for d in rendered.decisions:
        assert f"{d.handle} {d.tool_name}\\n{d.tokens} tok · {shown[d.handle]}" in dot
    assert "reuses w=" in dot and "ledger_0_3" in dot and "restore at turn" in dot and "cluster_legend" in dot
    assert "shelf" not in dot and "Session" not in dot
    svg = engine.export_graph("pic", format="svg")["svg"]
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg and f">{omitted[0]} read_file</text>" in svg
    small = engine.export_graph("pic", format="dot", limit=3)["dot"]
    assert f"{len(messages) - 1 - 3} earlier events not drawn" in small and "#0 user" not in small
    from contextrender.core import InvalidRequest

    with pytest.raises(InvalidRequest, match="json, dot, svg, jac-dot"):
        engine.export_graph("pic", format="png")


def _with_session(store, session_id: str, change) -> None:
    """Run `change(session)` on the stored Session node in a context of its own, and commit."""
    from jaclang.jac0core.runtime import JacRuntime, JacUtils

    from walkers.session import find_session

    ctx = JacUtils.create_j_context(user_root=None, base_path_dir=str(store))
    token = JacRuntime.push_request_context(ctx)
    try:
        change(find_session(ctx.get_root(), session_id))
    finally:
        JacRuntime.reset_request_context(token)
        ctx.close()


def test_the_log_is_stored_as_one_text_and_a_log_stored_as_a_list_is_kept(tmp_path):
    """A list of 100 dicts on the Session made every render 3 times slower (jaclang serialises
    a node field by field at each load and commit): the log is one JSON text. A session stored
    with the list shows it, and its next render moves it to the text."""
    from contextrender import Engine
    from walkers.renderlog import log_text

    store = tmp_path / "store"
    engine = Engine(store)
    for i in range(3):
        engine.render("old", reads(2), budget=1000 + i)
    before = engine.inspect("old")["renders"]
    engine.close()
    stored: dict = {}
    _with_session(store, "old", lambda s: stored.update(text=log_text(s), listed=list(s.renders)))
    assert stored["listed"] == [] and [e["n"] for e in json.loads(stored["text"])] == [1, 2, 3]

    def as_list(session) -> None:
        (session.renders, session.render_log) = (json.loads(log_text(session)), "")

    _with_session(store, "old", as_list)
    engine = Engine(store)
    assert engine.inspect("old")["renders"] == before
    engine.render("old", reads(2), budget=2000)
    after = engine.inspect("old")["renders"]
    assert after[:3] == before and after[-1]["n"] == 4 and after[-1]["budget"] == 2000
    engine.close()
    _with_session(store, "old", lambda s: stored.update(text=log_text(s), listed=list(s.renders)))
    assert stored["listed"] == [] and [e["n"] for e in json.loads(stored["text"])] == [1, 2, 3, 4]


def test_the_log_text_is_written_from_its_kept_entries_and_read_again_when_another_process_wrote_it(tmp_path):
    """A render appends its entry to the entries' texts the cached index keeps (parsing and
    writing the whole log at every render cost half a millisecond at 100 entries): the stored
    text is still json.dumps of the entries, and a text some other process wrote (the index in
    this process's cache unchanged) is read again, not overwritten with the kept copy."""
    from contextrender import Engine
    from walkers.renderlog import RENDER_LOG, log_text

    store = tmp_path / "store"
    engine = Engine(store)
    for i in range(RENDER_LOG + 2):
        engine.render("kept", reads(2), budget=1000 + i)
    stored: dict = {}
    _with_session(store, "kept", lambda s: stored.update(text=log_text(s)))
    entries = json.loads(stored["text"])
    assert stored["text"] == json.dumps(entries) and [e["n"] for e in entries] == list(range(3, RENDER_LOG + 3))

    def rewrite(session) -> None:  # as another server process would: its own, shorter log
        session.render_log = json.dumps([dict(e, n=e["n"] + 1000) for e in entries[:5]])

    _with_session(store, "kept", rewrite)
    engine.render("kept", reads(2), budget=5000)
    _with_session(store, "kept", lambda s: stored.update(text=log_text(s)))
    after = json.loads(stored["text"])
    assert stored["text"] == json.dumps(after)
    assert [e["n"] for e in after] == [1003, 1004, 1005, 1006, 1007, 1008] and after[-1]["budget"] == 5000
    assert engine.inspect("kept")["renders"][-1]["n"] == 1008
    engine.close()


def test_the_log_is_stored_packed_and_a_log_stored_as_plain_text_is_read_and_packed_at_the_next_render(tmp_path):
    """The log's JSON text is stored compressed (jaclang passes over the Session's fields about
    seven times a call, and the proxy's every request loads it twice): the stored field is a
    fraction of the text, which it gives back exactly. A session stored with the plain text
    (before the log was packed) shows the same log, and its next render stores it packed."""
    from contextrender import Engine
    from walkers.renderlog import PACKED_LOG, RENDER_LOG, log_text

    store = tmp_path / "store"
    engine = Engine(store)
    for i in range(RENDER_LOG):
        engine.render("packed", reads(2), budget=1000 + i)
    shown = engine.inspect("packed")["renders"]
    engine.close()
    stored: dict = {}
    _with_session(store, "packed", lambda s: stored.update(field=s.render_log, text=log_text(s)))
    before = json.loads(stored["text"])
    assert stored["field"].startswith(PACKED_LOG) and len(stored["field"]) * 4 < len(stored["text"])
    assert stored["text"] == json.dumps(before) and [e["n"] for e in before] == list(range(1, RENDER_LOG + 1))

    def as_plain(session) -> None:  # as a session stored before the log was packed
        session.render_log = json.dumps(before)

    def as_packed_before(session) -> None:  # packed by zlib.compress at level 1, as before PACK_MEMORY
        session.render_log = PACKED_LOG + base64.b64encode(zlib.compress(json.dumps(before).encode("utf-8"), 1)).decode("ascii")

    _with_session(store, "packed", as_packed_before)
    engine = Engine(store)
    assert engine.inspect("packed")["renders"] == shown
    engine.close()
    _with_session(store, "packed", as_plain)
    engine = Engine(store)
    assert engine.inspect("packed")["renders"] == shown
    engine.render("packed", reads(2), budget=5000)
    engine.close()
    _with_session(store, "packed", lambda s: stored.update(field=s.render_log, text=log_text(s)))
    after = json.loads(stored["text"])
    assert stored["field"].startswith(PACKED_LOG) and after[:-1] == before[1:] and after[-1]["budget"] == 5000


def test_the_log_is_packed_in_parts_and_a_render_packs_only_the_parts_it_changed(monkeypatch):
    """The stored log is its JSON text packed in parts of LOG_PART entries (by their numbers): it
    reads back as the whole text, a log of one part is stored as the whole text packed (as before
    the parts), and a render packs its newest part and, while the log slides, its oldest, the
    others taken from the last render's; a log read from the store (nothing kept) is packed
    whole."""
    import random
    from types import SimpleNamespace

    from walkers import renderlog
    from walkers.renderlog import LOG_PART, RENDER_LOG, log_text, pack_log, pack_parts

    calls: list[str] = []

    def counted(text: str) -> str:
        calls.append(text)
        return pack_log(text)

    monkeypatch.setattr(renderlog, "pack_log", counted)
    rng = random.Random(5)
    (texts, kept) = ([], {})
    for n in range(1, RENDER_LOG + 3 * LOG_PART + 7):
        entry = {"n": n, "statuses": f"k{rng.randrange(9)}f{rng.randrange(300)}", "reason": "x" * rng.randrange(400)}
        texts = (texts + [json.dumps(entry)])[-RENDER_LOG:]
        calls.clear()
        (stored, kept) = pack_parts(texts, n - len(texts) + 1, kept)
        whole = "[" + ", ".join(texts) + "]"
        assert log_text(SimpleNamespace(render_log=stored)) == whole
        if n <= LOG_PART:
            assert stored == pack_log(whole)
        # The newest part; the one before when this entry begins a part (it loses the log's
        # "]"); the oldest while the log slides (it lost an entry, or became the first).
        assert len(calls) == 1 + (n > 1 and (n - 1) % LOG_PART == 0) + (n > RENDER_LOG)
    calls.clear()
    (again, _) = pack_parts(texts, n - len(texts) + 1, {})
    assert again == stored and len(calls) == len(stored.split(",")) == 6


def test_status_code_reads_what_the_model_met_and_expands_back():
    """The statuses of a render, one letter a result, read from the rendered messages and
    run-length coded: compared with a plain per-result reading on random renders (results sent
    whole, compacted or as stubs; the others folded before the fold's end, dropped after it), and
    expanded back to the statuses."""
    import random
    from types import SimpleNamespace

    from walkers.renderlog import expand_statuses, status_code, status_counts

    names = {"k": "kept", "c": "compacted", "s": "stub", "f": "folded", "d": "dropped"}
    rng = random.Random(7)
    for results in (0, 1, 2, 5, 60, 300):
        for trial in range(20):
            events = sorted(rng.sample(range(1, 4 * results + 2), results))
            stored = [{"role": "tool", "tool_call_id": f"c{r}", "content": f"result {r}"} for r in range(results)]
            fold_start = rng.choice([0, rng.randint(0, 4 * results + 2)])
            sent, letters = [], []
            for r in range(results):
                folded = events[r] < fold_start
                way = rng.choice("kcsx" if trial % 2 else "kkkcsx")
                if way == "x":
                    letters.append("f" if folded else "d")
                    continue
                letters.append(way)
                sent.append(stored[r] if way == "k" and rng.random() < 0.5 else
                            {**stored[r], "content": stored[r]["content"] if way == "k" else f"[{way} of {r}]"})
            messages = [{"role": "system", "content": "s"}] + sent + [{"role": "tool", "tool_call_id": "restore-1", "content": "x"}]
            index = SimpleNamespace(answered={f"c{r}": r for r in range(results)}, result_event=events,
                                    messages={e: stored[r] for r, e in enumerate(events)})
            plan = SimpleNamespace(compacted={r: {} for r in range(results) if letters[r] == "c"}, verbatim_start=lambda: fold_start)
            runs: list[list] = []
            for letter in letters:
                if runs and runs[-1][0] == letter:
                    runs[-1][1] += 1
                else:
                    runs.append([letter, 1])
            code = status_code(plan, SimpleNamespace(selected=True, results=results, messages=messages), index)
            assert code == "".join(f"{letter}{n}" for letter, n in runs)
            assert expand_statuses(code) == [names[letter] for letter in letters]
            assert status_counts(code) == {k: letters.count(k) for k in set(letters)}
    assert status_code(None, SimpleNamespace(selected=False, results=4, messages=[]), None) == "k4"
    assert expand_statuses("k2o3") == ["kept", "kept", "omitted", "omitted", "omitted"]  # a log written before
