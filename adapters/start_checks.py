"""What `contextrender serve` and `contextrender proxy` check before they load anything slow, so
that a setting they cannot start with stops them within a second, with exit status 2 and one line
that says what to change (`Refused`): the port (taken: a server that moved to the next free one
would answer where the docs' commands do not point), the store folder (it must be writable: the
engine writes its SQLite store and the module cache there) and a URL flag (`--upstream`).

Standard library only: `contextrender --help` and a refusal import nothing else."""

from __future__ import annotations

import errno
import os
import socket
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

__all__ = ["Refused", "check_store", "check_url", "claim_port", "port_is_free"]


class Refused(Exception):
    """A setting the command cannot start with; its message says what to change."""


def claim_port(host: str, port: int, flag: str = "--port") -> socket.socket:
    """A socket bound to (host, port), not yet listening (a connection is refused until the
    server is ready); Refused when the port is taken or the host is not this machine's."""
    if not 0 < port < 65536:
        raise Refused(f"{flag} must be in 1-65535 (got {port})")
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as bad:
        raise Refused(f"--host {host!r} is not an address of this machine ({bad.strerror})") from None
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    # As uvicorn binds: a port whose last server just stopped (TIME_WAIT) is free.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(info[4])
    except OSError as bad:
        sock.close()
        if bad.errno == errno.EADDRINUSE:
            raise Refused(f"port {port} on {host} is in use: choose another with {flag} N "
                          "(or stop what listens there)") from None
        raise Refused(f"cannot listen on {host}:{port} ({bad.strerror}): choose another {flag} or --host") from None
    sock.set_inheritable(True)
    return sock


def port_is_free(host: str, port: int, flag: str = "--port") -> None:
    """Refused unless (host, port) can be bound now (for a server another process starts)."""
    claim_port(host, port, flag).close()


def check_store(path: str | Path, flag: str = "--store") -> Path:
    """The store folder, made if missing, as an absolute path; Refused when it cannot be written
    (the engine would fail minutes later, at its first compile or commit)."""
    folder = Path(path).expanduser().resolve()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / ".jac").mkdir(exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder / ".jac", prefix=".write-check-"):
            pass
    except OSError as bad:
        why = bad.strerror or type(bad).__name__
        raise Refused(f"the store folder {folder} cannot be written ({why}): choose another with {flag} "
                      "or make it writable") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise Refused(f"the store folder {folder} cannot be written: choose another with {flag} or make it writable")
    return folder


def check_url(value: str, flag: str, example: str) -> str:
    """`value` if it is an http(s) URL with a host; Refused otherwise."""
    try:
        parts = urlsplit(value.strip())
        parts.port  # noqa: B018 (raises ValueError for a port that is not a number)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise Refused(f"{flag} must be an http:// or https:// URL such as {example} (got {value!r})")
    return value.strip()
