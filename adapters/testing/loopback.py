"""Serving an ASGI app on a free loopback port from a background thread (tests, benchmarks)."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from typing import Any

import uvicorn

__all__ = ["LoopbackServer", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(process: subprocess.Popen, grace: float = 30) -> None:
    """Stop a server started as a child process and reap it: SIGTERM, then SIGKILL after `grace`
    seconds (a stopped server that still drains would run beside what comes next, and a child's
    CPU time counts only once it is reaped)."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class LoopbackServer:
    """Serves an ASGI app with uvicorn on 127.0.0.1 in a daemon thread (a context manager)."""

    def __init__(self, app: Any, port: int | None = None, **settings: Any) -> None:
        """`settings`: more of uvicorn.Config's (such as `contextrender.limits.uvicorn_settings()`)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on", **settings)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> LoopbackServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the loopback server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

