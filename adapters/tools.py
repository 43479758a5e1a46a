"""The restore tool for agents that call the engine or the server themselves (issue 19, item 3).

A render's stubs say "call contextrender_restore with handle r17" (engine/notices.jac). An agent
that renders through the in-process `Engine` or a `Client` offers this tool to its model and
answers its calls here; the proxy does the same for the agents behind it.

    restore = restore_tool(engine, "run-42")
    body["tools"] = agent_tools + [restore.schema]         # chat-completions function definition
    ...
    for call in answer["tool_calls"]:
        if call["function"]["name"] == restore.name:
            messages.append(restore.answer(call))             # {"role": "tool", ...}

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

from contextrender_adapters.core import RESTORE_TOOL, InvalidRequest, UnknownResult, UnknownSession, content_text
from contextrender_adapters.core import restore_tool as _schema

__all__ = ["RESTORE_TOOL", "RestoreTool", "restore_tool", "restored_text"]

log = logging.getLogger("contextrender.tools")


def restored_text(restoration: Any) -> str:
    """The stored result's text from a Restoration (the Engine's object or the server's JSON)."""
    message = restoration.get("message") if isinstance(restoration, dict) else getattr(restoration, "message", None)
    content = (message or {}).get("content") if isinstance(message, dict) else None
    return content if isinstance(content, str) else content_text(message or {})


def _handle_of(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError:
            return None
    return arguments.get("handle") if isinstance(arguments, dict) else None


class RestoreTool:
    """`contextrender_restore` bound to a backend (an `Engine`, a `Client`, or anything with
    `restore(session_id, handle)`) and, optionally, to one session."""

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
        """The JSON schema of the arguments: `{"handle": "r17"}`."""
        return self.schema["function"]["parameters"]

    def session(self, session_id: str | None = None) -> str:
        session = session_id if session_id is not None else self._session
        if callable(session):
            session = session()
        if not isinstance(session, str) or not session:
            raise ValueError("contextrender_restore needs the session id the history was rendered under")
        return session

    def __call__(self, handle: Any, session_id: str | None = None) -> str:
        """The complete stored result `handle` names, as text for the model."""
        session = self.session(session_id)
        refusal = self._refusal(handle)
        if refusal:
            return refusal
        try:
            return restored_text(self.backend.restore(session, handle))
        except Exception as error:  # noqa: BLE001 - down or failing: the run must go on
            return self._failure(handle, session, error)

    async def acall(self, handle: Any, session_id: str | None = None) -> str:
        """The same from async code: an `AsyncClient` is awaited, a blocking backend (the
        `Engine`, a `Client`) runs in a worker thread."""
        session = self.session(session_id)
        refusal = self._refusal(handle)
        if refusal:
            return refusal
        try:
            if inspect.iscoroutinefunction(getattr(self.backend, "restore", None)):
                restoration = await self.backend.restore(session, handle)
            else:
                restoration = await asyncio.to_thread(self.backend.restore, session, handle)
            return restored_text(restoration)
        except Exception as error:  # noqa: BLE001
            return self._failure(handle, session, error)

    @staticmethod
    def _refusal(handle: Any) -> str:
        if not isinstance(handle, str) or not handle:
            return f'{RESTORE_TOOL} needs a handle, such as {{"handle": "r17"}}: the placeholder names it.'
        return ""

    @staticmethod
    def _failure(handle: str, session: str, error: Exception) -> str:
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
        content = self(_handle_of(function.get("arguments")), session_id)
        return {"role": "tool", "tool_call_id": tool_call.get("id"), "content": content}


def restore_tool(backend: Any, session_id: str | Callable[[], str] | None = None) -> RestoreTool:
    """The restore tool answered by `backend.restore` (`Engine` or `Client`); `session_id` is the
    session the agent renders under (a string, a function that returns it, or given per call)."""
    return RestoreTool(backend, session_id)
