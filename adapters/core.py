"""The Python layer's one door into the Jac modules: every name that the adapters
(`contextrender`) and the evaluation harness (`contextrender_eval`) use from graph/,
engine/ and walkers/, listed by the Jac module that defines it. No other module of those two packages imports
a Jac module, so when one moves, this table is the only Python to change.

Names load on first use (PEP 562): `from contextrender.core import content_text` imports
engine/measure.jac and nothing else, so a command line that needs one helper does not wait for
every walker to compile.
"""

from __future__ import annotations

import importlib
from typing import Any

from contextrender.endpoints import ENDPOINTS
from contextrender.jaclang_setup import compile_notice, import_jaclang

import_jaclang()

_FROM: dict[str, tuple[str, ...]] = {
    # What the endpoints report (the endpoint walkers themselves come from ENDPOINTS, below).
    "walkers.ingest": ("IngestSummary",),
    "walkers.restore": ("Restoration",),
    "engine.config": ("RenderConfig", "MIN_BUDGET", "check_budget"),
    "engine.render_values": ("RenderResult", "ResultDecision"),
    # The selector registry (each selector says what it embeds: `embeds_results`, `embeds_query()`)
    # and the settings check against it.
    "engine.registry": ("SELECTORS", "render_settings"),
    "engine.score": ("latest_exchange_text",),
    "engine.errors": ("ContextRenderError", "InvalidRequest", "UnknownSession", "UnknownResult", "HistoryConflict", "ClientGone", "QuotaExceeded"),
    # Where the server tells a walker that its request's client has left (adapters/server/guard.py).
    "engine.cancel": ("CLIENT_LEFT",),
    # The calls in progress the guard counts, and the long passes' courtesy to them (the store's
    # row serialisation gives way too); the young collections of a process with an Engine.
    "engine.courtesy": ("CALLS", "TURN", "CallTurn", "give_way", "serve_young_collections", "serve_short_waits", "background_pass"),
    "graph.content": ("content_text",),
    "engine.measure": ("get_tokenizer", "get_embedder", "warm_up", "EMBED_CLIP", "DEFAULT_ENCODING"),
    # The restore tool the proxy offers, as its stubs name it; the fold index's opening lines
    # (the integrations tell that notice from the framework's own messages by them).
    "engine.notices": ("RESTORE_TOOL", "restore_tool", "without_restore_tool", "FOLD_INDEX_HEADING", "FOLD_INDEX_STORED_HEADING",
                       "FOLD_MARKER_OPENING"),
    "engine.values": ("recall_tokens",),
    # The assistant normal form and echo matching ingestion uses (the proxy stores and forwards
    # answers in that form), and the proxy's promise never to change a message it sent.
    "engine.messages": ("normal_form", "same_event", "detached", "SENT_UNCHANGED"),
    # The memory setting the proxy bounds its own per-session state by.
    "engine.index": ("cache_bytes_setting",),
    # The request rules the server also applies to every JSON body (adapters/server/app.py).
    "engine.validate": ("MAX_DEPTH", "check_message", "check_session_id"),
}

# The endpoint walkers, each from the module its method in adapters/endpoints.py names.
for _endpoint in ENDPOINTS.values():
    _FROM[_endpoint.module] = _FROM.get(_endpoint.module, ()) + (_endpoint.walker,)
del _endpoint

_MODULE_OF = {name: module for (module, names) in _FROM.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'contextrender.core' has no attribute {name!r}")
    with compile_notice():  # the first use in a checkout compiles the Jac modules: said, with progress
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
