"""The engine in-process: the Jac walkers run on a local graph store, no server needed."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from jaclang.jac0core.runtime import JacRuntime, JacUtils
from jaclang.lib import spawn

from contextrender_adapters.core import (
    IngestSummary,
    RenderConfig,
    RenderResult,
    configure_session,
    delete_session,
    explain_render,
    export_graph,
    get_session,
    ingest_events,
    list_sessions,
    render_context,
    render_variants,
)

DEFAULT_STORE = os.environ.get("CONTEXTRENDER_STORE", ".contextrender")

__all__ = ["Engine", "DEFAULT_STORE"]


class Engine:
    """ContextRender on a local graph store (SQLite under `store`/.jac/data).

    Every call is committed before it returns, so what a call acknowledged survives a crash.
    Calls are serialised: one engine is safe to share between threads.
    """

    def __init__(self, store: str | os.PathLike[str] = DEFAULT_STORE) -> None:
        self.store = Path(store).resolve()
        self.store.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def _run(self, walker: Any) -> Any:
        # A fresh execution context per call, like a server request: its commit scans only the
        # nodes this call loaded or made, not every node the process has seen.
        with self._lock:
            ctx = JacUtils.create_j_context(user_root=None, base_path_dir=str(self.store))
            token = JacRuntime.push_request_context(ctx)
            try:
                # The spawn ends with jaclang's commit to the store: acknowledged means durable.
                done = spawn(walker, ctx.get_root())
            except BaseException:
                # A failed call leaves nothing behind (as on the server): drop its uncommitted
                # writes before close() would commit them.
                ctx.mem.abort()
                raise
            finally:
                JacRuntime.reset_request_context(token)
                ctx.close()
        return done.reports[0]

    def ingest(self, session_id: str, messages: list[dict], *, append: bool = False) -> IngestSummary:
        """Add the unseen events of `messages` (the whole list so far, or only new ones with
        `append=True`) to the session, creating it on first use."""
        return self._run(ingest_events(session_id=session_id, messages=messages, append=append))

    def render(
        self,
        session_id: str,
        messages: list[dict] | None = None,
        *,
        budget: int,
        selector: str = "",
        explain: bool = False,
        **params: Any,
    ) -> RenderResult:
        """Ingest what is new in `messages`, then render the history for the next model call
        within `budget` tokens. `params` override any RenderConfig field for this call."""
        return self._run(
            render_context(
                session_id=session_id,
                messages=messages or [],
                budget=budget,
                selector=selector,
                params=params,
                include_decisions=explain,
            )
        )

    def render_variants(
        self, session_id: str, variants: list[dict[str, Any]], *, explain: bool = False
    ) -> list[RenderResult]:
        """Render the stored history once per variant (RenderConfig settings plus `budget`),
        in one call: how a replay compares selectors and budgets at each turn."""
        return self._run(render_variants(session_id=session_id, variants=variants, include_decisions=explain))

    def explain(self, session_id: str) -> RenderResult:
        """The last render of a session with its per-result decisions."""
        return self._run(explain_render(session_id=session_id))

    def configure(self, session_id: str, **params: Any) -> RenderConfig:
        """Set a session's render settings (kept in the graph)."""
        return self._run(configure_session(session_id=session_id, params=params))

    def get_session(self, session_id: str, *, include_messages: bool = False) -> dict:
        """A session's counts, tokens, settings and last render (and its messages if asked)."""
        return self._run(get_session(session_id=session_id, include_messages=include_messages))

    def list_sessions(self) -> list[dict]:
        """Every session in the store, oldest first."""
        return self._run(list_sessions())

    def delete_session(self, session_id: str) -> dict:
        """Delete a session and everything stored under it."""
        return self._run(delete_session(session_id=session_id))

    def export_graph(self, session_id: str, *, format: str = "json", limit: int = 2000) -> dict:
        """The session graph as JSON (nodes, edges) or as Graphviz DOT (key "dot")."""
        return self._run(export_graph(session_id=session_id, format=format, limit=limit))
