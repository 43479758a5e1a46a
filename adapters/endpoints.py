"""The endpoints, declared once, as the methods that `Engine` (in-process), `Client` and
`AsyncClient` (over HTTP) share: one plain `def` per endpoint walker in `EndpointMethods` below,
whose parameters and defaults are the walker's request fields (`grep "def render"` finds it).

A class that mixes in `EndpointMethods` implements only `_call(walker, **fields)`: the Engine
spawns the walker on its store, the clients post the fields to `/walker/<walker>`. Adding an
endpoint is a walker (deriving from `Endpoint`, walkers/session.jac) and a method here with
`@endpoint(module, walker)`; adapters/core.py loads the walker by that module, and
contextrender.jac serves it as walkers/served.jac finds it. The walker declares its fields again
(its `has` fields) because a `Client` must not wait seconds for the walkers to load:
tests/test_endpoints.py checks that the two agree, field by field and default by default.

A method's parameters are the walker's fields, but for the ones `renamed` maps to a field and a
`**name` parameter, which collects the other keywords into the field `name`. A default is what is
sent when the argument is left out or given as None (a fresh copy of `[]` or `{}` every call).
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from contextrender.core import IngestSummary, RenderConfig, RenderResult, Restoration

__all__ = ["ENDPOINTS", "Endpoint", "EndpointMethods", "endpoint"]

Returns = Literal["render", "renders", "restoration", "ingest", "config", "value"]


@dataclass(frozen=True)
class Endpoint:
    """One endpoint walker: `POST /walker/<walker>` on the server, `<method>(...)` in Python."""

    # The Jac module that declares the walker, and the walker's name.
    module: str
    walker: str
    method: str
    # The method's parameters (after `self`).
    signature: inspect.Signature
    doc: str
    # What the report is, as the Engine returns it (a client rebuilds it from the report): a render
    # (a RenderResult with its ResultDecisions), a list of renders, a Restoration, an IngestSummary,
    # the session's RenderConfig, or a plain value.
    returns: Returns = "value"
    # Parameter -> the walker field it fills, where the two names differ.
    renamed: dict[str, str] = field(default_factory=dict)

    @property
    def fields(self) -> tuple[str, ...]:
        """The request fields the method sends (all of them, every call)."""
        return tuple(self.renamed.get(name, name) for name in self.signature.parameters)


def endpoint(module: str, walker: str, *, returns: Returns = "value", renamed: dict[str, str] | None = None) -> Callable:
    """Make the decorated method (its signature and docstring; its body is never run) call the
    walker `walker` of the Jac module `module` through `self._call`."""

    def decorate(declared: Callable) -> Callable:
        whole = inspect.signature(declared)
        signature = whole.replace(parameters=list(whole.parameters.values())[1:])
        spec = Endpoint(module, walker, declared.__name__, signature, inspect.getdoc(declared) or "", returns, renamed or {})
        parameters = signature.parameters

        @functools.wraps(declared)
        def method(self: EndpointMethods, *args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            fields = {}
            for (name, value) in bound.arguments.items():
                default = parameters[name].default
                if default is not inspect.Parameter.empty and (value is None or value is default):
                    value = copy.deepcopy(default)
                fields[spec.renamed.get(name, name)] = value
            return self._call(walker, **fields)

        method.endpoint = spec  # type: ignore[attr-defined]
        return method

    return decorate


class EndpointMethods:
    """One method per endpoint. Each returns what `_call` returns: the value in-process and from
    `Client`, an awaitable of it from `AsyncClient`."""

    def _call(self, walker: str, **fields: Any) -> Any:
        raise NotImplementedError

    @endpoint("walkers.ingest", "ingest_events", returns="ingest")
    def ingest(self, session_id: str, messages: list[dict], *, append: bool = False, at: int = -1,
               usage: dict = {}) -> IngestSummary:  # noqa: B006 (copied at each call)
        """Add the unseen events of `messages` (the whole list so far, or only new ones with
        `append=True`) to the session, creating it on first use. With `append`, `at` >= 0 places
        them after the first `at` events of the live chain (an answer to a resent earlier turn),
        compared with what is stored there as a whole list would be. `usage`: one model call's
        reported token counts (walkers.ingest USAGE_KEYS), added to the session's totals.
        Reports an IngestSummary."""

    @endpoint("walkers.render", "render_context", returns="render", renamed={"explain": "include_decisions"})
    def render(self, session_id: str, messages: list[dict] = [], *, budget: int, selector: str = "",  # noqa: B006
               explain: bool = False, usage: dict = {}, **params: Any) -> RenderResult:  # noqa: B006
        """Ingest what is new in `messages`, then render the history for the next model call
        within `budget` tokens. `params` override any RenderConfig field for this call. `usage`:
        one model call's reported token counts, added to the session's totals as `ingest` adds
        them (the proxy's report of the answer `messages` re-sends, stored with its render)."""

    @endpoint("walkers.render", "render_variants", returns="renders", renamed={"explain": "include_decisions"})
    def render_variants(self, session_id: str, variants: list[dict], *, explain: bool = False) -> list[RenderResult]:
        """Render the stored history once per variant (RenderConfig settings plus `budget`),
        in one call: how a replay compares selectors and budgets at each turn."""

    @endpoint("walkers.render", "explain_render", returns="render")
    def explain(self, session_id: str) -> RenderResult:
        """The last render of a session with its per-result decisions."""

    @endpoint("walkers.restore", "restore_result", returns="restoration")
    def restore(self, session_id: str, handle: str) -> Restoration:
        """The complete stored result a stub's handle names (`r17`), recorded as a restore from the
        session's latest event: it counts as observed use at later renders. Reports a Restoration
        (the tool `message` as stored, its `handle`, `call_id`, `restores`...); a malformed handle
        is an InvalidRequest, one not on the live history an UnknownResult."""

    @endpoint("walkers.restore", "search_results")
    def search_results(self, session_id: str, query: str, *, limit: int = 5) -> dict:
        """The stored results of the session's live history that best match `query` (its words and
        values, in a result's text or its call's arguments), best first: `matches` (handle, tool_name,
        arguments, preview, score) and `text`, the answer the restore tool gives a model. Writes
        nothing; a query without a word of two characters is an InvalidRequest."""

    @endpoint("walkers.render", "configure_session", returns="config")
    def configure(self, session_id: str, **params: Any) -> RenderConfig:
        """Set a session's render settings (kept in the graph); reports the RenderConfig."""

    @endpoint("walkers.sessions", "get_session")
    def get_session(self, session_id: str, *, include_messages: bool = False) -> dict:
        """A session's counts, tokens, settings and last render (and its messages if asked)."""

    @endpoint("walkers.sessions", "list_sessions")
    def list_sessions(self) -> dict:
        """The caller's sessions, oldest first."""

    @endpoint("walkers.sessions", "export_graph")
    def export_graph(self, session_id: str, *, format: str = "json", limit: int = 2000) -> dict:
        """The session graph as JSON (nodes, edges), its chain drawn for people as Graphviz
        DOT (format "dot", key "dot") or SVG ("svg", key "svg"; needs Graphviz), or jaclang's own
        picture of every node below the session ("jac-dot", key "dot")."""

    @endpoint("walkers.inspector", "inspect_session")
    def inspect(self, session_id: str, *, render: int = 0) -> dict:
        """What the session inspector shows (docs/inspector.md): the session, its render
        timeline, and every result with its status in render number `render` (0: the last),
        score terms and reason (last render), reuse edges and restores."""

    @endpoint("walkers.sessions", "create_session")
    def create_session(self, session_id: str, *, name: str = "") -> dict:
        """Create a session (or find the stored one); a `name` is kept as the name it is shown
        with (get_session, list_sessions, the inspector). Reports its summary and `created`."""

    @endpoint("walkers.sessions", "delete_session")
    def delete_session(self, session_id: str, *, if_empty: bool = False) -> dict:
        """Delete a session and everything stored under it (with `if_empty`, only a session
        nothing was stored in yet; `deleted` says whether it was)."""

    @endpoint("walkers.sessions", "health")
    def health(self) -> dict:
        """Status, tokenizer encoding and embedding model (on a server: no login needed)."""


# walker -> its endpoint, in the order of the methods above.
ENDPOINTS: dict[str, Endpoint] = {
    spec.walker: spec
    for spec in (getattr(member, "endpoint", None) for member in vars(EndpointMethods).values())
    if isinstance(spec, Endpoint)
}
