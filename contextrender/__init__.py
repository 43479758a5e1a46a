"""ContextRender: a context manager for LLM agents (docs/python-api.md).

    import contextrender
    engine = contextrender.Engine(".contextrender")            # in-process, on a local store
    client = contextrender.Client("http://127.0.0.1:8000")     # the same methods, on a server

Importing this package loads nothing else: each name below is imported when it is first used
(the engine's Jac modules take seconds to load; the client needs only httpx). The Python layer
itself lives in `contextrender_adapters` (the proxy, the server plugin, the format layers); this
package is its public face. The Jac entry module that `jac start` serves is
`contextrender_server.jac`: a Jac module named `contextrender` on the path would be imported in
place of this package (jaclang's importer comes first and prefers a .jac file; docs/install.md).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> the contextrender_adapters module that defines it
_EXPORTS = {
    "Engine": "engine",
    "Client": "client",
    "AsyncClient": "client",
    "RenderResult": "core",
    "ResultDecision": "core",
    "Restoration": "core",
    "IngestSummary": "core",
    "RenderConfig": "core",
    "ContextRenderError": "core",
    "InvalidRequest": "core",
    "UnknownSession": "core",
    "UnknownResult": "core",
    "HistoryConflict": "core",
    "ServerUnavailable": "client",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'contextrender' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"contextrender_adapters.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
