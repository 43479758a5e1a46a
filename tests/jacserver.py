"""A real `jac start contextrender.jac` server for tests, on a copy of the project in a temp dir
(its own store), on a free loopback port."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from contextrender.testing.fake_upstream import free_port
from contextrender.testing.loopback import stop_process

REPO = Path(__file__).resolve().parent.parent
JAC = Path(sys.executable).parent / "jac"
SERVED = ("jac.toml", "graph", "engine", "walkers")
START_TIMEOUT = 240.0


class JacServer:
    """`checkout` and `jac`: another checkout's Jac modules and its venv's `jac` (a benchmark's
    before/after; a checkout from before `contextrender.jac` serves `contextrender_server.jac`);
    this checkout's by default."""

    def __init__(self, workdir: Path, checkout: Path = REPO, jac: Path = JAC, **env: str) -> None:
        self.workdir = workdir
        self.jac = jac
        workdir.mkdir(parents=True, exist_ok=True)
        self.entry = "contextrender.jac" if (checkout / "contextrender.jac").is_file() else "contextrender_server.jac"
        for name in (self.entry, *SERVED):
            source = checkout / name
            if source.is_dir():
                shutil.copytree(source, workdir / name, ignore=shutil.ignore_patterns("__pycache__", ".jac"))
            else:
                shutil.copy(source, workdir / name)
        self.env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", CONTEXTRENDER_HOST="127.0.0.1",
                        CONTEXTRENDER_JWT_SECRET=secrets.token_urlsafe(48)) | env
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.log = workdir / "server.log"

    def start(self) -> JacServer:
        log = open(self.log, "ab")
        self.process = subprocess.Popen(
            [str(self.jac), "start", self.entry, "--no_client", "-p", str(self.port)],
            cwd=self.workdir, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"jac start exited with {self.process.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.post(f"{self.url}/walker/health", json={}, timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"jac start not ready after {START_TIMEOUT} s:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        """kill -9: no shutdown hook runs."""
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process:
            stop_process(self.process, grace=20)
