"""The endpoints, declared once: each endpoint walker with its request fields, and the methods
that `Engine` (in-process), `Client` and `AsyncClient` (over HTTP) share to call them.

A class that mixes in `EndpointMethods` implements only `_call(walker, **fields)`: the Engine
spawns the walker on its store, the clients post the fields to `/walker/<walker>`. Adding an
endpoint is a walker served by contextrender.jac, a row here and one method below
(tests/test_endpoints.py checks all three agree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Endpoint", "ENDPOINTS", "EndpointMethods"]


@dataclass(frozen=True)
class Endpoint:
    """One endpoint walker: `POST /walker/<walker>` on the server, `<method>(...)` in Python."""

    walker: str
    method: str
    # The request fields: the walker's `has` fields, `reports` excepted.
    fields: tuple[str, ...]
    # What the report is: a render (RenderResult; a client makes it a `Rendered`), a list of
    # renders, or a plain value.
    returns: Literal["render", "renders", "value"] = "value"


ENDPOINTS: dict[str, Endpoint] = {
    e.walker: e
    for e in (
        Endpoint("ingest_events", "ingest", ("session_id", "messages", "append", "usage")),
        Endpoint("render_context", "render",
                 ("session_id", "messages", "budget", "selector", "params", "include_decisions"), "render"),
        Endpoint("render_variants", "render_variants", ("session_id", "variants", "include_decisions"), "renders"),
        Endpoint("explain_render", "explain", ("session_id",), "render"),
        Endpoint("configure_session", "configure", ("session_id", "params")),
        Endpoint("get_session", "get_session", ("session_id", "include_messages")),
        Endpoint("list_sessions", "list_sessions", ()),
        Endpoint("export_graph", "export_graph", ("session_id", "format", "limit")),
        Endpoint("delete_session", "delete_session", ("session_id",)),
        Endpoint("health", "health", ()),
    )
}


class EndpointMethods:
    """One method per endpoint. Each returns what `_call` returns: the value in-process and from
    `Client`, an awaitable of it from `AsyncClient`."""

    def _call(self, walker: str, **fields: Any) -> Any:
        raise NotImplementedError

    def ingest(self, session_id: str, messages: list[dict], *, append: bool = False, usage: dict | None = None) -> Any:
        """Add the unseen events of `messages` (the whole list so far, or only new ones with
        `append=True`) to the session, creating it on first use. `usage`: one model call's
        reported token counts (walkers.ingest USAGE_KEYS), added to the session's totals.
        Reports an IngestSummary."""
        return self._call("ingest_events", session_id=session_id, messages=messages, append=append, usage=usage or {})

    def render(self, session_id: str, messages: list[dict] | None = None, *, budget: int, selector: str = "",
               explain: bool = False, **params: Any) -> Any:
        """Ingest what is new in `messages`, then render the history for the next model call
        within `budget` tokens. `params` override any RenderConfig field for this call."""
        return self._call("render_context", session_id=session_id, messages=messages or [], budget=budget,
                          selector=selector, params=params, include_decisions=explain)

    def render_variants(self, session_id: str, variants: list[dict[str, Any]], *, explain: bool = False) -> Any:
        """Render the stored history once per variant (RenderConfig settings plus `budget`),
        in one call: how a replay compares selectors and budgets at each turn."""
        return self._call("render_variants", session_id=session_id, variants=variants, include_decisions=explain)

    def explain(self, session_id: str) -> Any:
        """The last render of a session with its per-result decisions."""
        return self._call("explain_render", session_id=session_id)

    def configure(self, session_id: str, **params: Any) -> Any:
        """Set a session's render settings (kept in the graph); reports the RenderConfig."""
        return self._call("configure_session", session_id=session_id, params=params)

    def get_session(self, session_id: str, *, include_messages: bool = False) -> Any:
        """A session's counts, tokens, settings and last render (and its messages if asked)."""
        return self._call("get_session", session_id=session_id, include_messages=include_messages)

    def list_sessions(self) -> Any:
        """The caller's sessions, oldest first."""
        return self._call("list_sessions")

    def delete_session(self, session_id: str) -> Any:
        """Delete a session and everything stored under it."""
        return self._call("delete_session", session_id=session_id)

    def export_graph(self, session_id: str, *, format: str = "json", limit: int = 2000) -> Any:
        """The session graph as JSON (nodes, edges) or as Graphviz DOT (key "dot")."""
        return self._call("export_graph", session_id=session_id, format=format, limit=limit)

    def health(self) -> Any:
        """Status, tokenizer encoding and embedding model (on a server: no login needed)."""
        return self._call("health")
