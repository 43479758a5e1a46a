"""Another checkout measured beside this one (a before/after in one run): the program of its own
environment that runs its code, and the order of alternated runs.

A checkout's code is run by its own `.venv` in its own folder: jaclang finds the Jac modules of the
folder it runs in first, and each checkout's environment holds its own build of the package.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def program(checkout: Path, name: str = "python") -> str:
    """`checkout`'s own `name` (`python`, `jac`, ...) in its .venv; this process's Python for this checkout."""
    checkout = checkout.resolve()
    if checkout == REPO and name == "python":
        return sys.executable
    return str(checkout / ".venv" / "bin" / name)


def in_turn(round_: int, *runs):
    """`runs` in the order of round `round_` (counted from 0): each round starts with the next one,
    so each runs first, second and so on in turn."""
    shift = round_ % len(runs)
    return list(runs[shift:] + runs[:shift])


def run_in(checkout: Path, script: str, arguments: list[str]) -> str:
    """`script` (this checkout's benchmark: the same measurement on both sides) run by `checkout`'s
    Python in `checkout`'s folder, so on its code, with `arguments`; what it printed."""
    checkout = checkout.resolve()
    done = subprocess.run([program(checkout), script, *arguments], cwd=checkout, capture_output=True, text=True, check=True)
    return done.stdout


def without(arguments: list[str], *options: str) -> list[str]:
    """`arguments` without `options` and their values (`--option VALUE` or `--option=VALUE`)."""
    kept, skip = [], False
    for argument in arguments:
        if skip:
            skip = False
        elif argument in options:
            skip = True
        elif argument.split("=")[0] not in options:
            kept.append(argument)
    return kept
