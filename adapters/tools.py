"""The restore tool for agents that call the engine or the server themselves (docs/restores.md).

A render's stubs say "call contextrender_restore with handle r17" (engine/notices.jac). An agent
that renders through the in-process `Engine` or a `Client` offers this tool to its model and
answers its calls here; the proxy does the same for the agents behind it.

    restore = restore_tool(engine, "run-42")
    body["tools"] = agent_tools + [restore.schema]         # chat-completions function definition
    ...
    for call in answer["tool_calls"]:
        if call["function"]["name"] == restore.name:
            messages.append(restore.answer(call))             # {"role": "tool", ...}

A call may give a `query` instead of a handle (a fold index may name folded results by handle
only): the answer is then the best matching handles, one line each, from the backend's
`search_results`; the model restores by handle next. A search writes nothing.

The answer is always a string for the model, never an exception for the agent loop: a handle the
session does not hold, a malformed one, or ContextRender being unreachable each come back as one
sentence that says so (and are logged), so the run goes on.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import Callable
from typing import Any

from contextrender.core import RESTORE_TOOL, InvalidRequest, UnknownResult, UnknownSession, content_text
from contextrender.core import restore_tool as _schema

__all__ = ["RESTORE_TOOL", "RestoreTool", "ask_of", "ask_of_call", "restore_tool", "restored_text", "tool_error"]

log = logging.getLogger("contextrender.tools")


def ask_of(given: Any) -> tuple[str, str] | None:
    """What restore arguments (a parsed JSON object) ask for: `("handle", "r17")` (a handle wins),
    `("query", "words")` (a search: the best matching handles), or None when they hold neither as
    a non-empty string."""
    if isinstance(given, dict):
        for key in ("handle", "query"):
            value = given.get(key)
            if isinstance(value, str) and value.strip():
                return (key, value.strip())
    return None


def ask_of_call(call: dict) -> tuple[str, str]:
    """What a restore call asks for (`ask_of`); ValueError saying what to fix when the arguments are
    not a JSON object with a string `handle` (or `query`)."""
    arguments = (call.get("function") or {}).get("arguments") or ""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    ask = ask_of(parsed)
    if ask is None:
        raise ValueError(f'the arguments must be a JSON object with a string "handle", such as {{"handle": "r17"}}, '
                         f'or a "query" to search for one (got {arguments!r})')
    return ask


def tool_error(handle: str, problem: str) -> str:
    """The tool answer the model gets when a restore fails: what went wrong, and that it can go on."""
    return f"[ContextRender: could not restore {handle or 'that result'}: {problem}. Continue without it.]"


def restored_text(restoration: Any) -> str:
    """The stored result's text from a Restoration (the Engine's object or the server's JSON)."""
    message = restoration.get("message") if isinstance(restoration, dict) else getattr(restoration, "message", None)
    content = (message or {}).get("content") if isinstance(message, dict) else None
    return content if isinstance(content, str) else content_text(content)


def _ask_of(arguments: Any) -> tuple[Any, Any]:
    """(handle, query) of a call's arguments (a JSON text or an object); a handle wins."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError:
            return (None, None)
    (kind, value) = ask_of(arguments) or ("", None)
    return (value, None) if kind == "handle" else (None, value)


class RestoreTool:
    """`contextrender_restore` bound to a backend (an `Engine`, a `Client`, or anything with
    `restore(session_id, handle)` and `search_results(session_id, query)`) and, optionally, to one
    session."""

    name = RESTORE_TOOL

    def __init__(self, backend: Any, session_id: str | Callable[[], str] | None = None) -> None:
        self.backend = backend
        self._session = session_id

    @property
    def schema(self) -> dict:
        """The chat-completions tool definition (`{"type": "function", "function": {...}}`)."""
        return _schema()

    @property
    def description(self) -> str:
        return self.schema["function"]["description"]

    @property
    def parameters(self) -> dict:
        """The JSON schema of the arguments: `{"handle": "r17"}` or `{"query": "ledger.py"}`."""
        return self.schema["function"]["parameters"]

    def session(self, session_id: str | None = None) -> str:
        session = session_id if session_id is not None else self._session
        if callable(session):
            session = session()
        if not isinstance(session, str) or not session:
            raise ValueError("contextrender_restore needs the session id the history was rendered under")
        return session

    def __call__(self, handle: Any = None, session_id: str | None = None, *, query: Any = None) -> str:
        """The complete stored result `handle` names, as text for the model; without a handle, the
        handles of the results that best match `query`, one line each."""
        session = self.session(session_id)
        (method, asked) = self._request(handle, query)
        if method is None:
            return asked
        try:
            return self._text(method, getattr(self.backend, method)(session, asked))
        except Exception as error:  # noqa: BLE001 - down or failing: the run must go on
            return self._failure(method, asked, session, error)

    async def acall(self, handle: Any = None, session_id: str | None = None, *, query: Any = None) -> str:
        """The same from async code: an `AsyncClient` is awaited, a blocking backend (the
        `Engine`, a `Client`) runs in a worker thread."""
        session = self.session(session_id)
        (method, asked) = self._request(handle, query)
        if method is None:
            return asked
        try:
            call = getattr(self.backend, method)
            if inspect.iscoroutinefunction(call):
                report = await call(session, asked)
            else:
                report = await asyncio.to_thread(call, session, asked)
            return self._text(method, report)
        except Exception as error:  # noqa: BLE001
            return self._failure(method, asked, session, error)

    @staticmethod
    def _request(handle: Any, query: Any) -> tuple[str | None, str]:
        """The backend method to call and its argument, or None and the refusal for the model."""
        if isinstance(handle, str) and handle:
            return ("restore", handle)
        if isinstance(query, str) and query.strip():
            return ("search_results", query.strip())
        return (None, f'{RESTORE_TOOL} needs a handle, such as {{"handle": "r17"}}: the placeholder names it '
                      '(or a "query" to search for one).')

    @staticmethod
    def _text(method: str, report: Any) -> str:
        if method == "restore":
            return restored_text(report)
        return str(report.get("text") if isinstance(report, dict) else getattr(report, "text", ""))

    @staticmethod
    def _failure(method: str, handle: str, session: str, error: Exception) -> str:
        if method == "search_results" and isinstance(error, InvalidRequest):
            return f"{RESTORE_TOOL} could not search for {handle!r}: {error}"
        if method == "search_results" and isinstance(error, UnknownSession):
            return "There are no stored results in this conversation to search."
        if isinstance(error, (UnknownResult, UnknownSession)):
            log.info("contextrender: restore of %s in session %s refused (%s)", handle, session, error)
            return f"There is no stored result with handle {handle!r} in this conversation: use a handle a placeholder names."
        if isinstance(error, InvalidRequest):
            return f"{RESTORE_TOOL} could not read handle {handle!r}: {error}"
        log.warning("contextrender: restore of %s in session %s failed (%s: %s)", handle, session, type(error).__name__, error)
        return f"ContextRender could not restore {handle!r} now ({type(error).__name__}); go on without it."

    def answer(self, tool_call: dict, session_id: str | None = None) -> dict:
        """The tool message that answers one chat-completions `tool_call` of this tool."""
        function = tool_call.get("function") or {}
        (handle, query) = _ask_of(function.get("arguments"))
        content = self(handle, session_id, query=query)
        return {"role": "tool", "tool_call_id": tool_call.get("id"), "content": content}


def restore_tool(backend: Any, session_id: str | Callable[[], str] | None = None) -> RestoreTool:
    """The restore tool answered by `backend.restore` (`Engine` or `Client`); `session_id` is the
    session the agent renders under (a string, a function that returns it, or given per call)."""
    return RestoreTool(backend, session_id)
