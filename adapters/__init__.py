"""ContextRender's Python layer: the in-process `Engine`, the server `Client` (and
`AsyncClient`), the proxy's ASGI app, and the engine's errors and render types. Names are
imported on first use, so `contextrender --help` and the proxy's command line do not wait for the
engine to load. What the layer takes from the Jac modules comes through `core`.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

# The Jac modules (graph/, engine/, walkers/): in an installed wheel under jac/ in this package
# (setup.py), in a checkout (or an editable install) in the project folder beside it.
_INSTALLED = Path(__file__).resolve().parent / "jac"
PROJECT_ROOT = _INSTALLED if (_INSTALLED / "contextrender_server.jac").is_file() else Path(__file__).resolve().parent.parent
if str(PROJECT_ROOT) not in sys.path:
    sys.path.insert(0, str(PROJECT_ROOT))

# litellm (imported by byLLM) otherwise tries to download its price list at import; there is no
# network on many agent hosts, and its bundled copy is what we want.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

# jaclang (its .jac import hook), without jac-scale's plugins when this process does not serve
# (adapters/jac_plugins.py: they took most of every start).
from contextrender_adapters.jac_plugins import import_jaclang  # noqa: E402

import_jaclang()
# Stored nodes are rebuilt only from classes jaclang's serializer registered, and it registers a
# class when the class is made, if the serializer is loaded by then. jac-scale's plugin loads it
# first; without jac-scale (the engine beside Hermes) every stored session was unreadable.
from jaclang.runtimelib import serializer as _serializer  # noqa: E402,F401

_EXPORTS = {
    "Engine": "engine",
    "Client": "client",
    "AsyncClient": "client",
    "create_app": "proxy",
    "RenderConfig": "core",
    "RenderResult": "core",
    "ResultDecision": "core",
    "ContextRenderError": "core",
    "InvalidRequest": "core",
    "UnknownSession": "core",
    "UnknownResult": "core",
    "Restoration": "core",
    "HistoryConflict": "core",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'contextrender_adapters' has no attribute {name!r}")
    return getattr(importlib.import_module(f"contextrender_adapters.{_EXPORTS[name]}"), name)
