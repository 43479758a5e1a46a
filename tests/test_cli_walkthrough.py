"""README.md's offline walkthrough, run as written: the commands are read from the README itself
(its first bash block under "A walkthrough, offline"), run by bash in a temporary folder with this
environment's `python` and `contextrender` first on PATH, and what they print is checked against
the two output blocks the README shows after them. Only the two ports are changed (to free ones),
so that the test runs beside anything else on the machine."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from contextrender.testing.loopback import free_port

README = Path(__file__).resolve().parent.parent / "README.md"
SECTION = "## A walkthrough, offline"
# The ports the README's commands use: the fake upstream's, then the proxy's.
PORTS = ("9000", "8800")
TIMEOUT = 300  # seconds, for the whole walkthrough (about 40 s on two loaded cores)


def walkthrough() -> tuple[str, list[str]]:
    """The commands of the walkthrough and the output blocks shown after them."""
    text = README.read_text(encoding="utf-8")
    assert SECTION in text, f"README.md has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", section, flags=re.S | re.M)
    commands = [body for (language, body) in blocks if language == "bash"]
    outputs = [body for (language, body) in blocks if language == ""]
    assert len(commands) == 1 and len(outputs) == 2, "the walkthrough: one bash block, then two output blocks"
    return commands[0], outputs


def columns(line: str) -> list[str]:
    """A table line's cells (the replay aligns them with two or more spaces)."""
    return re.split(r"\s{2,}", line.strip())


def table_rows(lines: list[str]) -> dict[str, dict[str, str]]:
    """The replay table in `lines` (from its `selector` header): selector -> column -> value."""
    start = next(i for (i, line) in enumerate(lines) if line.startswith("selector "))
    header = columns(lines[start])
    rows = {}
    for line in lines[start + 1:]:
        cells = columns(line)
        if len(cells) != len(header):
            break
        rows[cells[0]] = dict(zip(header, cells))
    return rows


def test_the_readme_walkthrough_runs_as_written(tmp_path):
    if shutil.which("curl") is None:
        pytest.skip("the walkthrough's commands use curl, which is not installed here")
    commands, (model_saw, replay) = walkthrough()
    for port in PORTS:
        assert port in commands, f"the walkthrough no longer uses port {port}: update PORTS"
    for port in PORTS:
        commands = commands.replace(port, str(free_port()))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("CONTEXTRENDER_STORE", None)  # the proxy's store: .contextrender in the folder, as for a user
    process = subprocess.Popen(["bash", "-c", commands], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        out, err = "", f"the walkthrough did not finish within {TIMEOUT} s"
    finally:
        try:
            os.killpg(process.pid, signal.SIGTERM)  # the fake upstream and the proxy, if still running
        except ProcessLookupError:
            pass
        process.wait(timeout=30)
    assert process.returncode == 0, f"exit status {process.returncode}\n{err[-3000:]}"
    printed = [line.rstrip() for line in out.splitlines()]

    # What the model saw at the last call: every line the README shows (it elides the rest).
    for line in model_saw.splitlines():
        if line.strip() != "...":
            assert line.rstrip() in printed, f"README shows a line the walkthrough did not print:\n{line}"

    # The replay: every figure the README shows, by selector and column (it elides some columns).
    shown, measured = table_rows(replay.splitlines()), table_rows(printed)
    assert shown.keys() == measured.keys()
    for selector, figures in shown.items():
        for column, value in figures.items():
            if column != "...":
                assert measured[selector][column] == value, (selector, column, measured[selector][column], value)
    assert (tmp_path / "run.jsonl").is_file()
