"""How long ContextRender takes to start: the import, the proxy's first answer, the server's
readiness (issue 18's targets: <= 2 s, <= 5 s, <= 10 s warm). Each measure runs in a new process,
`--rounds` times, the measures alternated within a round; prints medians.

    .venv/bin/python benchmarks/start_bench.py --rounds 3

`import + byllm` is the engine's import plus `import byllm.lib`: what importing the engine cost
when engine/summaries.jac imported byLLM (and litellm) at load.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from contextrender_adapters.fakeupstream import FakeUpstream
from contextrender_adapters.loopback import free_port

BIN = Path(sys.executable).parent


def _timed_python(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return time.perf_counter() - start


def _until_answered(command: list[str], probe, cwd: str, timeout: float = 600) -> float:
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
                raise RuntimeError(f"{command[0]} exited with {process.returncode}")
            time.sleep(0.05)
        raise RuntimeError(f"no answer within {timeout} s")
    finally:
        process.terminate()
        process.wait(timeout=30)


def proxy_first_answer(upstream: FakeUpstream, store: str) -> float:
    port = free_port()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    probe = lambda: httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60).status_code == 200
    return _until_answered([str(BIN / "contextrender"), "proxy", "--upstream", upstream.base_url, "--budget", "6000",
                            "--port", str(port), "--store", store], probe, store)


def serve_ready(store: str) -> float:
    port = free_port()
    probe = lambda: httpx.post(f"http://127.0.0.1:{port}/walker/health", json={}, timeout=5).status_code == 200
    return _until_answered([str(BIN / "contextrender"), "serve", "--port", str(port), "--store", store], probe, store)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    figures: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as scratch, FakeUpstream() as upstream:
        for number in range(args.rounds):
            measures = {
                "python -c 'import contextrender'": lambda: _timed_python("import contextrender"),
                "import contextrender_adapters.engine": lambda: _timed_python("import contextrender_adapters.engine"),
                "the same + import byllm.lib (as before)": lambda: _timed_python("import contextrender_adapters.engine, byllm.lib"),
                "contextrender proxy: first answer": lambda: proxy_first_answer(upstream, scratch),
                "contextrender serve: ready (warm)": lambda: serve_ready(scratch),
            }
            for name, measure in measures.items():
                figures.setdefault(name, []).append(measure())
                print(f"round {number + 1}: {name}: {figures[name][-1]:.2f} s", file=sys.stderr, flush=True)
    for name, values in figures.items():
        print(f"{name:45s} median {statistics.median(values):6.2f} s  ({', '.join(f'{v:.2f}' for v in values)})")


if __name__ == "__main__":
    main()
