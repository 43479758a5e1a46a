"""Restore rounds: the time one round adds in the proxy, the upstream excluded.

    .venv/bin/python benchmarks/restore_bench.py [--requests 40] [--results 150] [--budget 6000] [--stream]

The proxy runs as users start it (`contextrender proxy`, the engine in-process on a fresh store);
the fake upstream runs in this process (a thread on loopback) so that each answer can be scripted.
The client plays an agent loop on a session that starts with `--results` real tool results from
../shared/traces (the first request ingests them; not measured). Requests alternate:
- plain: the upstream answers at once with a tool call;
- restore: the upstream first calls contextrender_restore for an old result's handle (`r<i+1>`:
  omitted at this budget), the proxy answers it from the store and asks again, and the upstream
  then answers with a tool call.
The agent appends each answer and a tool result, and sends again.

Per pair, round overhead = (restore request through the proxy) - (the plain request before it)
- (the round's upstream call, replayed straight to the upstream with the body the proxy sent).
It covers the proxy's reading of the restore answer, `restore_result` (walker, edge, commit), the
round's request (the rendered history again, with the restored result) and its second forwarding.
Prints p50/p95 over the pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_bench import history, trace_turns  # noqa: E402
from proxy_bench import percentile, wait_up  # noqa: E402

from contextrender.testing.fake_upstream import FakeUpstream, free_port  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40, help="pairs of requests (one plain, one with a restore round)")
    parser.add_argument("--results", type=int, default=150)
    parser.add_argument("--budget", type=int, default=6000)
    parser.add_argument("--stream", action="store_true", help="the agent asks for streamed answers")
    args = parser.parse_args()

    pairs = trace_turns()
    messages = history(pairs, args.results)[:-1]
    proxy_port = free_port()
    proxy_url = f"http://127.0.0.1:{proxy_port}"
    store = tempfile.mkdtemp(prefix="restore-bench-")
    with FakeUpstream() as upstream:
        proxy_log = Path(store) / "proxy.log"  # a file: a pipe nobody reads fills and blocks the proxy
        with proxy_log.open("wb") as out:
            proxy = subprocess.Popen(
                [sys.executable, "-m", "contextrender.cli", "proxy", "--upstream", upstream.base_url,
                 "--budget", str(args.budget), "--port", str(proxy_port)],
                env=dict(os.environ, CONTEXTRENDER_STORE=store), stdout=out, stderr=subprocess.STDOUT,
            )
        try:
            wait_up(f"{proxy_url}/v1/models", proxy, proxy_log)
            with httpx.Client(timeout=120) as client:
                counter = 0

                def ask(restore_handle: str | None) -> tuple[float, dict]:
                    nonlocal counter, messages
                    counter += 1
                    call = {"id": f"call_next_{counter}", "type": "function",
                            "function": {"name": "bash", "arguments": json.dumps({"command": f"cat file_{counter}.py"})}}
                    if restore_handle:
                        restore = {"id": f"call_restore_{counter}", "type": "function",
                                   "function": {"name": "contextrender_restore", "arguments": json.dumps({"handle": restore_handle})}}
                        upstream.enqueue(content=None, tool_calls=[restore])
                    upstream.enqueue(content=None, tool_calls=[call])
                    body = {"model": "fake-model", "messages": messages, "temperature": 0, "stream": args.stream}
                    start = time.perf_counter()
                    response = client.post(f"{proxy_url}/v1/chat/completions", json=body)
                    elapsed = time.perf_counter() - start
                    assert response.status_code == 200, response.text
                    rounds = int(response.headers.get("x-contextrender-restore-rounds", "0"))
                    assert rounds == (1 if restore_handle else 0), (rounds, restore_handle)
                    result = pairs[(args.results + counter) % len(pairs)][1]["content"]
                    answer = {"role": "assistant", "content": None, "tool_calls": [call]}
                    messages = messages + [answer, {"role": "tool", "tool_call_id": call["id"], "content": result}]
                    return elapsed, response.headers

                start = time.perf_counter()
                ask(None)
                first = time.perf_counter() - start
                plain, restored, direct, overhead, sizes = [], [], [], [], []
                for i in range(args.requests):
                    (t_plain, _) = ask(None)
                    (t_restore, _) = ask(f"r{i + 1}")
                    round_body = upstream.requests[-1].body
                    sizes.append(len(json.loads(round_body)["messages"][-1]["content"]))
                    upstream.enqueue(content=None, tool_calls=[])
                    start = time.perf_counter()
                    client.post(f"{upstream.base_url}/chat/completions", content=round_body, headers={"content-type": "application/json"})
                    t_direct = time.perf_counter() - start
                    upstream.requests.pop()
                    plain.append(t_plain)
                    restored.append(t_restore)
                    direct.append(t_direct)
                    overhead.append(t_restore - t_plain - t_direct)
            print(f"restore rounds, {args.requests} pairs of requests, session of {args.results} results growing by 2 per request, "
                  f"B = {args.budget}, {'streamed' if args.stream else 'not streamed'}")
            print(f"  first request (ingests the {args.results}-result history): {first * 1000:.0f} ms")
            print(f"  plain request through the proxy        p50 {percentile(plain, 0.5):6.2f} ms  p95 {percentile(plain, 0.95):6.2f} ms")
            print(f"  request with one restore round         p50 {percentile(restored, 0.5):6.2f} ms  p95 {percentile(restored, 0.95):6.2f} ms")
            print(f"  the round's upstream call, directly    p50 {percentile(direct, 0.5):6.2f} ms  p95 {percentile(direct, 0.95):6.2f} ms")
            print(f"  time in the proxy per restore round    p50 {percentile(overhead, 0.5):6.2f} ms  p95 {percentile(overhead, 0.95):6.2f} ms")
            print(f"  restored results: median {statistics.median(sizes):.0f} characters")
        finally:
            proxy.terminate()
            proxy.wait(timeout=20)


if __name__ == "__main__":
    main()
