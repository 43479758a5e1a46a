"""One user's big write on a shared server, and everyone else meanwhile.

    .venv/bin/python benchmarks/shared_server_bench.py [--messages 40000] [--users 30] [--checkout PATH]

Starts the real server (`jac start`, tests/jacserver.py) on loopback with its own SQLite store. 30
users each make ordinary calls in a loop (register an account, create a session, append to it,
render it, read it, list their sessions) while one more user ingests a 40,000-message session in
one call. Prints the big call's time and status, and the others' calls: how many answered 5xx
(target 0), their p50, p95 and maximum (target p95 <= 1 s), overall and while the big call ran.
Each ordinary user waits `--pause` seconds (default 1) before each call, as an agent waits for its
model: without it 30 users saturate the two cores on their own.
`--checkout` serves another checkout's Jac modules with its venv's `jac` (a before/after run);
`--alternate PATH` serves that checkout too, run after run with `--checkout`'s, in each round;
`--switch-intervals default,1,0.5 --rounds 2` serves each GIL switch interval in turn (`default`: the server's
default), twice, and ends with a table of the runs.
`--scale-out` serves from jac-scale's MongoDB and Redis instead of the embedded SQLite store: each
run gets a new Redis and a new MongoDB stand-in (`scripts/scale_out.sh start --servers 0`, this
checkout's; docs/scale-out.md), stopped after it.
`--gc-probe` times every collection of Python's cyclic collector in the server (a `sitecustomize` on
its PYTHONPATH, `gc.callbacks`) and prints the full ones during the big call and after it. "Around
its end" is the others' calls in progress from 1 s before the big call's answer to `--after` seconds
after it: where the full collection that frees what the big call left falls.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkouts import REPO, program  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))

PASSWORD = "a-Bench-password-9"

# Put on the server's PYTHONPATH by --gc-probe: one line per full collection (and per younger one
# over 50 ms): wall-clock start, seconds, generation, objects collected.
GC_PROBE = """import gc, os, time
_log = open(os.environ["SHARED_SERVER_BENCH_GC_LOG"], "a", buffering=1)
_began = [0.0, 0.0]
def _timed(phase, info):
    if phase == "start":
        _began[:] = [time.time(), time.perf_counter()]
        return
    seconds = time.perf_counter() - _began[1]
    if info["generation"] == 2 or seconds > 0.05:
        _log.write(f"{_began[0]:.3f} {seconds:.3f} {info['generation']} {info['collected']}\\n")
gc.callbacks.append(_timed)
"""


def big_session(messages: int) -> list[dict]:
    """A coding session of `messages` messages: tool rounds of small results (about 40 bytes a
    message, as the issue's 40,000-message, 1.6 MB session)."""
    history = [{"role": "user", "content": "Fix the failing test in the parser module, then run the suite."}]
    i = 0
    while len(history) < messages:
        call = f"call_{i}"
        history.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": call, "type": "function", "function": {"name": "bash", "arguments": json.dumps({"cmd": f"sed -n {i},{i + 9}p src/parser.py"})}}]})
        history.append({"role": "tool", "tool_call_id": call, "content": f"{i}: def parse_{i}(tokens): return tokens[{i % 7}:] # line {i * 3}"})
        i += 1
    return history[:messages]


def account(username: str) -> dict:
    return {"identities": [{"type": "username", "value": username}], "credential": {"type": "password", "password": PASSWORD}}


def register(http: httpx.Client, username: str) -> str:
    http.post("/user/register", json=account(username)).raise_for_status()
    login = {"identity": {"type": "username", "value": username}, "credential": {"type": "password", "password": PASSWORD}}
    response = http.post("/user/login", json=login)
    response.raise_for_status()
    return response.json()["data"]["token"]


class Calls:
    """Every timed call of the ordinary users: (start, seconds, status, what)."""

    def __init__(self, pause: float) -> None:
        self.pause = pause
        self.rows: list[tuple[float, float, int, str]] = []
        self.lock = threading.Lock()
        self.errors: list[str] = []

    def post(self, http: httpx.Client, what: str, path: str, body: dict, token: str | None = None) -> httpx.Response | None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        time.sleep(self.pause)
        start = time.monotonic()
        try:
            response = http.post(path, json=body, headers=headers)
            status = response.status_code
        except httpx.HTTPError as error:
            response, status = None, 599  # no answer at all counts as a server failure
            self.errors.append(f"{what}: {type(error).__name__}: {error}")
        seconds = time.monotonic() - start
        with self.lock:
            self.rows.append((start, seconds, status, what))
            if status >= 500 and response is not None:
                self.errors.append(f"{what}: {status} {response.text[:200]}")
        return response


def ordinary_user(url: str, n: int, calls: Calls, stop: threading.Event) -> None:
    """register, create a session, then append / render / read / list in a loop (each call after
    the pause `calls` keeps); a new session and a new account every few
    rounds."""
    with httpx.Client(base_url=url, timeout=600) as http:
        token = None
        start = time.monotonic()
        response = calls.post(http, "register", "/user/register", account(f"user{n}"))
        if response is not None and response.status_code in (200, 201):
            login = {"identity": {"type": "username", "value": f"user{n}"}, "credential": {"type": "password", "password": PASSWORD}}
            answer = calls.post(http, "login", "/user/login", login)
            token = answer.json()["data"]["token"] if answer is not None and answer.status_code == 200 else None
        if token is None:
            calls.errors.append(f"user{n}: could not log in ({time.monotonic() - start:.1f} s)")
            return
        rounds = 0
        session = f"s{n}-0"
        history = [{"role": "user", "content": f"Task {n}: list the files."}]
        calls.post(http, "create_session", "/walker/create_session", {"session_id": session}, token)
        while not stop.is_set():
            rounds += 1
            call = f"c{n}_{rounds}"
            added = [{"role": "assistant", "content": "", "tool_calls": [{"id": call, "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": call, "content": f"file_{rounds}.py\nREADME.md\n"}]
            calls.post(http, "append", "/walker/ingest_events", {"session_id": session, "messages": added, "append": True}, token)
            history += added
            calls.post(http, "render", "/walker/render_context", {"session_id": session, "messages": history, "budget": 2000}, token)
            calls.post(http, "get_session", "/walker/get_session", {"session_id": session}, token)
            if rounds % 3 == 0:
                calls.post(http, "list_sessions", "/walker/list_sessions", {}, token)
            if rounds % 5 == 0:
                session = f"s{n}-{rounds}"
                history = [{"role": "user", "content": f"Task {n}.{rounds}: read the README."}]
                calls.post(http, "new_session", "/walker/create_session", {"session_id": session}, token)
            if rounds % 7 == 0:
                calls.post(http, "register", "/user/register", account(f"user{n}-{rounds}"))


def percentiles(rows: list[tuple[float, float, int, str]]) -> tuple[float, float]:
    """p50 and p95 of the rows' seconds, in milliseconds (nan for no rows)."""
    if not rows:
        return math.nan, math.nan
    seconds = sorted(r[1] for r in rows)
    return statistics.median(seconds) * 1000, seconds[min(len(seconds) - 1, round(0.95 * (len(seconds) - 1)))] * 1000


def summary(rows: list[tuple[float, float, int, str]]) -> str:
    if not rows:
        return "no calls"
    p50, p95 = percentiles(rows)
    failed = sum(1 for r in rows if r[2] >= 500)
    return (f"{len(rows)} calls, 5xx {failed}, p50 {p50:.0f} ms, "
            f"p95 {p95:.0f} ms, max {max(r[1] for r in rows) * 1000:.0f} ms")


def on_sessions(rows: list[tuple[float, float, int, str]]) -> list[tuple[float, float, int, str]]:
    """The calls on sessions: register and login hash a password (bcrypt), CPU-bound whatever the store does."""
    return [r for r in rows if r[3] not in ("register", "login")]


def collections(gc_log: Path, began: float, ended: float, after: float) -> str:
    """The server's full collections while the big call ran and in the `after` seconds after it
    (wall-clock bounds), from --gc-probe's log."""
    rows = [tuple(float(x) for x in line.split()) for line in gc_log.read_text().splitlines() if line.strip()] if gc_log.exists() else []
    full = [r for r in rows if r[2] == 2]

    def told(part: list) -> str:
        return (f"{len(part)}, {sum(r[1] for r in part):.2f} s in all, longest {max((r[1] for r in part), default=0):.2f} s"
                + (f" ({max(r[3] for r in part):,.0f} objects freed at most)" if part else ""))
    during = [r for r in full if began <= r[0] < ended]
    later = [r for r in full if ended <= r[0] < ended + after]
    young = [r for r in rows if r[2] < 2 and began <= r[0] < ended + after]
    longest = sorted(young, key=lambda r: -r[1])[:5]
    return (f"full collections while the big call ran: {told(during)}; in the {after:.0f} s after it: {told(later)}; "
            f"younger ones over 50 ms: {len(young)}"
            + (" (the longest, seconds into the big call: " + ", ".join(f"{r[1]:.2f} s of generation {r[2]:.0f} at {r[0] - began:.1f} s"
                                                                      for r in longest) + ")" if longest else ""))


def scale_out_stores(folder: Path) -> dict[str, str]:
    """A new Redis and MongoDB stand-in under `folder` (scripts/scale_out.sh, no server): the
    server's MONGODB_URI and REDIS_URL."""
    subprocess.run(["bash", str(REPO / "scripts" / "scale_out.sh"), "start", "--servers", "0", "--dir", str(folder)],
                   check=True, capture_output=True, timeout=900)
    found = dict(line.split("=", 1) for line in (folder / "cluster.env").read_text().splitlines() if "=" in line)
    return {"MONGODB_URI": found["MONGODB_URI"].strip('"'), "REDIS_URL": found["REDIS_URL"]}


def one_run(args: argparse.Namespace, body: str, label: str, env: dict[str, str], checkout: Path) -> dict:
    """One server, the others' calls before, during and after one big call; printed, and the figures returned."""
    from jacserver import JacServer

    load_before = os.getloadavg()[0]
    print(f"--- {label} (load average {load_before:.1f})", flush=True)
    with tempfile.TemporaryDirectory(prefix="shared-server-") as folder:
        gc_log = Path(folder) / "gc.log"
        if args.gc_probe:
            (Path(folder) / "probe").mkdir()
            (Path(folder) / "probe" / "sitecustomize.py").write_text(GC_PROBE)
            env = {**env, "PYTHONPATH": str(Path(folder) / "probe"), "SHARED_SERVER_BENCH_GC_LOG": str(gc_log)}
        if args.scale_out:
            env = {**env, **scale_out_stores(Path(folder) / "stores")}
        server = JacServer(Path(folder) / "server", checkout=checkout.resolve(), jac=Path(program(checkout, "jac")), **env)
        try:
            server.start()
            calls, stop = Calls(args.pause), threading.Event()
            with httpx.Client(base_url=server.url, timeout=1800) as http:
                token = register(http, f"big-{secrets.token_hex(3)}")
                users = [threading.Thread(target=ordinary_user, args=(server.url, n, calls, stop), daemon=True)
                         for n in range(args.users)]
                for user in users:
                    user.start()
                time.sleep(args.before)
                began = time.monotonic()
                response = http.post("/walker/ingest_events", content=body,
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
                ended = time.monotonic()
                print(f"big call: {args.messages:,} messages ({len(body) / 1e6:.1f} MB body) ingested in one call: "
                      f"{ended - began:.1f} s, status {response.status_code}", flush=True)
                if response.status_code != 200:
                    print(f"  {response.text[:300]}")
                time.sleep(args.after)
                stop.set()
                for user in users:
                    user.join(timeout=120)
            during = [r for r in calls.rows if began <= r[0] <= ended]
            # In progress from 1 s before the big call's answer to `after` s after it.
            around_end = [r for r in calls.rows if r[0] <= ended + args.after and r[0] + r[1] >= ended - 1]
            # The calls before the big one, past the first logins (the same load, without it).
            before = [r for r in calls.rows if began - args.before / 2 <= r[0] < began]
            print(f"the {args.users} others, whole run: {summary(calls.rows)}")
            print(f"the {args.users} others, before the big call (its last {args.before / 2:.0f} s): {summary(before)}")
            print(f"  their calls on sessions: {summary(on_sessions(before))}")
            print(f"the {args.users} others, while the big call ran: {summary(during)}")
            print(f"  their calls on sessions (all but register and login): {summary(on_sessions(during))}")
            print(f"the {args.users} others around its end (in progress from 1 s before its answer to "
                  f"{args.after:.0f} s after): {summary(around_end)}")
            print(f"  their calls on sessions: {summary(on_sessions(around_end))}")
            shift = time.time() - time.monotonic()
            if args.gc_probe:
                print(f"server: {collections(gc_log, began + shift, ended + shift, args.after)}")
            slow: dict[int, int] = {}
            for row in on_sessions(during):
                if row[1] > 1.0:
                    slow[int(row[0] - began)] = slow.get(int(row[0] - began), 0) + 1
            print("  their calls on sessions over 1 s, by the second of the big call they began in: "
                  + (", ".join(f"{second} s: {count}" for (second, count) in sorted(slow.items())) or "none"))
            by_kind: dict[str, list] = {}
            for row in during:
                by_kind.setdefault(row[3], []).append(row)
            for kind, rows in sorted(by_kind.items()):
                print(f"  {kind}: {summary(rows)}")
            for error in calls.errors[:5]:
                print(f"  error: {error}")
            if len(calls.errors) > 5:
                print(f"  ... {len(calls.errors) - 5} more errors")
            if args.calls_log:
                args.calls_log.write_text("".join(f"{start + shift:.3f} {seconds:.3f} {status} {what}\n"
                                                  for start, seconds, status, what in sorted(calls.rows)))
                print(f"big call from {began + shift:.3f} to {ended + shift:.3f} (wall clock); calls in {args.calls_log}")
            log = server.log.read_text(errors="replace")
            print(f"'database is locked' in the server log: {log.count('database is locked')} times", flush=True)
            if args.scale_out:
                print(f"'MongoDB apply' errors / 'Traceback' in the server log: {log.count('MongoDB apply')} / "
                      f"{log.count('Traceback')}", flush=True)
        finally:
            server.stop()
            if args.scale_out:
                subprocess.run(["bash", str(REPO / "scripts" / "scale_out.sh"), "stop", "--dir", str(Path(folder) / "stores")],
                               check=False, capture_output=True)
            if args.keep_log:
                args.keep_log.write_text(server.log.read_text(errors="replace"))
    return {"label": label, "big": ended - began, "status": response.status_code,
            "failed": sum(1 for r in calls.rows if r[2] >= 500), "during": percentiles(on_sessions(during)),
            "calls": len(on_sessions(during)), "before": percentiles(on_sessions(before)),
            "end": percentiles(on_sessions(around_end)),
            "load": (load_before, os.getloadavg()[0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=40_000)
    parser.add_argument("--users", type=int, default=30)
    parser.add_argument("--pause", type=float, default=1.0, help="seconds each ordinary user waits between its calls")
    parser.add_argument("--keep-log", type=Path, help="copy the server's log here (the last run's)")
    parser.add_argument("--before", type=float, default=40.0, help="seconds the others run before the big call")
    parser.add_argument("--after", type=float, default=5.0, help="seconds the others go on after the big call")
    parser.add_argument("--checkout", type=Path, default=REPO, help="serve this checkout's Jac modules with its venv's jac")
    parser.add_argument("--switch-intervals", default="",
                        help="comma-separated CONTEXTRENDER_SWITCH_INTERVAL values (ms) served in turn, "
                             "'default' for the server's default: e.g. default,1,0.5")
    parser.add_argument("--rounds", type=int, default=1, help="times each setting is run, alternated")
    parser.add_argument("--alternate", type=Path, help="also serve this checkout, run after run with --checkout's (a before/after)")
    parser.add_argument("--calls-log", type=Path,
                        help="write every ordinary call here, one line each: wall-clock start, seconds, status, kind "
                             "(the last run's; to line up a stall with the server's log or a profile)")
    parser.add_argument("--scale-out", action="store_true",
                        help="serve from MongoDB (the stand-in) and Redis, new ones for each run, instead of SQLite")
    parser.add_argument("--gc-probe", action="store_true",
                        help="time the server's garbage collections (gc.callbacks in a sitecustomize) and print the full ones")
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)

    settings = [s.strip() for s in args.switch_intervals.split(",") if s.strip()] or ["default"]
    body = json.dumps({"session_id": "big", "messages": big_session(args.messages)})
    results = []
    checkouts = [args.checkout] + ([args.alternate] if args.alternate else [])
    for round_ in range(1, args.rounds + 1):
        for setting in settings:
            for checkout in checkouts:
                env = {} if setting == "default" else {"CONTEXTRENDER_SWITCH_INTERVAL": setting}
                label = f"round {round_}, switch interval {setting if setting == 'default' else setting + ' ms'}"
                label += f", {checkout}" if args.alternate else ""
                results.append(one_run(args, body, label, env, checkout))
    if len(results) > 1:
        print("\n| run | big call | others' 5xx | on sessions while it ran: calls, p50 / p95 | around its end: p50 / p95 "
              "| before it: p50 / p95 | load |")
        print("|---|---|---|---|---|---|---|")
        for r in results:
            print(f"| {r['label']} | {r['big']:.1f} s ({r['status']}) | {r['failed']} | {r['calls']}, "
                  f"{r['during'][0]:,.0f} / {r['during'][1]:,.0f} ms | {r['end'][0]:,.0f} / {r['end'][1]:,.0f} ms | {r['before'][0]:,.0f} / {r['before'][1]:,.0f} ms | "
                  f"{r['load'][0]:.1f}-{r['load'][1]:.1f} |")


if __name__ == "__main__":
    main()
