"""The endpoints, declared once: one row per endpoint walker, and the methods that `Engine`
(in-process), `Client` and `AsyncClient` (over HTTP) share to call them, made from the rows.

A class that mixes in `EndpointMethods` implements only `_call(walker, **fields)`: the Engine
spawns the walker on its store, the clients post the fields to `/walker/<walker>`. Adding an
endpoint is a walker (deriving from `Endpoint`, walkers/session.jac) and a row here;
adapters/core.py loads the walker by the row's module, and contextrender_server.jac serves it as
walkers/served.jac finds it (tests/test_endpoints.py checks the walkers served and the rows agree).

The row's `call` is the Python signature of the method; its parameters are the walker's request
fields (its `has` fields, `reports` excepted), but for the ones `renamed` maps to a field and a
`**name` parameter, which collects the other keywords into the field `name`. The fields are not
read from the walker here: loading the walkers takes seconds, which a `Client` must not wait for.
"""

from __future__ import annotations

import ast
import copy
import inspect
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["Endpoint", "ENDPOINTS", "EndpointMethods"]


@dataclass(frozen=True)
class Endpoint:
    """One endpoint walker: `POST /walker/<walker>` on the server, `<method>(...)` in Python."""

    # The Jac module that declares the walker, and the walker's name.
    module: str
    walker: str
    method: str
    # The method's parameters (after `self`), as Python writes them. A default is what is sent
    # when the argument is left out or given as None.
    call: str
    doc: str
    # What the report is, as the Engine returns it (a client rebuilds it from the report): a render
    # (a RenderResult with its ResultDecisions), a list of renders, a Restoration, an IngestSummary,
    # the session's RenderConfig, or a plain value.
    returns: Literal["render", "renders", "restoration", "ingest", "config", "value"] = "value"
    # Parameter -> the walker field it fills, where the two names differ.
    renamed: dict[str, str] = field(default_factory=dict)

    @property
    def signature(self) -> inspect.Signature:
        return _signature(self.call)

    @property
    def fields(self) -> tuple[str, ...]:
        """The request fields the method sends (all of them, every call)."""
        return tuple(self.renamed.get(name, name) for name in self.signature.parameters)


def _signature(call: str) -> inspect.Signature:
    """The signature `call` writes (defaults are literals; annotations are kept as text)."""
    args = ast.parse(f"def f({call}): pass").body[0].args
    if args.posonlyargs or args.vararg:
        raise ValueError(f"endpoint call {call!r}: no positional-only or *args parameters")
    P = inspect.Parameter

    def made(arg: ast.arg, kind: Any, default: ast.expr | None) -> inspect.Parameter:
        return P(arg.arg, kind, default=P.empty if default is None else ast.literal_eval(default),
                 annotation=ast.unparse(arg.annotation) if arg.annotation else P.empty)

    positional = [None] * (len(args.args) - len(args.defaults)) + list(args.defaults)
    parameters = [made(a, P.POSITIONAL_OR_KEYWORD, d) for (a, d) in zip(args.args, positional)]
    parameters += [made(a, P.KEYWORD_ONLY, d) for (a, d) in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        parameters.append(made(args.kwarg, P.VAR_KEYWORD, None))
    return inspect.Signature(parameters)


ENDPOINTS: dict[str, Endpoint] = {
    e.walker: e
    for e in (
        Endpoint("walkers.ingest", "ingest_events", "ingest",
                 "session_id: str, messages: list[dict], *, append: bool = False, at: int = -1, usage: dict = {}",
                 """Add the unseen events of `messages` (the whole list so far, or only new ones with
        `append=True`) to the session, creating it on first use. With `append`, `at` >= 0 places
        them after the first `at` events of the live chain (an answer to a resent earlier turn),
        compared with what is stored there as a whole list would be. `usage`: one model call's
        reported token counts (walkers.ingest USAGE_KEYS), added to the session's totals.
        Reports an IngestSummary.""", "ingest"),
        Endpoint("walkers.render", "render_context", "render",
                 "session_id: str, messages: list[dict] = [], *, budget: int, selector: str = '', "
                 "explain: bool = False, **params",
                 """Ingest what is new in `messages`, then render the history for the next model call
        within `budget` tokens. `params` override any RenderConfig field for this call.""",
                 "render", {"explain": "include_decisions"}),
        Endpoint("walkers.render", "render_variants", "render_variants",
                 "session_id: str, variants: list[dict], *, explain: bool = False",
                 """Render the stored history once per variant (RenderConfig settings plus `budget`),
        in one call: how a replay compares selectors and budgets at each turn.""",
                 "renders", {"explain": "include_decisions"}),
        Endpoint("walkers.render", "explain_render", "explain", "session_id: str",
                 """The last render of a session with its per-result decisions.""", "render"),
        Endpoint("walkers.restore", "restore_result", "restore", "session_id: str, handle: str",
                 """The complete stored result a stub's handle names (`r17`), recorded as a restore from the
        session's latest event: it counts as observed use at later renders. Reports a Restoration
        (the tool `message` as stored, its `handle`, `call_id`, `restores`...); a malformed handle
        is an InvalidRequest, one not on the live history an UnknownResult.""", "restoration"),
        Endpoint("walkers.restore", "search_results", "search_results", "session_id: str, query: str, *, limit: int = 5",
                 """The stored results of the session's live history that best match `query` (its words and
        values, in a result's text or its call's arguments), best first: `matches` (handle, tool_name,
        arguments, preview, score) and `text`, the answer the restore tool gives a model. Writes
        nothing; a query without a word of two characters is an InvalidRequest."""),
        Endpoint("walkers.render", "configure_session", "configure", "session_id: str, **params",
                 """Set a session's render settings (kept in the graph); reports the RenderConfig.""", "config"),
        Endpoint("walkers.sessions", "get_session", "get_session",
                 "session_id: str, *, include_messages: bool = False",
                 """A session's counts, tokens, settings and last render (and its messages if asked)."""),
        Endpoint("walkers.sessions", "list_sessions", "list_sessions", "",
                 """The caller's sessions, oldest first."""),
        Endpoint("walkers.sessions", "export_graph", "export_graph",
                 "session_id: str, *, format: str = 'json', limit: int = 2000",
                 """The session graph as JSON (nodes, edges), its chain drawn for people as Graphviz
        DOT (format "dot", key "dot") or SVG ("svg", key "svg"; needs Graphviz), or jaclang's own
        picture of every node below the session ("jac-dot", key "dot")."""),
        Endpoint("walkers.inspector", "inspect_session", "inspect", "session_id: str, *, render: int = 0",
                 """What the session inspector shows (docs/inspector.md): the session, its render
        timeline, and every result with its status in render number `render` (0: the last),
        score terms and reason (last render), reuse edges and restores."""),
        Endpoint("walkers.sessions", "create_session", "create_session", "session_id: str, *, name: str = ''",
                 """Create a session (or find the stored one); a `name` is kept as the name it is shown
        with (get_session, list_sessions, the inspector). Reports its summary and `created`."""),
        Endpoint("walkers.sessions", "delete_session", "delete_session", "session_id: str, *, if_empty: bool = False",
                 """Delete a session and everything stored under it (with `if_empty`, only a session
        nothing was stored in yet; `deleted` says whether it was)."""),
        Endpoint("walkers.sessions", "health", "health", "",
                 """Status, tokenizer encoding and embedding model (on a server: no login needed)."""),
    )
}


def _method(endpoint: Endpoint) -> Any:
    """`endpoint`'s method: binds the arguments to its signature and hands `_call` the fields."""
    signature = endpoint.signature
    parameters = signature.parameters

    def method(self: EndpointMethods, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        fields = {}
        for (name, value) in bound.arguments.items():
            default = parameters[name].default
            if default is not inspect.Parameter.empty and (value is None or value is default):
                value = copy.deepcopy(default)  # a fresh [] or {} each call
            fields[endpoint.renamed.get(name, name)] = value
        return self._call(endpoint.walker, **fields)

    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    method.__signature__ = signature.replace(parameters=[self_parameter, *parameters.values()])
    method.__name__ = endpoint.method
    method.__qualname__ = f"EndpointMethods.{endpoint.method}"
    method.__doc__ = endpoint.doc
    return method


class EndpointMethods:
    """One method per endpoint (made from ENDPOINTS). Each returns what `_call` returns: the value
    in-process and from `Client`, an awaitable of it from `AsyncClient`."""

    def _call(self, walker: str, **fields: Any) -> Any:
        raise NotImplementedError


for _endpoint in ENDPOINTS.values():
    setattr(EndpointMethods, _endpoint.method, _method(_endpoint))
del _endpoint
