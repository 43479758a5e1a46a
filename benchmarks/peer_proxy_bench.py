"""The proxy's cost per request against a peer's: ContextRender's proxy and ctxkeeper 1.2.0 (PyPI)
on the same long coding conversations, against the same fake upstream.

    .venv/bin/python benchmarks/peer_proxy_bench.py [--conversations 4] [--budget 6000] [--rounds 2] [--checkout PATH]

ctxkeeper is installed from PyPI (`pip install ctxkeeper==1.2.0`) into its own venv,
.cache/ctxkeeper-venv, on first use. On loopback: the fake upstream (contextrender.testing.fake_upstream,
in this process, answering each request with the recorded assistant message that followed it),
the proxy under test (its own process), and this client, which replays the longest `--conversations` conversations of
../shared/traces/mini_swe_agent_deepseek.jsonl turn by turn: before each recorded assistant
message, the history up to it is sent as a chat-completions request (each conversation a session
of its own, named by the `X-ContextRender-Session` header; `--unnamed`: no header, each session
derived from the conversation's start). The proxies run one after the other,
alternated, `--rounds` times, each on a fresh state folder.

Per proxy and round it prints: the proxy process's CPU time (user + system, from /proc) per
forwarded request, the time in the proxy per request (the round trip through it less the round
trip straight to the upstream with the body the upstream received, sent right after) p50 and p95,
and the ratio of ours to ctxkeeper's (target: CPU per request no more than ctxkeeper's): the
ratio of the medians, and each round's own ratio with their median (a round's runs follow each
other; the machine drifts between rounds).

`--engine-only` leaves HTTP out: the same conversations through an `Engine` in this process, with
the proxy's calls (the render of each request, carrying the usage report of the answer it re-sends,
which it stores; the last answer of a conversation, never re-sent, ingested alone after its
request's events with its report), under the proxy's promise never to change a message it sent
(`sent_unchanged`; each message's normal form made once a conversation and sent again, as the
proxy keeps them: before 2026-12-07's fourth merge each request's history was made afresh and
compared by value, about 0.13 ms a request the proxy does not pay), and prints the CPU time of each per request, and the median
render's by mode (append, re-render, passthrough); with `--checkout`, alternated with the same run
in a process of that checkout (its .venv, in its folder: an older checkout's proxy made two calls
a request, the render and the answer's ingestion), each round of each checkout in a fresh process
(until 2026-12-07 this checkout's rounds ran in one process, warmed by its first round: its
ratios to the other leaned its way), and the medians and their ratio at the end.

`--checkout PATH` adds a third proxy, ContextRender from another checkout (run by that checkout's
.venv), alternated with the two others in every round: a before/after comparison in one run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkouts import REPO, in_turn, program, run_in  # noqa: E402
from proxy_bench import cpu_seconds, percentile, wait_up  # noqa: E402

from contextrender.testing.fake_upstream import FakeUpstream, free_port  # noqa: E402

TRACES = REPO.parent / "shared" / "traces"
CTXKEEPER = "ctxkeeper==1.2.0"
VENV = REPO / ".cache" / "ctxkeeper-venv"


def ctxkeeper_command() -> Path:
    """ctxkeeper's command in its own venv, installed from PyPI the first time."""
    command = VENV / "bin" / "ctxkeeper"
    if not command.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", CTXKEEPER], check=True)
    return command


def conversations(count: int) -> list[tuple[str, list[dict]]]:
    """The `count` longest recorded coding conversations (by assistant turns)."""
    with open(TRACES / "mini_swe_agent_deepseek.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows.sort(key=lambda row: -sum(1 for m in row["messages"] if m["role"] == "assistant"))
    return [(row["id"], row["messages"]) for row in rows[:count]]


def start(name: str, upstream_url: str, port: int, budget: int, state: Path, checkout: Path | None = None) -> subprocess.Popen:
    if name != "ctxkeeper":
        folder = checkout.resolve() if name == "checkout" and checkout else REPO
        command = [program(folder), "-m", "contextrender.cli", "proxy", "--upstream", f"{upstream_url}/v1",
                   "--budget", str(budget), "--port", str(port)]
        env = dict(os.environ, CONTEXTRENDER_STORE=str(state))
        return subprocess.Popen(command, env=env, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    command = [str(ctxkeeper_command()), "--upstream", upstream_url, "--host", "127.0.0.1", "--port", str(port),
               "--budget", str(budget), "--state-dir", str(state)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def replay(name: str, fake: FakeUpstream, budget: int, talks: list[tuple[str, list[dict]]], checkout: Path | None = None,
           unnamed: bool = False) -> dict:
    upstream_url = fake.base_url.removesuffix("/v1")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix=f"peer-{name}-") as state:
        proxy = start(name, upstream_url, port, budget, Path(state), checkout)
        try:
            wait_up(f"{url}/v1/models", proxy, timeout=180)
            with httpx.Client(timeout=300) as client:
                # One unmeasured request: the proxy's models load on first use.
                client.post(f"{url}/v1/chat/completions", headers={} if unnamed else {"X-ContextRender-Session": "warm-up"},
                            json={"model": "fake-model", "messages": [{"role": "user", "content": "hello"}]})
                in_proxy: list[float] = []
                cpu_before = cpu_seconds(proxy.pid)
                for (tag, messages) in talks:
                    for j, message in enumerate(messages):
                        if message["role"] != "assistant" or j == 0:
                            continue
                        body = {"model": "fake-model", "messages": messages[:j], "temperature": 0}
                        # The upstream answers what the agent's model answered, so the next
                        # request's history holds the answer the proxy forwarded.
                        fake.enqueue(message.get("content"), message.get("tool_calls"))
                        began = time.perf_counter()
                        response = client.post(f"{url}/v1/chat/completions", json=body,
                                               headers={} if unnamed else {"X-ContextRender-Session": f"peer-{tag}"[:200]})
                        through = time.perf_counter() - began
                        assert response.status_code == 200, response.text[:300]
                        forwarded = client.get(f"{upstream_url}/_fake/last", params={"path": "/v1/chat/completions"}).content
                        began = time.perf_counter()
                        client.post(f"{upstream_url}/v1/chat/completions", content=forwarded,
                                    headers={"content-type": "application/json"})
                        in_proxy.append(through - (time.perf_counter() - began))
                cpu = cpu_seconds(proxy.pid) - cpu_before
        finally:
            proxy.terminate()
            proxy.wait(timeout=30)
    return {"requests": len(in_proxy), "cpu_ms": cpu * 1000 / len(in_proxy),
            "p50": percentile(in_proxy, 0.5), "p95": percentile(in_proxy, 0.95)}


def engine_only(budget: int, talks: list[tuple[str, list[dict]]]) -> dict:
    """The proxy's Engine calls for each request, in this process: CPU ms per request of each."""
    from contextrender import Engine
    from contextrender.core import normal_form
    from contextrender.proxy.defaults import DEFAULT_SELECTOR
    from contextrender.proxy.sessions import chain_events

    try:  # the proxy's promise never to change a message it sent (since 6e2af03)
        from contextrender.proxy.interfaces import sent_unchanged
    except ImportError:  # an older checkout: its proxy made no promise

        def sent_unchanged(call, *args, **kwargs):
            return call(*args, **kwargs)

    with tempfile.TemporaryDirectory(prefix="peer-engine-") as state:
        engine = Engine(state)
        engine.warm_up()
        (render, ingest, requests, by_mode) = (0.0, 0.0, 0, {})
        usage = {"input_tokens": 1000, "output_tokens": 100, "estimated_input_tokens": 1000}
        for (tag, messages) in talks:
            session = f"peer-{tag}"[:200]
            turns = [j for (j, message) in enumerate(messages) if message["role"] == "assistant" and j > 0]
            # Each message's normal form made once and sent again at every later request, as the
            # proxy keeps them (`Bodies.parse` keeps the parsed prefix, `Sessions.reconcile` the
            # normal forms and answers), under its promise: the engine compares them by identity.
            forms = [normal_form(m) for m in messages]
            for j in turns:
                began = time.process_time()
                # The previous answer (in the history sent) and its report, stored by this render.
                result = sent_unchanged(engine.render, session, forms[:j], budget=budget, selector=DEFAULT_SELECTOR,
                                        **({"usage": usage} if j != turns[0] else {}))
                spent = time.process_time() - began
                render += spent
                by_mode.setdefault(result.mode, []).append(spent)
                requests += 1
            # The last answer, which no request re-sends: alone, as the proxy stores it.
            began = time.process_time()
            answer = normal_form({k: messages[turns[-1]][k] for k in ("role", "content", "tool_calls") if k in messages[turns[-1]]})
            sent_unchanged(engine.ingest, session, [answer], append=True, at=chain_events(forms[:turns[-1]]), usage=usage)
            ingest += time.process_time() - began
        engine.close()
    return {"requests": requests, "render_ms": render * 1000 / requests, "ingest_ms": ingest * 1000 / requests,
            "modes": {mode: (len(times), statistics.median(times) * 1000) for mode, times in sorted(by_mode.items())}}


def engine_rounds(args: argparse.Namespace, talks: list[tuple[str, list[dict]]]) -> None:
    """`--engine-only`: the rounds in this process; with `--checkout`, each round of each checkout in
    a fresh process of its own, alternated (in one process, the rounds after the first meet the
    caches the first warmed: a checkout run that way is favoured against one started afresh)."""
    if not args.checkout:
        for round_ in range(1, args.rounds + 1):
            row = engine_only(args.budget, talks)
            print(f"round {round_}, {REPO}: {row['requests']} requests, Engine CPU per request {row['render_ms'] + row['ingest_ms']:.2f} ms "
                  f"(the render {row['render_ms']:.2f}, the answer's ingestion {row['ingest_ms']:.2f}; the render by mode: "
                  + ", ".join(f"{mode} {n} median {ms:.2f} ms" for mode, (n, ms) in row["modes"].items()) + ")  "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
        return
    one_round = ["--engine-only", "--rounds", "1", "--conversations", str(args.conversations), "--budget", str(args.budget)]
    cpu: dict[Path, list[float]] = {REPO: [], args.checkout.resolve(): []}
    for round_ in range(1, args.rounds + 1):
        for folder in in_turn(round_ - 1, *cpu):
            printed = run_in(folder, __file__, one_round).strip().split(": ", 1)[1]
            print(f"round {round_}, {folder}: {printed}", flush=True)
            cpu[folder].append(float(re.search(r"Engine CPU per request ([0-9.]+) ms", printed).group(1)))
    (ours, theirs) = (statistics.median(figures) for figures in cpu.values())
    print(f"Engine CPU per request, medians of {args.rounds} fresh processes each: {REPO} {ours:.2f} ms, "
          f"{args.checkout} {theirs:.2f} ms, this checkout / it x{ours / theirs:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--budget", type=int, default=6000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--checkout", type=Path, help="also run ContextRender from this checkout (with its .venv), alternated")
    parser.add_argument("--engine-only", action="store_true", help="the proxy's Engine calls in this process, no HTTP")
    parser.add_argument("--unnamed", action="store_true",
                        help="send no X-ContextRender-Session header: each conversation's session derived from its start, as for an agent that names none")
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    talks = conversations(args.conversations)
    if args.engine_only:
        engine_rounds(args, talks)
        return
    names = ["contextrender", "ctxkeeper"] + (["checkout"] if args.checkout else [])
    figures: dict[str, list[dict]] = {name: [] for name in names}
    ctxkeeper_command()
    with FakeUpstream() as fake:
        for round_ in range(1, args.rounds + 1):
            for name in in_turn(round_ - 1, *names):
                fake.requests.clear()
                row = replay(name, fake, args.budget, talks, args.checkout, args.unnamed)
                figures[name].append(row)
                load = os.getloadavg()[0]
                print(f"round {round_}, {name:13}: {row['requests']} requests, CPU {row['cpu_ms']:6.1f} ms per request, "
                      f"time in the proxy p50 {row['p50']:6.1f} ms, p95 {row['p95']:6.1f} ms  (load {load:.1f})", flush=True)
    ours, peer = figures["contextrender"], figures["ctxkeeper"]
    cpu = (statistics.median(r["cpu_ms"] for r in ours), statistics.median(r["cpu_ms"] for r in peer))
    p50 = (statistics.median(r["p50"] for r in ours), statistics.median(r["p50"] for r in peer))
    print(f"medians over {args.rounds} rounds, {len(talks)} conversations, B = {args.budget}:")
    print(f"  CPU per forwarded request: ContextRender {cpu[0]:.1f} ms, ctxkeeper {cpu[1]:.1f} ms, ratio {cpu[0] / cpu[1]:.2f}")
    # Each round's runs are minutes apart, a round's two figures seconds apart: the ratio within a
    # round leaves out the machine's drift between rounds (on the shared cores a proxy's figure
    # moves by a quarter from one round to the next).
    paired = [a["cpu_ms"] / b["cpu_ms"] for (a, b) in zip(ours, peer)]
    print(f"  CPU ratio within each round: {', '.join(f'{r:.2f}' for r in paired)} (median {statistics.median(paired):.2f})")
    print(f"  time in the proxy p50:     ContextRender {p50[0]:.1f} ms, ctxkeeper {p50[1]:.1f} ms, ratio {p50[0] / p50[1]:.2f}")
    if args.checkout:
        other = figures["checkout"]
        (cpu_b, p50_b) = (statistics.median(r["cpu_ms"] for r in other), statistics.median(r["p50"] for r in other))
        print(f"  {args.checkout}: CPU per forwarded request {cpu_b:.1f} ms (ratio to ctxkeeper {cpu_b / cpu[1]:.2f}; "
              f"this checkout / it {cpu[0] / cpu_b:.2f}), time in the proxy p50 {p50_b:.1f} ms")
        paired = [a["cpu_ms"] / b["cpu_ms"] for (a, b) in zip(ours, other)]
        print(f"  this checkout / it within each round: {', '.join(f'{r:.2f}' for r in paired)} (median {statistics.median(paired):.2f})")


if __name__ == "__main__":
    main()
