"""Scale: per-call latency as sessions accumulate, memory after many sessions, and sessions in parallel.

    .venv/bin/python benchmarks/scale_bench.py                       # everything (about 30 min here)
    .venv/bin/python benchmarks/scale_bench.py --stored 1 100 --rss 0 --concurrent 0   # a quick look

1. Latency with N sessions stored (--stored, default 1 100 1000 10000; cumulative). N filler
   sessions are stored first: each a tau-bench system prompt (6 KB) with its first user message
   and answer, made straight in the store through the real archetypes and passes (`new_session`,
   `ingest`, ten per execution context). Then a new probe session plays an agent loop of --calls
   requests (each adds an assistant tool call and a tau-bench tool result, then renders at
   B = --budget): in-process (`Engine.render`), through the server (`jac start`, `Client.render`
   over HTTP, fillers under the client's own root) and through the proxy (`contextrender proxy`
   with the engine in-process on the engine's store, an OpenAI-style request to a fake upstream
   that answers every request with a tool call). Each prints p50 and p95 per call.
2. Memory (--rss, default 2000 sessions): a fresh process serves that many sessions through the
   Engine (one tau-bench conversation each, ingested and rendered in one call) with
   CONTEXTRENDER_INDEX_CACHE_MB = --cache-mb; its RSS after the first session (its base) and at
   the end. The server's RSS after the same sessions over HTTP, with the same setting.
3. Parallel sessions (--concurrent, default 30): that many agent loops at once, each on its own
   session, --concurrent-calls requests each, through the proxy (fake upstream) and through the
   server: p50 and p95 per request and requests per second.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from proxy_bench import percentile, wait_up  # noqa: E402

from contextrender.testing.fake_upstream import free_port  # noqa: E402

TRACES = HERE.parent.parent / "shared" / "traces"
PASSWORD = "scale-bench-password-1"
# Fillers stored per execution context: each `ingest` commits, and a commit hashes every node the
# context holds, so one context for thousands of sessions would take quadratic time.
FILL_BATCH = 10


def tau_traces() -> list[list[dict]]:
    with open(TRACES / "tau_bench.jsonl") as f:
        return [json.loads(line)["messages"] for line in f]


TAU = tau_traces()
SYSTEM = TAU[0][0]
FILLER = TAU[0][:3]  # the system prompt, the first user message and the answer
RESULTS = [m["content"] for trace in TAU for m in trace if m["role"] == "tool" and m.get("content")]


def result_for(tag: str, n: int) -> str:
    """A tau-bench tool result, the same for a tag and step in every run."""
    return RESULTS[(sum(map(ord, tag)) * 31 + n) % len(RESULTS)]


def agent_turns(tag: str, calls: int) -> list[list[dict]]:
    """The message list an agent sends at each of `calls` requests (one tool round added each)."""
    messages = [SYSTEM, {"role": "user", "content": f"Task {tag}: please help with my reservation."}]
    lists = []
    for n in range(calls):
        call_id = f"call_{tag}_{n}"
        messages = messages + [
            {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "get_reservation_details", "arguments": json.dumps({"reservation_id": f"R{n:05d}"})}}]},
            {"role": "tool", "tool_call_id": call_id, "content": result_for(tag, n)},
        ]
        lists.append(messages)
    return lists


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def summary(samples: list[float]) -> str:
    return f"p50 {percentile(samples, 0.5):7.1f} ms  p95 {percentile(samples, 0.95):7.1f} ms  (n={len(samples)})"


# ---------------------------------------------------------------- stores


class Store:
    """A graph store (one SQLite file) that fillers are written to directly, as `root_id`'s sessions
    (None: the super root, the Engine's)."""

    def __init__(self, db_path: Path, root_id: str | None = None) -> None:
        self.db_path = db_path
        self.root_id = root_id
        self.filled = 0

    def fill(self, total: int) -> float:
        """Store fillers until there are `total`; returns the seconds it took."""
        from jaclang.jac0core.constant import Constants
        from jaclang.jac0core.runtime import JacRuntime, JacUtils
        from jaclang.runtimelib.memory import SqliteMemory

        from walkers.ingest import ingest
        from walkers.session import new_session

        started = time.perf_counter()
        scratch = tempfile.mkdtemp(prefix="scale-fill-")
        while self.filled < total:
            ctx = JacUtils.create_j_context(user_root=None, base_path_dir=scratch)
            ctx.mem.l3 = SqliteMemory(path=str(self.db_path))
            # The context made a system root of its own (the scratch store has none): drop it, or
            # its commit would overwrite the stored root's edges; load the stored root instead.
            ctx.mem.__mem__.clear()
            ctx.set_user_root(self.root_id or Constants.SUPER_ROOT_UUID)
            token = JacRuntime.push_request_context(ctx)
            try:
                root = ctx.user_root.archetype
                for n in range(self.filled, min(total, self.filled + FILL_BATCH)):
                    ingest(new_session(root, f"filler-{n}"), FILLER)
            finally:
                JacRuntime.reset_request_context(token)
                ctx.close()
            self.filled = min(total, self.filled + FILL_BATCH)
        return time.perf_counter() - started


# ---------------------------------------------------------------- the three ways in


class Server:
    """`jac start contextrender.jac` on a copy of the project, with a logged-in client."""

    def __init__(self, workdir: Path, cache_mb: float) -> None:
        from jacserver import JacServer

        from contextrender.client import Client

        self.server = JacServer(workdir, CONTEXTRENDER_INDEX_CACHE_MB=str(cache_mb)).start()
        self.url = self.server.url
        self.client = Client(self.url)
        self.client.register("bench", PASSWORD)
        # The caller's root id, read off the session node it creates (for the direct fillers).
        self.client.ingest("bootstrap", FILLER)
        graph = self.client.export_graph("bootstrap", limit=1)
        session_node = graph["nodes"][0]["id"]
        db = workdir / ".jac" / "data" / "anchor_store.db"
        import sqlite3

        with sqlite3.connect(db) as connection:
            row = connection.execute("SELECT data FROM anchors WHERE replace(id, '-', '') = ?", (session_node,)).fetchone()
        self.store = Store(db, json.loads(row[0])["root"])

    def new_client(self) -> Any:
        from contextrender.client import Client

        return Client(self.url, token=self.client.token)

    @property
    def pid(self) -> int:
        return self.server.process.pid

    def stop(self) -> None:
        self.server.stop()


class Proxy:
    """The fake upstream and `contextrender proxy` (engine in-process on `store`), as processes."""

    def __init__(self, store: Path, budget: int, cache_mb: float) -> None:
        self.upstream_url = f"http://127.0.0.1:{free_port()}"
        self.url = f"http://127.0.0.1:{free_port()}"
        env = dict(os.environ, CONTEXTRENDER_STORE=str(store), CONTEXTRENDER_INDEX_CACHE_MB=str(cache_mb))
        self.upstream = subprocess.Popen(
            [sys.executable, "-m", "contextrender.testing.fake_upstream", "--port", self.upstream_url.rsplit(":", 1)[1],
             "--tool", "get_reservation_details"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )
        self.proxy = subprocess.Popen(
            [sys.executable, "-m", "contextrender.cli", "proxy", "--upstream", f"{self.upstream_url}/v1",
             "--budget", str(budget), "--port", self.url.rsplit(":", 1)[1]],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )
        wait_up(f"{self.upstream_url}/v1/models", self.upstream)
        wait_up(f"{self.url}/v1/models", self.proxy)

    def agent(self, session: str, calls: int, http: httpx.Client) -> list[float]:
        """An agent loop through the proxy: each request sends the conversation, the upstream answers
        with a tool call, the agent appends that answer and a tau-bench result. Seconds per request."""
        messages = [SYSTEM, {"role": "user", "content": f"Task {session}: please help with my reservation."}]
        samples = []
        answer = None
        for n in range(calls + 1):
            if answer is not None:
                call_id = answer["tool_calls"][0]["id"]
                messages = messages + [answer, {"role": "tool", "tool_call_id": call_id, "content": result_for(session, n)}]
            started = time.perf_counter()
            response = http.post(f"{self.url}/v1/chat/completions", json={"model": "fake-model", "messages": messages},
                                 headers={"X-ContextRender-Session": session})
            elapsed = time.perf_counter() - started
            response.raise_for_status()
            answer = response.json()["choices"][0]["message"]
            if n:  # the first request only opens the conversation
                samples.append(elapsed)
        return samples

    def stop(self) -> None:
        for process in (self.proxy, self.upstream):
            process.terminate()
            process.wait(timeout=20)


def timed_loop(render: Callable[[list[dict]], Any], turns: list[list[dict]]) -> list[float]:
    samples = []
    for messages in turns:
        started = time.perf_counter()
        render(messages)
        samples.append(time.perf_counter() - started)
    return samples


# ---------------------------------------------------------------- sections


def latency(args: argparse.Namespace, engine_store: Path, server: Server | None, proxy: Proxy | None) -> None:
    from contextrender import Engine

    engine = Engine(engine_store)
    local = Store(next((engine_store / ".jac" / "data").glob("*.db")))
    print(f"== per-call latency, agent loop of {args.calls} calls (tau-bench results), B = {args.budget}", flush=True)
    for stored in args.stored:
        took = local.fill(stored)
        line = f"{stored:>6} sessions stored (fillers made in {took:.0f} s"
        if server is not None:
            line += f", server's in {server.store.fill(stored):.0f} s"
        print(line + ")", flush=True)
        if "engine" in args.modes:
            samples = timed_loop(lambda m: engine.render(f"probe-{stored}", m, budget=args.budget), agent_turns(f"e{stored}", args.calls))
            print(f"    in-process  {summary(samples)}", flush=True)
        if server is not None:
            client = server.new_client()
            samples = timed_loop(lambda m: client.render(f"probe-{stored}", m, budget=args.budget), agent_turns(f"s{stored}", args.calls))
            print(f"    server      {summary(samples)}", flush=True)
        if proxy is not None:
            with httpx.Client(timeout=300) as http:
                samples = proxy.agent(f"probe-{stored}", args.calls, http)
            print(f"    proxy       {summary(samples)}  (round trip; the fake upstream answers in about 1 ms)", flush=True)


MEMORY_SCRIPT = """
import json, os, sys, time
from contextrender import Engine
from engine.index import SESSION_CACHE
store, sessions, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
traces = [json.loads(line)["messages"] for line in open(sys.argv[4])]
def rss():
    return int([l for l in open("/proc/self/status") if l.startswith("VmRSS:")][0].split()[1]) / 1024
engine = Engine(store)
engine.render("session-0", traces[0], budget=budget)
base = rss()
started = time.perf_counter()
for n in range(1, sessions):
    engine.render(f"session-{n}", traces[n % len(traces)], budget=budget)
print(json.dumps({"base": base, "after": rss(), "seconds": time.perf_counter() - started,
                  "cached": len(SESSION_CACHE), "cached_mb": SESSION_CACHE.total_bytes / 2**20}))
"""


def memory(args: argparse.Namespace, server: Server | None) -> None:
    print(f"== memory after {args.rss} sessions (one tau-bench conversation each), CONTEXTRENDER_INDEX_CACHE_MB={args.cache_mb}", flush=True)
    if "engine" in args.modes:
        store = tempfile.mkdtemp(prefix="scale-rss-")
        env = dict(os.environ, CONTEXTRENDER_INDEX_CACHE_MB=str(args.cache_mb))
        done = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, store, str(args.rss), str(args.budget), str(TRACES / "tau_bench.jsonl")],
                              env=env, capture_output=True, text=True, cwd=HERE.parent)
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        got = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"    in-process  RSS {got['base']:.0f} MB after 1 session (base), {got['after']:.0f} MB after {args.rss} "
              f"(+{got['after'] - got['base']:.0f} MB; cap {args.cache_mb} MB); cache: {got['cached']} indexes, "
              f"{got['cached_mb']:.1f} MB; {got['seconds']:.0f} s", flush=True)
    if server is not None:
        client = server.new_client()
        client.render("rss-0", TAU[0], budget=args.budget)
        base = rss_mb(server.pid)
        started = time.perf_counter()
        for n in range(1, args.rss):
            client.render(f"rss-{n}", TAU[n % len(TAU)], budget=args.budget)
        after = rss_mb(server.pid)
        print(f"    server      RSS {base:.0f} MB after 1 session (base; its store holds the fillers above), {after:.0f} MB "
              f"after {args.rss} (+{after - base:.0f} MB; cap {args.cache_mb} MB); {time.perf_counter() - started:.0f} s", flush=True)


def in_parallel(agents: int, run: Callable[[int], list[float]]) -> tuple[list[float], float]:
    samples: list[float] = []
    lock = threading.Lock()
    barrier = threading.Barrier(agents)

    def one(n: int) -> None:
        barrier.wait()
        got = run(n)
        with lock:
            samples.extend(got)

    threads = [threading.Thread(target=one, args=(n,)) for n in range(agents)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return samples, time.perf_counter() - started


def concurrency(args: argparse.Namespace, server: Server | None, proxy: Proxy | None) -> None:
    n, calls = args.concurrent, args.concurrent_calls
    print(f"== {n} sessions at once, {calls} requests each (agent loops, tau-bench results), B = {args.budget}", flush=True)
    if proxy is not None:
        def through_proxy(agent: int) -> list[float]:
            with httpx.Client(timeout=300) as http:
                return proxy.agent(f"parallel-{agent}-{time.time_ns()}", calls, http)

        samples, seconds = in_parallel(n, through_proxy)
        print(f"    proxy       {summary(samples)}  {len(samples) / seconds:.1f} requests/s", flush=True)
    if server is not None:
        def through_server(agent: int) -> list[float]:
            client = server.new_client()
            tag = f"parallel-{agent}-{time.time_ns()}"
            return timed_loop(lambda m: client.render(tag, m, budget=args.budget), agent_turns(tag, calls))

        samples, seconds = in_parallel(n, through_server)
        print(f"    server      {summary(samples)}  {len(samples) / seconds:.1f} requests/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stored", type=int, nargs="*", default=[1, 100, 1000, 10_000], help="sessions stored at each level (cumulative)")
    parser.add_argument("--calls", type=int, default=20, help="requests of the probe session at each level")
    parser.add_argument("--budget", type=int, default=2000)
    parser.add_argument("--modes", default="engine,server,proxy", help="comma-separated: engine, server, proxy")
    parser.add_argument("--rss", type=int, default=2000, help="sessions for the memory figure (0: skip)")
    parser.add_argument("--cache-mb", type=float, default=64.0, help="CONTEXTRENDER_INDEX_CACHE_MB for every process")
    parser.add_argument("--concurrent", type=int, default=30, help="sessions at once (0: skip)")
    parser.add_argument("--concurrent-calls", type=int, default=10)
    args = parser.parse_args()
    args.modes = set(args.modes.split(","))
    os.environ["CONTEXTRENDER_INDEX_CACHE_MB"] = str(args.cache_mb)

    from contextrender import Engine

    work = Path(tempfile.mkdtemp(prefix="scale-bench-"))
    engine_store = work / "store"
    Engine(engine_store).ingest("bootstrap", FILLER)  # makes the store and its directory
    server = Server(work / "server", args.cache_mb) if "server" in args.modes else None
    proxy = Proxy(engine_store, args.budget, args.cache_mb) if "proxy" in args.modes else None
    print(f"work dir {work}; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}", flush=True)
    try:
        if args.stored:
            latency(args, engine_store, server, proxy)
        if args.concurrent:
            concurrency(args, server, proxy)
        if args.rss:
            memory(args, server)
    finally:
        for part in (proxy, server):
            if part is not None:
                part.stop()
        print(f"load average at the end {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
