"""Proxy overhead: time a conversation request spends in the proxy, the upstream excluded.

    .venv/bin/python benchmarks/proxy_bench.py [--requests 60] [--results 150] [--budget 6000]
        [--protocol chat|anthropic|responses] [--checkout PATH [--alternate 4]]

Three processes on loopback: the fake upstream (`python -m contextrender.testing.fake_upstream`,
an instant canned answer: one tool call), the proxy as users start it (`contextrender proxy`, the
engine in-process on a fresh store), and this client. The client plays an agent loop on a
session that starts with `--results` real tool results from ../shared/traces (the first request
ingests them; not measured): each request sends the whole conversation, the upstream answers with
a tool call, the client appends that answer and a tool result, and sends again. `--protocol` picks
the API: chat completions (`/v1/chat/completions`), Anthropic Messages (`/v1/messages`, the same
conversation as Messages turns, a Claude model name) or OpenAI Responses (`/v1/responses`).

Per request, overhead = (round trip through the proxy) - (round trip straight to the upstream with
the body the upstream received from the proxy, sent right after). It covers the proxy's HTTP
handling, the render (with the ingestion of the new events), the forwarding, and the ingestion of
the previous answer when it lands on the request path. Prints p50/p95 over the requests, and the
proxy process's CPU time per request (user + system, from /proc: steadier than the times on a
loaded machine).

`--checkout PATH`: the proxy of another checkout too (its .venv, in its folder; the fake upstream
and the client stay this checkout's), `--alternate` pairs of runs, the order swapped at each pair,
with the medians of both.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkouts import REPO, in_turn, program  # noqa: E402
from engine_bench import history, trace_turns  # noqa: E402

from contextrender.testing.fake_upstream import free_port  # noqa: E402


class Chat:
    path, model = "/v1/chat/completions", "fake-model"

    def __init__(self, messages: list[dict]) -> None:
        self.messages = messages

    def body(self) -> dict:
        return {"model": self.model, "messages": self.messages, "temperature": 0}

    def answered(self, answer: dict, result: str) -> None:
        message = answer["choices"][0]["message"]
        self.messages = self.messages + [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": result}]

    def size(self, body: dict) -> int:
        return len(body["messages"])


class Anthropic(Chat):
    path, model = "/v1/messages", "claude-sonnet-4-5"

    def __init__(self, messages: list[dict]) -> None:
        from tests.conftest import anthropic_conversation  # (the tests' helpers import pytest: only for this protocol)

        self.system, self.messages = anthropic_conversation(messages, thinking=False)

    def body(self) -> dict:
        return {"model": self.model, "max_tokens": 1024, "system": self.system, "messages": self.messages}

    def answered(self, answer: dict, result: str) -> None:
        call = next(b for b in answer["content"] if b["type"] == "tool_use")
        self.messages = self.messages + [{"role": "assistant", "content": answer["content"]},
                                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": result}]}]


class Responses(Chat):
    path, model = "/v1/responses", "fake-model"

    def __init__(self, messages: list[dict]) -> None:
        from tests.conftest import responses_input  # (the tests' helpers import pytest: only for this protocol)

        self.instructions, self.messages = responses_input(messages)

    def body(self) -> dict:
        return {"model": self.model, "instructions": self.instructions, "input": self.messages}

    def answered(self, answer: dict, result: str) -> None:
        call = next(i for i in answer["output"] if i["type"] == "function_call")
        self.messages = self.messages + answer["output"] + [{"type": "function_call_output", "call_id": call["call_id"], "output": result}]

    def size(self, body: dict) -> int:
        return len(body["input"])


PROTOCOLS = {"chat": Chat, "anthropic": Anthropic, "responses": Responses}


def wait_up(url: str, process: subprocess.Popen, log: Path | None = None, timeout: float = 90) -> None:
    """Waits until `url` answers; if `process` exits first, stops with its output (`log`, the file
    it writes to, or the pipe it was given)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            httpx.get(url, timeout=2)
            return
        except httpx.TransportError:
            if process.poll() is not None:
                output = log.read_text(errors="replace") if log else process.stdout.read().decode() if process.stdout else ""
                raise SystemExit(f"{process.args} exited: {output}")
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} did not come up")
            time.sleep(0.2)


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a live process (and its reaped children), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1000


def measure(args: argparse.Namespace, checkout: Path, pairs: list, messages: list[dict]) -> dict:
    """One run: a fresh fake upstream and the proxy of `checkout` (its .venv, in its folder) on a
    fresh store; the client plays the agent loop. The figures, printed and returned."""
    upstream_port, proxy_port = free_port(), free_port()
    upstream_url = f"http://127.0.0.1:{upstream_port}"
    proxy_url = f"http://127.0.0.1:{proxy_port}"
    store = tempfile.mkdtemp(prefix="proxy-bench-")
    env = dict(os.environ, CONTEXTRENDER_STORE=store)
    # Their logs go to files in the store's folder: a pipe nobody reads fills after a few hundred
    # requests' log lines and the proxy then blocks writing one.
    upstream_log, proxy_log = Path(store) / "upstream.log", Path(store) / "proxy.log"
    with upstream_log.open("wb") as out:
        upstream = subprocess.Popen(
            [sys.executable, "-m", "contextrender.testing.fake_upstream", "--port", str(upstream_port), "--tool", "bash"],
            stdout=out, stderr=subprocess.STDOUT,
        )
    with proxy_log.open("wb") as out:
        proxy = subprocess.Popen(
            [program(checkout), "-m", "contextrender.cli", "proxy",
             "--upstream", f"{upstream_url}/v1", "--budget", str(args.budget), "--port", str(proxy_port), "--selector", args.selector],
            env=env, cwd=checkout, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        wait_up(f"{upstream_url}/v1/models", upstream, upstream_log)
        wait_up(f"{proxy_url}/v1/models", proxy, proxy_log)
        conversation = PROTOCOLS[args.protocol](messages)
        with httpx.Client(timeout=120) as client:
            start = time.perf_counter()
            response = client.post(f"{proxy_url}{conversation.path}", json=conversation.body())
            assert response.status_code == 200, response.text
            answer = response.json()
            first = time.perf_counter() - start
            through, direct, overhead, sizes = [], [], [], []
            cpu_before = cpu_seconds(proxy.pid)
            for i in range(args.requests):
                conversation.answered(answer, pairs[(args.results + i) % len(pairs)][1]["content"])
                start = time.perf_counter()
                response = client.post(f"{proxy_url}{conversation.path}", json=conversation.body())
                t_proxy = time.perf_counter() - start
                assert response.status_code == 200, response.text
                answer = response.json()
                forwarded = client.get(f"{upstream_url}/_fake/last", params={"path": conversation.path}).content
                start = time.perf_counter()
                client.post(f"{upstream_url}{conversation.path}", content=forwarded, headers={"content-type": "application/json"})
                t_direct = time.perf_counter() - start
                through.append(t_proxy)
                direct.append(t_direct)
                overhead.append(t_proxy - t_direct)
                sizes.append(conversation.size(json.loads(forwarded)))
            cpu = cpu_seconds(proxy.pid) - cpu_before
    finally:
        for process in (proxy, upstream):
            process.terminate()
            process.wait(timeout=20)
        shutil.rmtree(store, ignore_errors=True)  # the run's store (each run left one behind)
    sent = conversation.size(conversation.body())
    results = args.results + args.requests
    print(f"proxy overhead ({args.protocol}, {conversation.path}), {args.requests} requests, session of {args.results} -> {results} results, "
          f"B = {args.budget}, selector {args.selector}, proxy of {checkout}")
    print(f"  first request (ingests the {args.results}-result history): {first * 1000:.0f} ms")
    print(f"  through the proxy  p50 {percentile(through, 0.5):6.2f} ms  p95 {percentile(through, 0.95):6.2f} ms")
    print(f"  upstream directly  p50 {percentile(direct, 0.5):6.2f} ms  p95 {percentile(direct, 0.95):6.2f} ms")
    print(f"  time in the proxy  p50 {percentile(overhead, 0.5):6.2f} ms  p95 {percentile(overhead, 0.95):6.2f} ms  (target p50 <= 5 ms, issue 30)")
    print(f"  the proxy's CPU per request {cpu * 1000 / args.requests:6.2f} ms  (user + system, /proc)")
    print(f"  messages (items) forwarded: median {statistics.median(sizes):.0f} of {sent} sent at the end", flush=True)
    return {"p50": percentile(overhead, 0.5), "cpu": cpu * 1000 / args.requests}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--results", type=int, default=150)
    parser.add_argument("--budget", type=int, default=6000)
    parser.add_argument("--selector", default="contextrender")
    parser.add_argument("--protocol", choices=sorted(PROTOCOLS), default="chat")
    parser.add_argument("--checkout", type=Path, help="also run the proxy of this checkout (its .venv), alternated")
    parser.add_argument("--alternate", type=int, default=1, help="pairs of runs with --checkout (the order swapped at each)")
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the client's own line per call, not the proxy's

    pairs = trace_turns()
    messages = history(pairs, args.results)[:-1]  # an agent loop: the history ends with a tool result
    if not args.checkout:
        measure(args, REPO, pairs, messages)
        return
    other = args.checkout.resolve()
    runs: dict[Path, list[dict]] = {REPO: [], other: []}
    for pair in range(args.alternate):
        for checkout in in_turn(pair, REPO, other):
            runs[checkout].append(measure(args, checkout, pairs, messages))
    medians = {c: {k: statistics.median(r[k] for r in rs) for k in ("p50", "cpu")} for (c, rs) in runs.items()}
    for (checkout, figures) in medians.items():
        print(f"{checkout}: time in the proxy p50 {', '.join(f'{r['p50']:.2f}' for r in runs[checkout])} ms (median {figures['p50']:.2f}); "
              f"CPU per request {', '.join(f'{r['cpu']:.2f}' for r in runs[checkout])} ms (median {figures['cpu']:.2f})")
    print(f"this checkout / {other}: time in the proxy p50 x{medians[REPO]['p50'] / medians[other]['p50']:.2f}, "
          f"CPU per request x{medians[REPO]['cpu'] / medians[other]['cpu']:.2f}")


if __name__ == "__main__":
    main()
