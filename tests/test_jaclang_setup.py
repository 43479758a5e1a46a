"""adapters/jaclang_setup.py: a process that imports ContextRender before jaclang loads neither
jac-scale nor the server class, keeps what the user disabled, and leaves the environment as it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from contextrender.jaclang_setup import NOT_SERVING, user_disabled

PROBE = """
import json, os, sys
import contextrender.local
from jaclang.jac0core.runtime import plugin_manager
print(json.dumps({"jac_scale": "jac_scale" in sys.modules, "litellm": "litellm" in sys.modules,
                  "server_class": getattr(plugin_manager.hook.get_api_server_class(), "__name__", None),
                  "env": os.environ.get("JAC_DISABLED_PLUGINS")}))
"""


def probe(cwd, **env: str) -> dict:
    environment = {k: v for (k, v) in os.environ.items() if k not in ("JAC_DISABLED_PLUGINS", "CONTEXTRENDER_JAC_PLUGINS")}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env={**environment, **env}, capture_output=True,
                          text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_engine_loads_without_the_servers_plugins(tmp_path):
    seen = probe(tmp_path)
    assert not seen["jac_scale"] and not seen["litellm"]
    assert seen["server_class"] != "ContextRenderServer" and seen["env"] is None


def test_all_keeps_every_plugin_and_a_users_list_is_kept(tmp_path):
    every = probe(tmp_path, CONTEXTRENDER_JAC_PLUGINS="all")
    # jac-scale's plugin is loaded; ContextRender's server class only where the entry registers it.
    assert every["jac_scale"] and every["server_class"] == "JacAPIServer"
    assert probe(tmp_path, JAC_DISABLED_PLUGINS="byllm:*")["env"] == "byllm:*"


def test_the_users_disabled_list_is_read_as_jaclang_reads_it(tmp_path, monkeypatch):
    monkeypatch.delenv("JAC_DISABLED_PLUGINS", raising=False)
    (tmp_path / "jac.toml").write_text('[plugins]\ndisabled = ["byllm:*"]\n')
    (tmp_path / "sub").mkdir()
    assert user_disabled(tmp_path / "sub") == ["byllm:*"]
    monkeypatch.setenv("JAC_DISABLED_PLUGINS", "a:b, c")
    assert user_disabled(tmp_path) == ["a:b", "c"]
    assert set(NOT_SERVING) == {"jac-scale:*"}


def test_a_first_compile_says_so_with_progress_and_a_cached_load_says_nothing(monkeypatch, tmp_path):
    """The first `Engine()` in a checkout compiled for minutes with no output."""
    import io
    import time

    from contextrender import jaclang_setup

    monkeypatch.setattr(jaclang_setup, "NOTICE_AFTER", 0.05)
    monkeypatch.setattr(jaclang_setup, "NOTICE_EVERY", 0.05)
    monkeypatch.setattr(jaclang_setup, "_uncompiled", lambda: [tmp_path / "graph" / "context.jac"])
    out = io.StringIO()
    with jaclang_setup.compile_notice(out):
        time.sleep(0.3)
    said = out.getvalue()
    assert "compiling the Jac modules of this checkout, once (1 modules" in said
    assert "compiled 0 of 1 modules, " in said and said.rstrip().endswith("(the rest load when used); done")
    quick = io.StringIO()
    with jaclang_setup.compile_notice(quick):  # over before the notice is due
        pass
    monkeypatch.setattr(jaclang_setup, "_uncompiled", lambda: [])
    cached = io.StringIO()
    with jaclang_setup.compile_notice(cached):
        time.sleep(0.2)
    assert quick.getvalue() == "" and cached.getvalue() == ""
    # The modules a first use compiles: files only (jaclang's cache folders are named .jac too); in
    # this process (the tests loaded the engine) every one has its cache file.
    modules = jaclang_setup.jac_modules()
    assert len(modules) > 20 and all(m.is_file() and ".impl." not in m.name for m in modules)
    assert jaclang_setup._uncompiled() == []
