"""The proxy's request bounds as a user sees them: its memory before and after a body far over its
limit, how soon a declared oversized body is refused, and how soon SIGTERM stops it.

    .venv/bin/python benchmarks/proxy_limits_probe.py [--mb 100]

Starts `contextrender proxy` (the engine in-process on a fresh store, the fake upstream on
loopback), then: a request declaring 10 GB (nothing of it sent), a chunked body of `--mb` MB, and
SIGTERM. Prints the proxy process's resident memory (VmRSS, Linux) before and after, and each time.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from contextrender.testing.fake_upstream import FakeUpstream, free_port


def rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=100, help="the chunked body's size in MB (default 100)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder, FakeUpstream() as upstream:
        port = free_port()
        command = [sys.executable, "-m", "contextrender.cli", "proxy", "--upstream", upstream.base_url, "--budget", "600",
                   "--port", str(port), "--no-inspector"]
        process = subprocess.Popen(command, env=dict(os.environ, CONTEXTRENDER_STORE=f"{folder}/store"), cwd=folder,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
                    break
                except httpx.HTTPError:
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit("the proxy did not start")
                    time.sleep(0.3)
            print(f"proxy resident memory at start: {rss_mb(process.pid)} MB")
            started = time.monotonic()
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 10737418240\r\n\r\n")
                status = sock.recv(200).split(b"\r\n")[0].decode()
            print(f"declared 10 GB: {status} after {time.monotonic() - started:.2f} s")

            def chunks():
                for _ in range(args.mb):
                    yield b"x" * (1024 * 1024)

            started = time.monotonic()
            try:
                answer = str(httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", content=chunks(), timeout=120).status_code)
            except httpx.HTTPError as exc:
                answer = f"connection closed ({type(exc).__name__})"
            print(f"chunked {args.mb} MB: {answer} after {time.monotonic() - started:.2f} s")
            print(f"proxy resident memory after: {rss_mb(process.pid)} MB")
            started = time.monotonic()
            process.terminate()
            process.wait(timeout=60)
            print(f"SIGTERM: exited in {time.monotonic() - started:.2f} s")
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


if __name__ == "__main__":
    main()
