"""One proxy serving several agents at once: time in the proxy and its CPU per request.

    .venv/bin/python benchmarks/proxy_concurrency_bench.py [--agents 8] [--budget 6000] [--rounds 2]
        [--young-thresholds default,700,20000]

On loopback: a scripted upstream in its own process (answering each agent's request with the
assistant message its recorded conversation had next: each agent sends its own model name), one
proxy (`contextrender proxy`, the engine in-process on a fresh store) and this client, in which
`--agents` threads each replay one of the longest recorded coding conversations of
../shared/traces/mini_swe_agent_deepseek.jsonl turn by turn, all at once (each a session of its
own, `X-ContextRender-Session`). Each request's time in the proxy is its round trip through the
proxy less the round trip straight to the upstream with the body the upstream received from the
proxy, sent right after (as benchmarks/proxy_bench.py and peer_proxy_bench.py measure it).

`--young-thresholds` serves the proxy with each young-collection threshold in turn (the first value
of Python's `gc.set_threshold`), alternated, `--rounds` times: `default` is the proxy as users start
it (Python's 700: its Engine raises it to engine/courtesy.jac's YOUNG_THRESHOLD, the command gives
it back); a number is set before the proxy starts, which the Engine and the command then leave as
it is (700 is set as 701, so that it does not count as Python's own). Per run it prints the requests, the proxy process's CPU (user + system,
/proc) per request, the time in the proxy p50 / p95 / max, and at the end the medians per setting.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_proxy_bench import conversations, cpu_seconds  # noqa: E402
from proxy_bench import percentile, wait_up  # noqa: E402

from contextrender.testing.fake_upstream import free_port  # noqa: E402

# The proxy started with a young threshold of its own before anything else runs (see the docstring).
START_WITH_THRESHOLD = ("import gc, runpy, sys; young = int(sys.argv.pop(1)); "
                        "gc.set_threshold(young, *gc.get_threshold()[1:]); "
                        "runpy.run_module('contextrender.cli', run_name='__main__', alter_sys=True)")


def turns(messages: list[dict]) -> list[int]:
    """The positions of the assistant messages an agent's requests get as answers."""
    return [j for (j, message) in enumerate(messages) if message["role"] == "assistant" and j > 0]


def serve_upstream(port: int, agents: int) -> None:
    """The scripted upstream (run in its own process): model `agent-K` gets agent K's recorded
    answers in order; `x-bench-direct: 1` answers again the last one without moving on (the
    client's direct round trip), and `GET /_last/agent-K` gives the last body that agent's proxy
    request carried."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    talks = conversations(agents)
    answers = {f"agent-{k}": [messages[j] for j in turns(messages)] for (k, (_, messages)) in enumerate(talks)}
    served = {name: 0 for name in answers}
    last: dict[str, bytes] = {}

    async def chat(request: Request) -> Response:
        body = await request.body()
        model = json.loads(body)["model"]
        if model not in answers:  # the proxy's warm-up
            return JSONResponse({"id": "chatcmpl-warm-up", "object": "chat.completion", "created": 0, "model": model,
                                 "choices": [{"index": 0, "message": {"role": "assistant", "content": "Done."}, "finish_reason": "stop"}]})
        if request.headers.get("x-bench-direct") != "1":
            served[model] += 1
            last[model] = body
        message = answers[model][served[model] - 1]
        reply = {k: message[k] for k in ("role", "content", "tool_calls") if k in message}
        return JSONResponse({"id": f"chatcmpl-{model}-{served[model]}", "object": "chat.completion", "created": 0, "model": model,
                             "choices": [{"index": 0, "message": reply, "finish_reason": "tool_calls" if reply.get("tool_calls") else "stop"}],
                             "usage": {"prompt_tokens": len(body) // 4, "completion_tokens": 50, "total_tokens": len(body) // 4 + 50}})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "bench"} for name in answers]})

    async def last_body(request: Request) -> Response:
        return Response(last.get(request.path_params["model"], b"{}"), media_type="application/json")

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/models", models),
                            Route("/_last/{model}", last_body)])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def agent(k: int, messages: list[dict], proxy_url: str, upstream_url: str, in_proxy: list[float], errors: list[str],
          go: threading.Event) -> None:
    """One agent's conversation through the proxy, request after request."""
    model = f"agent-{k}"
    with httpx.Client(timeout=600) as client:
        go.wait()
        for j in turns(messages):
            body = {"model": model, "messages": messages[:j], "temperature": 0}
            began = time.perf_counter()
            response = client.post(f"{proxy_url}/v1/chat/completions", json=body, headers={"X-ContextRender-Session": f"agent-{k}"})
            through = time.perf_counter() - began
            if response.status_code != 200:
                errors.append(f"{model}: {response.status_code} {response.text[:200]}")
                return
            forwarded = client.get(f"{upstream_url}/_last/{model}").content
            began = time.perf_counter()
            client.post(f"{upstream_url}/v1/chat/completions", content=forwarded,
                        headers={"content-type": "application/json", "x-bench-direct": "1"})
            in_proxy.append(through - (time.perf_counter() - began))


def one_run(setting: str, talks: list[tuple[str, list[dict]]], budget: int) -> dict:
    """A fresh upstream and proxy, every agent at once; the figures."""
    upstream_port, proxy_port = free_port(), free_port()
    upstream_url, proxy_url = f"http://127.0.0.1:{upstream_port}", f"http://127.0.0.1:{proxy_port}"
    upstream = subprocess.Popen([sys.executable, __file__, "--serve-upstream", str(upstream_port), "--agents", str(len(talks))],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    with tempfile.TemporaryDirectory(prefix="proxy-concurrency-") as state:
        arguments = ["proxy", "--upstream", f"{upstream_url}/v1", "--budget", str(budget), "--port", str(proxy_port)]
        if setting == "default":
            command = [sys.executable, "-m", "contextrender.cli", *arguments]
        else:
            young = 701 if int(setting) == 700 else int(setting)
            command = [sys.executable, "-c", START_WITH_THRESHOLD, str(young), *arguments]
        proxy = subprocess.Popen(command, env=dict(os.environ, CONTEXTRENDER_STORE=state), cwd=REPO,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            wait_up(f"{upstream_url}/v1/models", upstream)
            wait_up(f"{proxy_url}/v1/models", proxy, timeout=180)
            # One unmeasured request: the proxy's models load on first use.
            httpx.post(f"{proxy_url}/v1/chat/completions", headers={"X-ContextRender-Session": "warm-up"},
                       json={"model": "warm-up", "messages": [{"role": "user", "content": "hello"}]}, timeout=300)
            in_proxy: list[float] = []
            errors: list[str] = []
            go = threading.Event()
            threads = [threading.Thread(target=agent, args=(k, messages, proxy_url, upstream_url, in_proxy, errors, go), daemon=True)
                       for (k, (_, messages)) in enumerate(talks)]
            for thread in threads:
                thread.start()
            load = os.getloadavg()[0]
            cpu_before, began = cpu_seconds(proxy.pid), time.perf_counter()
            go.set()
            for thread in threads:
                thread.join()
            (cpu, wall) = (cpu_seconds(proxy.pid) - cpu_before, time.perf_counter() - began)
        finally:
            for process in (proxy, upstream):
                process.terminate()
                process.wait(timeout=30)
    for error in errors[:3]:
        print(f"  error: {error}")
    return {"setting": setting, "requests": len(in_proxy), "errors": len(errors), "cpu_ms": cpu * 1000 / max(1, len(in_proxy)),
            "p50": percentile(in_proxy, 0.5), "p95": percentile(in_proxy, 0.95), "max": max(in_proxy) * 1000,
            "wall": wall, "load": (load, os.getloadavg()[0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=8, help="conversations replayed at once (the longest recorded ones)")
    parser.add_argument("--budget", type=int, default=6000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--young-thresholds", default="default",
                        help="comma-separated young thresholds served in turn: 'default' (the Engine's), or a number")
    parser.add_argument("--serve-upstream", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_upstream:
        serve_upstream(args.serve_upstream, args.agents)
        return
    logging.getLogger("httpx").setLevel(logging.WARNING)
    talks = conversations(args.agents)
    settings = [s.strip() for s in args.young_thresholds.split(",") if s.strip()]
    rows: list[dict] = []
    for round_ in range(1, args.rounds + 1):
        # Each round starts with the next setting: each runs first, second and so on in turn.
        shift = (round_ - 1) % len(settings)
        for setting in settings[shift:] + settings[:shift]:
            row = one_run(setting, talks, args.budget)
            rows.append(row)
            print(f"round {round_}, young threshold {setting:>7}: {len(talks)} agents at once, {row['requests']} requests "
                  f"({row['errors']} failed) in {row['wall']:.1f} s, CPU {row['cpu_ms']:.1f} ms per request, time in the proxy "
                  f"p50 {row['p50']:.1f} ms, p95 {row['p95']:.1f} ms, max {row['max']:.0f} ms  "
                  f"(load {row['load'][0]:.1f}-{row['load'][1]:.1f})", flush=True)
    print(f"medians over {args.rounds} rounds, {len(talks)} agents at once, B = {args.budget}:")
    for setting in settings:
        mine = [r for r in rows if r["setting"] == setting]
        print(f"  young threshold {setting:>7}: CPU {statistics.median(r['cpu_ms'] for r in mine):.1f} ms per request, "
              f"time in the proxy p50 {statistics.median(r['p50'] for r in mine):.1f} ms, "
              f"p95 {statistics.median(r['p95'] for r in mine):.1f} ms, wall {statistics.median(r['wall'] for r in mine):.1f} s")


if __name__ == "__main__":
    main()
