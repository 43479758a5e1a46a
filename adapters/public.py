"""The public names of `contextrender` and the modules that define them: the package's `__init__`
and the server entry (contextrender.jac, when it stands in for the package) both answer from here."""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module of the package that defines it
EXPORTS = {
    "Engine": "local",
    "Client": "client",
    "AsyncClient": "client",
    "ServerUnavailable": "client",
    "create_app": "proxy",
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
}


def exported(name: str) -> Any:
    """The public name `name`, from the module that defines it (AttributeError for any other)."""
    if name not in EXPORTS:
        raise AttributeError(f"module 'contextrender' has no attribute {name!r}")
    return getattr(importlib.import_module(f"contextrender.{EXPORTS[name]}"), name)
