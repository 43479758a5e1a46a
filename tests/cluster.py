"""Several `jac start` servers on one MongoDB stand-in and one Redis, started and stopped by
scripts/scale_out.sh (the script users run), for tests and benchmarks."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "scale_out.sh"


class Cluster:
    def __init__(self, workdir: Path, servers: int = 2, sqlite: bool = False, **env: str) -> None:
        self.workdir = Path(workdir)
        self.servers = servers
        self.sqlite = sqlite
        self.env = dict(os.environ) | env
        self.state: dict[str, str] = {}

    def start(self) -> Cluster:
        args = ["bash", str(SCRIPT), "start", "--servers", str(self.servers), "--dir", str(self.workdir)]
        done = subprocess.run(args + (["--sqlite"] if self.sqlite else []), env=self.env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"scale_out.sh start failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        self.state = self.read_state()
        return self

    def read_state(self) -> dict[str, str]:
        state = {}
        for line in (self.workdir / "cluster.env").read_text().splitlines():
            key, _, value = line.partition("=")
            state[key] = shlex.split(value)[0] if value else ""
        return state

    @property
    def urls(self) -> list[str]:
        return self.state["SERVER_URLS"].split(",")

    @property
    def pids(self) -> list[int]:
        return [int(p) for p in self.state["SERVER_PIDS"].split(",")]

    @property
    def redis_url(self) -> str:
        return self.state["REDIS_URL"]

    def log(self, i: int) -> str:
        return (self.workdir / f"server-{i + 1}" / "server.log").read_text(errors="replace")

    def kill(self, i: int) -> None:
        """kill -9 of server i: no shutdown hook runs."""
        os.kill(self.pids[i], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and Path(f"/proc/{self.pids[i]}").exists():
            with open(f"/proc/{self.pids[i]}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "Z":
                    break
            time.sleep(0.05)

    def stop(self) -> None:
        subprocess.run(["bash", str(SCRIPT), "stop", "--dir", str(self.workdir)], env=self.env, capture_output=True, timeout=120)
