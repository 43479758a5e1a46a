"""ContextRender: a context manager for LLM agents (docs/python-api.md).

    import contextrender
    engine = contextrender.Engine(".contextrender")            # in-process, on a local store
    client = contextrender.Client("http://127.0.0.1:8000")     # the same methods, on a server

This folder (`adapters/`, imported as `contextrender`) is the Python layer, in rooms by job: this
public face; `core` (the one door into the Jac modules), `local` (`Engine`), `client`, `endpoints`,
`tools` (the restore tool), `cli`; `server/` (what `jac start` adds), `proxy/` (`contextrender
proxy`, one folder per protocol), `inspector/` (the session inspector page), `testing/` (the fake
upstream and the checks tests use).

Importing this package loads nothing else: each name below is imported when it is first used (the
engine's Jac modules take seconds to load; the client needs only httpx). The server's entry,
`contextrender.jac` at the top of a checkout, stands in for this module in a process that imported
jaclang first (docs/design-decisions.md, "One name, two faces"): it offers the same names.
"""

from __future__ import annotations

from typing import Any

from contextrender.public import EXPORTS, exported

__version__ = "0.1.0"

__all__ = list(EXPORTS)


def __getattr__(name: str) -> Any:
    value = exported(name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
