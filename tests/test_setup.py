"""scripts/setup.sh: safe to run twice at once (`serve.sh` and `test.sh` started together), with
util-linux's `flock` and, on machines without it (macOS), with its `mkdir` lock.

A run's first step after its lock is `sha1sum pyproject.toml`: the tests put a `sha1sum` on PATH
that records when it ran, so they see when the waiting run went on, against when the lock it
waited for was released."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SETUP = ["bash", str(ROOT / "scripts" / "setup.sh")]
HOLD = 3.0  # seconds the test holds the lock


def tools(folder: Path, without: tuple[str, ...] = ()) -> dict[str, str]:
    """An environment whose PATH is `folder`: every command of the current PATH linked there
    except `without`, and a `sha1sum` that appends the time it ran to folder/ran."""
    folder.mkdir()
    for directory in reversed(os.environ["PATH"].split(os.pathsep)):  # the first on PATH wins
        if not os.path.isdir(directory):
            continue
        for entry in os.scandir(directory):
            target = folder / entry.name
            if entry.name in without or not os.access(entry.path, os.X_OK) or entry.is_dir():
                continue
            target.unlink(missing_ok=True)
            target.symlink_to(entry.path)
    real = shutil.which("sha1sum")
    stamp = folder / "sha1sum"
    stamp.unlink()
    stamp.write_text(f"#!/bin/sh\n'{sys.executable}' -c 'import time; print(repr(time.time()))' >> '{folder}/ran'\n"
                     f"exec '{real}' \"$@\"\n")
    stamp.chmod(0o755)
    return dict(os.environ, PATH=str(folder))


def went_on_at(folder: Path) -> list[float]:
    ran = folder / "ran"
    return [float(line) for line in ran.read_text().split()] if ran.exists() else []


@pytest.mark.skipif(shutil.which("flock") is None, reason="needs util-linux flock (the mkdir lock is tested below)")
def test_a_second_run_waits_until_the_first_releases_the_lock(tmp_path):
    env = tools(tmp_path / "bin")
    # Hold the lock as a running setup would: a new run goes on only once it is released.
    with open(ROOT / ".venv.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        waiting = subprocess.Popen(SETUP, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        time.sleep(HOLD)
        released = time.time()
    assert waiting.wait(timeout=300) == 0, waiting.stdout.read().decode()[-2000:]
    ran = went_on_at(tmp_path / "bin")
    assert len(ran) == 1 and ran[0] >= released, (ran, released)


def test_without_flock_a_second_run_waits_for_the_mkdir_lock(tmp_path):
    env = tools(tmp_path / "bin", without=("flock",))
    lock = ROOT / ".venv.lock.d"
    assert shutil.which("flock", path=env["PATH"]) is None
    lock.mkdir()  # held, as a running setup without flock holds it
    try:
        waiting = subprocess.Popen(SETUP, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        time.sleep(HOLD)
        released = time.time()
    finally:
        if lock.exists():
            lock.rmdir()
    out = waiting.communicate(timeout=300)[0].decode()
    assert waiting.returncode == 0, out[-2000:]
    ran = went_on_at(tmp_path / "bin")
    assert len(ran) == 1 and ran[0] >= released, (ran, released)
    assert "waiting for another run" in out
    assert not lock.exists()  # the run removed its own lock when it finished


def test_two_runs_at_once_both_succeed():
    runs = [subprocess.Popen(SETUP, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(2)]
    for run in runs:
        assert run.wait(timeout=600) == 0, run.stdout.read().decode()[-2000:]


def fake_apt(folder: Path) -> Path:
    """An apt-get on PATH that finds apt's lock held, as when another install runs: it records
    its arguments (one call a line) in the returned file and fails as apt-get does."""
    calls = folder.parent / "apt-calls"
    script = folder / "apt-get"
    script.write_text(f"#!/bin/sh\necho \"$*\" >> '{calls}'\n"
                      "echo 'E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 1 (apt-get)' >&2\nexit 100\n")
    script.chmod(0o755)
    return calls


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("apt-get") is None, reason="the apt step runs as root with apt-get only")
@pytest.mark.parametrize("tests", [False, True])
def test_an_apt_step_on_a_held_lock_is_retried_for_a_bounded_time_then_skipped(tmp_path, tests):
    env = tools(tmp_path / "bin", without=("dot", "chromium", "chromedriver", "apt-get"))
    calls = fake_apt(tmp_path / "bin")
    env["CONTEXTRENDER_APT_WAIT"] = "6"
    started = time.monotonic()
    done = subprocess.run(SETUP + (["--tests"] if tests else []), env=env, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - started
    # It stopped with `E: Could not get lock` and served nothing; now it goes on without graphviz.
    assert done.returncode == 0, done.stderr[-2000:]
    assert went_on_at(tmp_path / "bin"), "the run stopped at the apt step"
    skipped = [line for line in done.stderr.splitlines() if "skipped:" in line]
    assert any("graphviz" in line and "graph view" in line and "Could not get lock" in line for line in skipped), done.stderr
    assert len([line for line in skipped if "graphviz" in line]) == 1
    assert took < 120
    assert len(calls.read_text().splitlines()) >= 2  # tried again before giving up
    # The browser is for the tests only: serving never asks for it.
    assert ("chromium" in done.stderr) == tests
