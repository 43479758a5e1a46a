"""The package as a user installs it: the wheel and the sdist built from this checkout, the wheel
installed (not editable) into a new virtual environment, and used from an empty folder, where
nothing of the checkout is on the path.

Slow (a build with the Jac modules precompiled, an install from pip's cache, a server start): about
5-8 min.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import textwrap
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from contextrender.server.access_table import FALLBACK
from contextrender.testing.loopback import free_port, stop_process

REPO = Path(__file__).resolve().parent.parent
# The Jac modules of the checkout (not jaclang's .jac/ cache folders, which rglob also matches).
JAC_SOURCES = sorted(str(p.relative_to(REPO)) for d in ("graph", "engine", "walkers") for p in (REPO / d).rglob("*.jac")
                     if p.is_file() and ".jac" not in p.relative_to(REPO).parts)


def _run(command: list[str], cwd: Path, timeout: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, f"{' '.join(command)} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(out), str(REPO)], cwd=out)
    return out


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory) -> Path:
    """A new environment (not the test's own) holding the wheel with the proxy's and the server's extras."""
    where = tmp_path_factory.mktemp("venv") / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    _run([base, "-m", "venv", str(where)], cwd=where.parent)
    wheel = next(dist.glob("contextrender-*.whl"))
    _run([str(where / "bin" / "python"), "-m", "pip", "install", "--quiet", f"{wheel}[proxy,server]",
          "-c", str(REPO / "constraints.txt")], cwd=where.parent)
    return where


def test_the_wheel_carries_the_jac_engine_and_its_compiled_form(dist):
    wheel = next(dist.glob("contextrender-*.whl"))
    # It ships bytecode for one Python (the precompiled bundle), and says so in its tag.
    assert wheel.name.endswith(f"-cp{sys.version_info.major}{sys.version_info.minor}-none-any.whl"), wheel.name
    names = set(zipfile.ZipFile(wheel).namelist())
    for source in JAC_SOURCES:
        assert f"contextrender/jac/{source}" in names, source
    assert {"contextrender/jac/contextrender.jac", "contextrender/jac/jac.toml", "contextrender/__init__.py", "contextrender/inspector/static/inspector.js"} <= names
    compiled = {n for n in names if n.startswith("contextrender/_precompiled/cpython-312/jac/") and n.endswith(".jir")}
    modules = [s for s in JAC_SOURCES if ".impl." not in s] + ["contextrender.jac"]
    assert len(compiled) == len(modules), sorted(compiled)
    # Each bundle file carries its module's access table (setup.py), which `serve` reads.
    from jaclang.jac0core.jir import HEADER_SIZE, SEC_INTEROP, SECTIONS_MAGIC, read_sections

    for name in compiled:
        data = zipfile.ZipFile(wheel).read(name)
        section = read_sections(data, data.find(SECTIONS_MAGIC, HEADER_SIZE) + len(SECTIONS_MAGIC)).get(SEC_INTEROP)
        assert section is not None and "walker_access" in json.loads(section), name
    assert not [n for n in names if "/.jac/" in n], "a build's module cache went into the wheel"
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: MIT" in metadata
    assert not [line for line in metadata.splitlines() if line.startswith("Requires-Dist: jac-scale") and "extra ==" not in line]


def test_the_sdist_carries_what_the_wheel_is_built_from(dist):
    sdist = next(dist.glob("contextrender-*.tar.gz"))
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"setup.py", "pyproject.toml", "contextrender.jac", "jac.toml", "LICENSE", "constraints.txt"} <= names
    assert set(JAC_SOURCES) <= names


def test_an_installed_wheel_renders_and_runs_its_commands_from_an_empty_folder(venv, tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    python = str(venv / "bin" / "python")
    env = {k: v for (k, v) in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    script = textwrap.dedent("""
        import json, contextrender
        assert {"Engine", "Client", "AsyncClient", "InvalidRequest", "RenderResult"} <= set(contextrender.__all__)
        messages = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "Fix src/."}]
        for n in range(8):
            messages += [{"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{n}", "type": "function",
                          "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/m{n}.py"})}}]},
                         {"role": "tool", "tool_call_id": f"call_{n}", "content": f"def f{n}(x):\\n" + "    x = x + 1\\n" * 40}]
        engine = contextrender.Engine("store")
        result = engine.render("run-1", messages, budget=600)
        print(json.dumps({"history_tokens": result.history_tokens, "omitted": result.omitted,
                          "module": contextrender.Engine.__module__, "file": __import__("contextrender").__file__}))
    """)
    answer = json.loads(_run([python, "-c", script], cwd=folder, env=env).stdout.strip().splitlines()[-1])
    assert 0 < answer["history_tokens"] <= 600 and answer["omitted"] > 0, answer
    assert str(venv) in answer["file"] and str(REPO) not in answer["file"]
    assert (folder / "store" / ".jac" / "data").is_dir()
    helped = _run([str(venv / "bin" / "contextrender"), "--help"], cwd=folder, env=env).stdout
    assert all(command in helped for command in ("proxy", "serve", "replay", "sweep"))


SERVE_TIMEOUT = 180.0  # a start here takes seconds; the compile it must not fall back to, 20-60 s


def test_an_installed_wheel_serves_without_compiling_its_modules(venv, tmp_path):
    """`contextrender serve` from the wheel reads the walkers' access levels from the wheel's
    precompiled bundle (setup.py adds them there), not from a compile of every module."""
    folder = tmp_path / "empty"
    folder.mkdir()
    env = {k: v for (k, v) in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "CONTEXTRENDER_ACCESS_FROM_CACHE")}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([str(venv / "bin" / "contextrender"), "serve", "--port", str(port), "--store", "store"],
                                   cwd=folder, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + SERVE_TIMEOUT
        ready = False
        while not ready and time.monotonic() < deadline and process.poll() is None:
            try:
                ready = httpx.post(f"{url}/walker/health", json={}, timeout=5).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.3)
        assert ready, f"not ready after {SERVE_TIMEOUT} s (exit {process.poll()}):\n{log.read_text()[-3000:]}"
        # The access levels are the served ones: health is public, the other walkers need a login.
        assert httpx.post(f"{url}/walker/list_sessions", json={}, timeout=30).status_code == 401
    finally:
        stop_process(process)
    assert FALLBACK not in log.read_text(), log.read_text()[-3000:]
