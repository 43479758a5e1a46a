"""contextrender.jac, the server's entry, and `import contextrender`, the Python package: both hold
in one process tree (docs/design-decisions.md, "One name, two faces")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from contextrender import Client
from tests.conftest import assistant, call, tool, user

REPO = Path(__file__).resolve().parent.parent


def run_python(code: str, cwd: Path = REPO) -> dict:
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_contextrender_is_the_python_package_and_loads_no_jac():
    seen = run_python("import contextrender, json, sys; "
                      "print(json.dumps({'file': contextrender.__file__, 'jaclang': 'jaclang' in sys.modules}))")
    assert seen == {"file": str(REPO / "adapters" / "__init__.py"), "jaclang": False}


def test_after_jaclang_the_entry_stands_in_for_the_package_with_the_same_names():
    # From the checkout's root (its jac.toml makes it jaclang's project root), jaclang's importer
    # answers `import contextrender` with contextrender.jac: the Python API is still there.
    code = """
import json, jaclang
import contextrender
from contextrender import Engine, Client, InvalidRequest
from contextrender.proxy.chat.wire import CHAT
from jaclang.jac0core.runtime import plugin_manager
print(json.dumps({
    "file": contextrender.__file__, "path": contextrender.__path__,
    "engine": Engine.__module__, "client": Client.__module__, "error": InvalidRequest.__name__,
    "walkers": sorted(n for n in ("render_context", "ingest_events", "health") if n in vars(contextrender)),
    "server_class": plugin_manager.hook.get_api_server_class().__name__,
}))
"""
    seen = run_python(code)
    assert seen["file"] == str(REPO / "contextrender.jac")
    assert seen["path"] == [str(REPO / "adapters")]
    assert (seen["engine"], seen["client"], seen["error"]) == ("contextrender.local", "contextrender.client", "InvalidRequest")
    assert seen["walkers"] == ["health", "ingest_events", "render_context"]
    assert seen["server_class"] == "ContextRenderServer"


def test_jac_start_serves_the_entry_to_a_client_of_the_python_package(jac_server):
    # This process uses the Python package; its child `jac start contextrender.jac` (the suite's
    # server, on a copy of the checkout) serves the walkers.
    with Client(jac_server.url) as client:
        client.register("entry-user", "secret-password-1")
        messages = [user("Refund order ORD_0001")]
        messages += [assistant(None, call("c1", "lookup", {"id": "ORD_0001"})), tool("c1", "order ORD_0001: 2 items")]
        rendered = client.render("entry", messages, budget=600)
    assert rendered.history_tokens > 0 and "ORD_0001" in json.dumps(rendered.messages)
