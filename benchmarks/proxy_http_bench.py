"""The proxy's HTTP side alone: CPU per forwarded request of a proxy process whose backend does no
work, so that what is measured is the request path around the Engine (uvicorn, the ASGI app, the
body's parsing, the thread hop, the forward upstream with httpx, the response).

    .venv/bin/python benchmarks/proxy_http_bench.py [--conversations 4] [--rounds 3] [--checkout PATH] [--plain-server]

The proxy runs in its own process (`serve`: this script, in the checkout's folder with its .venv),
with `create_app` over a backend whose render returns the system prompt and the last 12 messages of
the history at once (one omitted: the restore tool is offered, as on the peer bench's requests)
and whose ingestion stores nothing. The client replays the peer bench's conversations
(benchmarks/peer_proxy_bench.py: the longest mini-SWE-agent conversations of ../shared/traces, turn
by turn) through it against the fake upstream in this process, and prints the proxy process's CPU
time per request (/proc, user + system). `--checkout PATH`: the same proxy from another checkout,
alternated with this one in every round; `--plain-server`: this checkout's proxy also served on
asyncio's own loop with h11 (what uvicorn picks where uvloop and httptools are not installed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

HERE = Path(__file__).resolve().parent


class NullBackend:
    """A backend that renders by keeping the system prompt and the last messages, at no cost."""

    def render(self, session_id: str, messages: list[dict], *, budget: int, selector: str = "", **params):
        lead = [m for m in messages[:1] if m.get("role") == "system"]
        kept = lead + messages[len(lead):][-12:]
        return SimpleNamespace(messages=kept, full_history_tokens=len(messages) * 100, history_tokens=len(kept) * 100,
                               kept=len(kept), omitted=1, folded_messages=0, compacted=0, mode="stable")

    def ingest(self, session_id: str, messages: list[dict], **options):
        return SimpleNamespace(events=len(messages))

    def get_session(self, session_id: str) -> dict:
        return {"events": 0, "config": {"encoding": "o200k_base"}}

    def create_session(self, session_id: str, *, name: str = "") -> dict:
        return {}

    def configure(self, session_id: str, **params):
        return {}

    def restore(self, session_id: str, handle: str):
        raise KeyError(handle)

    def search_results(self, session_id: str, query: str, *, limit: int = 5):
        return {"text": ""}


def serve(upstream: str, port: int, plain: bool) -> None:
    import uvicorn

    from contextrender.limits import uvicorn_settings
    from contextrender.proxy import command

    # Logging as `contextrender proxy` sets it (its default --log-level info): the proxy's line per
    # request, other libraries' (httpx's line per upstream call) at warning. Before this, jaclang's
    # own set-up left every logger at INFO here, and the null proxy paid for httpx's line too.
    command._logging("info")
    from contextrender.proxy.app import create_app

    app = create_app(NullBackend(), upstream, 6000)
    # `plain`: asyncio's own loop and h11, as uvicorn serves where uvloop and httptools are not installed.
    served = dict(uvicorn_settings(), **({"loop": "asyncio", "http": "h11"} if plain else {}))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", **served)


def cpu_split(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of a live process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) / os.sysconf("SC_CLK_TCK"), int(fields[12]) / os.sysconf("SC_CLK_TCK"))


def replay(python: str, folder: Path, fake, talks, port: int, plain: bool = False) -> dict:
    from proxy_bench import wait_up

    url = f"http://127.0.0.1:{port}"
    proxy = subprocess.Popen([python, str(HERE / "proxy_http_bench.py"), "--serve", fake.base_url, "--port", str(port)]
                             + (["--plain"] if plain else []),
                             cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_up(f"{url}/contextrender/ready", proxy, timeout=120)
        with httpx.Client(timeout=60) as client:
            # One unmeasured request: the first loads the tokenizer the proxy's estimate counts with.
            fake.enqueue("hello")
            client.post(f"{url}/v1/chat/completions", json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]},
                        headers={"X-ContextRender-Session": "warm-up"})
            count = 0
            before = cpu_split(proxy.pid)
            for (tag, messages) in talks:
                for j, message in enumerate(messages):
                    if message["role"] != "assistant" or j == 0:
                        continue
                    fake.enqueue(message.get("content"), message.get("tool_calls"))
                    response = client.post(f"{url}/v1/chat/completions", json={"model": "fake-model", "messages": messages[:j]},
                                           headers={"X-ContextRender-Session": f"http-{tag}"[:200]})
                    assert response.status_code == 200, response.text[:300]
                    count += 1
            (user, system) = (a - b for (a, b) in zip(cpu_split(proxy.pid), before))
    finally:
        proxy.terminate()
        proxy.wait(timeout=30)
    return {"requests": count, "cpu_ms": (user + system) * 1000 / count, "user_ms": user * 1000 / count, "system_ms": system * 1000 / count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--checkout", type=Path, help="also run the proxy of this checkout (its .venv, in its folder), alternated")
    parser.add_argument("--plain-server", action="store_true",
                        help="also run this checkout's proxy on asyncio's loop and h11 (no uvloop, no httptools), alternated")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port, args.plain)
        return
    import logging

    sys.path.insert(0, str(HERE))
    from peer_proxy_bench import conversations

    from contextrender.testing.fake_upstream import FakeUpstream, free_port

    logging.getLogger("httpx").setLevel(logging.WARNING)
    talks = conversations(args.conversations)
    runs = [("this checkout", sys.executable, HERE.parent, False)]
    if args.checkout:
        runs.append((str(args.checkout), str(args.checkout / ".venv" / "bin" / "python"), args.checkout, False))
    if args.plain_server:
        runs.append(("this checkout, asyncio and h11", sys.executable, HERE.parent, True))
    figures: dict[str, list[float]] = {name: [] for (name, _, _, _) in runs}
    with FakeUpstream() as fake:
        for round_ in range(1, args.rounds + 1):
            shift = (round_ - 1) % len(runs)
            for (name, python, folder, plain) in runs[shift:] + runs[:shift]:
                fake.requests.clear()
                row = replay(python, folder, fake, talks, free_port(), plain)
                figures[name].append(row["cpu_ms"])
                print(f"round {round_}, {name}: {row['requests']} requests, CPU {row['cpu_ms']:.2f} ms per request "
                      f"(user {row['user_ms']:.2f}, system {row['system_ms']:.2f})  "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
    for (name, values) in figures.items():
        print(f"median, {name}: {statistics.median(values):.2f} ms per request")
    if args.checkout:
        (ours, other) = (statistics.median(figures["this checkout"]), statistics.median(figures[str(args.checkout)]))
        print(f"this checkout / {args.checkout}: {ours / other:.2f}")


if __name__ == "__main__":
    main()
