"""The real opencode for tests: opencode 1.18.33's binary, installed once with `npm ci
--ignore-scripts` from the lock file in tests/fixtures/opencode/ into .cache/opencode (or
$CONTEXTRENDER_OPENCODE_DIR). opencode is one self-contained binary per platform (a Bun build,
about 180 MB), shipped in the optional packages of `opencode-ai`, `opencode-<os>-<arch>[-baseline]
[-musl]`; `opencode-ai` itself only adds a postinstall script that copies one of them to its
`bin/`. The lock file holds the two linux-x64 packages directly (the registry we locked against had
no other platform's), npm installs those that fit the machine, `binary()` takes the first that
answers `--version`, and the test skips, saying so, where none was installed. 354 MB on disk.

`offline_env()` and `plugin_dependencies()` keep opencode on loopback: without them `opencode run`
fetches the model list from models.opencode.ai and installs @opencode-ai/plugin from the npm
registry into each config folder before it loads the folder's plugins (docs/integrations.md)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from tests.npm_package import installed, locked_install

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "opencode"
VERSION = "1.18.33"


def opencode_home() -> Path:
    """The install folder, made on first use."""
    home = Path(os.environ.get("CONTEXTRENDER_OPENCODE_DIR") or ROOT / ".cache" / "opencode")
    return locked_install(home, {"": FIXTURES}, npm_args=("--ignore-scripts",))


def binary() -> Path:
    """The opencode binary for this machine (skips if the lock file has none for it)."""
    home = opencode_home()
    names = {"Linux": "linux", "Darwin": "darwin", "Windows": "windows"}
    arches = {"x86_64": "x64", "AMD64": "x64", "aarch64": "arm64", "arm64": "arm64"}
    base = f"opencode-{names.get(platform.system(), platform.system().lower())}-{arches.get(platform.machine(), platform.machine())}"
    exe = "opencode.exe" if platform.system() == "Windows" else "opencode"
    tried = []
    for variant in ("", "-baseline", "-musl", "-baseline-musl"):
        path = home / "node_modules" / f"{base}{variant}" / "bin" / exe
        if not path.exists():
            continue
        tried.append(path.parent.parent.name)
        done = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60)
        if done.returncode == 0 and done.stdout.strip() == VERSION:
            return path
    if tried:
        pytest.fail(f"no opencode binary of {tried} runs here (`--version` failed)")
    pytest.skip(f"opencode-ai {VERSION}'s lock file (tests/fixtures/opencode) has no binary for this platform ({base})")


def plugin_dependencies(folder: Path) -> None:
    """What opencode installs into a config folder before it loads the folder's plugins
    (@opencode-ai/plugin, in `package.json` and its lock file), put there from our own lock file,
    so that opencode finds it up to date and installs nothing."""
    package = installed("opencode", "@opencode-ai/plugin")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "package.json").write_text(json.dumps({"dependencies": {"@opencode-ai/plugin": VERSION}}, indent=2))
    shutil.copy(package / "package-lock.json", folder / "package-lock.json")
    link = folder / "node_modules"
    if not link.exists():
        link.symlink_to(package / "node_modules", target_is_directory=True)


def offline_env(home: Path, project: Path, proxy: str) -> dict[str, str]:
    """opencode's environment for a test: its own HOME, its network features off, and `proxy` (a
    loopback port) as the HTTP(S) proxy of anything that still reaches past loopback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENCODE_", "XDG_")) and k.lower() not in
           ("http_proxy", "https_proxy", "all_proxy", "no_proxy")}
    env.update(HOME=str(home), PWD=str(project), NO_COLOR="1",
               XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local" / "share"),
               XDG_CACHE_HOME=str(home / ".cache"), XDG_STATE_HOME=str(home / ".local" / "state"),
               OPENCODE_DISABLE_MODELS_FETCH="1",  # the model list of models.opencode.ai
               OPENCODE_DISABLE_AUTOUPDATE="1", OPENCODE_DISABLE_SHARE="1", OPENCODE_DISABLE_LSP_DOWNLOAD="1",
               OPENCODE_DISABLE_DEFAULT_PLUGINS="1",  # the built-in provider-login plugins
               OPENCODE_DISABLE_CLAUDE_CODE="1", OPENCODE_DISABLE_EXTERNAL_SKILLS="1",
               HTTP_PROXY=proxy, HTTPS_PROXY=proxy, http_proxy=proxy, https_proxy=proxy,
               NO_PROXY="127.0.0.1,localhost,::1", no_proxy="127.0.0.1,localhost,::1")
    return env


class ProxyTrap:
    """A loopback port given to opencode as its proxy: it records the first line of every
    connection (the CONNECT or GET of a request that would have left the machine) and closes it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    self.requests.append(conn.recv(4096).split(b"\r\n", 1)[0].decode("latin-1"))
                except OSError:
                    self.requests.append("(nothing read)")

    def close(self) -> None:
        self.sock.close()
