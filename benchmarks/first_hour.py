"""The waits of a new user's first hour, measured as whole processes (the first-hour targets, docs/performance.md):

- `contextrender --help`: the first run (Python compiles the command line's modules) and the
  median of the next runs; target <= 1 s.
- the first `contextrender.Engine()` in a fresh checkout (a copy of HEAD's files, nothing
  compiled: jaclang compiles the Jac modules once), then a second one on the same copy; target for
  the first <= 60 s.
- `pip wheel --no-deps -w dist .` from a fresh copy (the README's command: build isolation,
  jaclang's precompile of the Jac modules); target <= 3 min.

Run from the checkout with its .venv:

    .venv/bin/python benchmarks/first_hour.py                 # all three
    .venv/bin/python benchmarks/first_hour.py --skip-wheel    # without the wheel build

The load average is printed beside the figures: on a loaded machine every wait is longer.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The import names and the checkout folders they come from (pyproject.toml's package-dir).
PACKAGES = {"contextrender": "adapters", "contextrender_eval": "evaluation", "contextrender_integrations": "integrations"}
TARGETS = {"help": 1.0, "engine": 60.0, "wheel": 180.0}


def fresh_checkout(where: Path) -> Path:
    """HEAD's files (no caches, no .venv) in `where`/checkout, and a folder `where`/path whose
    entries make the copy's packages importable ahead of the editable install."""
    checkout = where / "checkout"
    checkout.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(checkout)], input=archive, check=True)
    path = where / "path"
    path.mkdir()
    for (name, folder) in PACKAGES.items():
        (path / name).symlink_to(checkout / folder, target_is_directory=True)
    return checkout


CPU = {"seconds": 0.0}  # the CPU time (user + system) of the last timed command and its children


def timed(command: list[str], cwd: Path, env: dict[str, str] | None = None) -> float:
    """The command's wall time; its CPU time (with every process it started) in CPU["seconds"]:
    on these shared cores the wall time moves with the load, the CPU time much less."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    result = subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    took = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU["seconds"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {result.returncode}:\n{result.stderr[-2000:]}")
    return took


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def verdict(name: str, seconds: float) -> str:
    met = "met" if seconds <= TARGETS[name] else "MISSED"
    return f"{seconds:7.2f} s wall, {CPU['seconds']:7.2f} s CPU  (target <= {TARGETS[name]:g} s: {met} on the wall)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="warm `--help` runs (default 3)")
    parser.add_argument("--skip-wheel", action="store_true", help="do not build the wheel")
    parser.add_argument("--skip-engine", action="store_true", help="do not time the first Engine()")
    args = parser.parse_args()
    cli = Path(sys.executable).parent / "contextrender"
    print(f"load average before: {load()}")

    with tempfile.TemporaryDirectory() as scratch:
        checkout = fresh_checkout(Path(scratch))
        env = dict(os.environ, PYTHONPATH=str(Path(scratch) / "path"), PYTHONDONTWRITEBYTECODE="")
        # --help from the fresh copy: its first run compiles the command line's Python modules.
        first = timed([sys.executable, "-c", "import sys; from contextrender.cli import main; sys.argv[1:] = ['--help']; main()"],
                      cwd=Path(scratch), env=env)
        print(f"contextrender --help, first run in a fresh checkout: {verdict('help', first)}")
        warm = [timed([str(cli), "--help"], cwd=ROOT) for _ in range(args.rounds)]
        print(f"contextrender --help, median of {len(warm)} later runs: {verdict('help', statistics.median(warm))}")

        if not args.skip_engine:
            program = ("import os, sys, contextrender; assert os.path.realpath(contextrender.__file__).startswith(sys.argv[1]), contextrender.__file__; "
                       "contextrender.Engine(sys.argv[2])")
            command = [sys.executable, "-c", program, str(checkout), str(Path(scratch) / "store")]
            engine = timed(command, cwd=Path(scratch), env=env)
            print(f"first Engine() in a fresh checkout (compiles the Jac modules): {verdict('engine', engine)}  load {load()}")
            again = timed(command, cwd=Path(scratch), env=env)
            print(f"second Engine() on that checkout (from jaclang's cache): {again:7.2f} s")

        if not args.skip_wheel:
            wheel = timed([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(Path(scratch) / "dist"), "."], cwd=checkout)
            print(f"pip wheel --no-deps -w dist . (fresh checkout): {verdict('wheel', wheel)}  load {load()}")
    print(f"load average after: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
