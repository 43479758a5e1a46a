"""How long ContextRender takes to start (the start targets on two cores, docs/performance.md: `import contextrender`
<= 2 s, the proxy's first answer <= 5 s after it starts, `contextrender serve` ready <= 10 s warm).

    .venv/bin/python benchmarks/start_bench.py --rounds 3
    .venv/bin/python benchmarks/start_bench.py --rounds 3 --python ../before/.venv/bin/python --python .venv/bin/python
    .venv/bin/python benchmarks/start_bench.py --rounds 3 --only serve --python <a venv holding the wheel>/bin/python

Each measure runs in a new process; with several `--python` (environments with ContextRender
installed, e.g. a checkout before and after a change) the measures and the environments alternate
within each round, so that they share the machine's load. One unmeasured round first fills the
compile caches and the store (the figures are for a warm install). Prints, per environment and
measure, the median wall time and the median CPU time of the measured process (user + system:
less sensitive to other work on the machine than the wall time), with the load average.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from contextrender.testing.fake_upstream import FakeUpstream
from contextrender.testing.loopback import free_port, stop_process

Measure = Callable[[Path, str], float]


def _cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _timed_import(python: Path, store: str) -> float:
    start = time.perf_counter()
    subprocess.run([str(python), "-c", "import contextrender"], check=True, capture_output=True, cwd=store)
    return time.perf_counter() - start


def _until_answered(command: list[str], probe: Callable[[], bool], cwd: str, timeout: float = 900) -> float:
    """Seconds from starting `command` to `probe()` first being true (retried until then)."""
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        while time.perf_counter() - start < timeout:
            try:
                if probe():
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            if process.poll() is not None:
                raise RuntimeError(f"{' '.join(command)} exited with {process.returncode}")
            time.sleep(0.05)
        raise RuntimeError(f"no answer within {timeout} s")
    finally:
        # Reaped before the next measure: jac-scale's drain takes up to 10 s, and RUSAGE_CHILDREN
        # counts a child's CPU only once it is reaped.
        stop_process(process)
        process.wait(timeout=60)


def proxy_first_answer(upstream: FakeUpstream) -> Measure:
    """The proxy on the engine in-process: from its start to its first managed answer."""

    def measure(python: Path, store: str) -> float:
        port = free_port()
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

        def probe() -> bool:
            answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=600)
            if answer.status_code != 200:
                return False
            status = answer.headers.get("x-contextrender-status", "")
            if status != "managed":
                raise RuntimeError(f"the proxy's first answer was not managed: {status!r}")
            return True

        return _until_answered([str(python.parent / "contextrender"), "proxy", "--upstream", upstream.base_url,
                                "--budget", "6000", "--port", str(port), "--store", store], probe, store)

    return measure


def serve_ready(python: Path, store: str) -> float:
    """`contextrender serve`: from its start to `POST /walker/health` answering."""
    port = free_port()
    probe = lambda: httpx.post(f"http://127.0.0.1:{port}/walker/health", json={}, timeout=30).status_code == 200
    return _until_answered([str(python.parent / "contextrender"), "serve", "--port", str(port), "--store", store], probe, store)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--python", action="append", type=Path,
                        help="the python of an environment to measure (repeatable; default: this one)")
    parser.add_argument("--only", action="append", choices=("import", "proxy", "serve"),
                        help="measure only this (repeatable; default: all three), e.g. --only serve")
    args = parser.parse_args()
    # Not resolved: a venv's python is often a link to the base interpreter.
    pythons = [Path(os.path.abspath(p)) for p in (args.python or [Path(sys.executable)])]
    figures: dict[tuple[int, str], list[tuple[float, float]]] = {}
    loads = [os.getloadavg()]
    with tempfile.TemporaryDirectory() as scratch, FakeUpstream() as upstream:
        measures: dict[str, Measure] = {
            "python -c 'import contextrender'": _timed_import,
            "contextrender proxy: first answer": proxy_first_answer(upstream),
            "contextrender serve: ready (warm)": serve_ready,
        }
        if args.only:  # the measures' names, by their position: import, proxy, serve
            keys = dict(zip(("import", "proxy", "serve"), measures))
            measures = {keys[key]: measures[keys[key]] for key in dict.fromkeys(args.only)}
        stores = {index: str(Path(scratch) / f"store-{index}") for index in range(len(pythons))}
        for store in stores.values():
            os.makedirs(store)
        for number in range(args.rounds + 1):  # round 0 warms the caches and the stores
            for name, measure in measures.items():
                for index, python in enumerate(pythons):
                    cpu = _cpu_of_children()
                    wall = measure(python, stores[index])
                    cpu = _cpu_of_children() - cpu
                    label = "warm-up" if number == 0 else f"round {number}"
                    print(f"{label}: [{index}] {name}: {wall:.2f} s wall, {cpu:.2f} s CPU", file=sys.stderr, flush=True)
                    if number:
                        figures.setdefault((index, name), []).append((wall, cpu))
            loads.append(os.getloadavg())
    for index, python in enumerate(pythons):
        print(f"[{index}] {python}")
    for (index, name), values in figures.items():
        walls, cpus = [w for (w, _) in values], [c for (_, c) in values]
        print(f"[{index}] {name:36s} median {statistics.median(walls):6.2f} s wall ({', '.join(f'{w:.2f}' for w in walls)}); "
              f"CPU {statistics.median(cpus):5.2f} s")
    print("load average (1 min) at the start and after each round: " + ", ".join(f"{load[0]:.1f}" for load in loads))


if __name__ == "__main__":
    main()
