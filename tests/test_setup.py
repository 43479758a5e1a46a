"""scripts/setup.sh: safe to run twice at once (`serve.sh` and `test.sh` started together)."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SETUP = ["bash", str(ROOT / "scripts" / "setup.sh")]


@pytest.mark.skipif(shutil.which("flock") is None, reason="needs util-linux flock")
def test_a_second_run_waits_for_the_first():
    # Hold the lock as a running setup would: a new run must wait for it, then finish.
    with open(ROOT / ".venv.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        waiting = subprocess.Popen(SETUP, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        time.sleep(2)
        assert waiting.poll() is None, "setup.sh ran while another run held the lock"
    assert waiting.wait(timeout=300) == 0, waiting.stdout.read().decode()[-2000:]


def test_two_runs_at_once_both_succeed():
    runs = [subprocess.Popen(SETUP, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(2)]
    for run in runs:
        assert run.wait(timeout=600) == 0, run.stdout.read().decode()[-2000:]
