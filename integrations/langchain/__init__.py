"""ContextRender for LangChain 1.x agents (`create_agent`): a middleware that renders the history
within a token budget before every model call and adds the restore tool.

    from langchain.agents import create_agent
    from contextrender import Engine
    from contextrender_integrations.langchain import ContextRenderMiddleware

    agent = create_agent(model, tools, middleware=[ContextRenderMiddleware(Engine(), budget=6000)],
                         checkpointer=InMemorySaver())
    agent.invoke({"messages": [...]}, {"configurable": {"thread_id": "t-1"}})

The mechanism is `wrap_model_call`: the render replaces the messages of that one model call
(`request.override(messages=...)`); the agent's state keeps every message as it was, so nothing
LangChain stores is lost and the next call is rendered again from the whole history.

The session is named by LangGraph's own thread id (`langchain-<thread_id>`); a run without a
thread (no checkpointer) is named by the id LangChain gave its first message. The backend is an
in-process `Engine` or a `Client` (or `AsyncClient` in async runs) of a ContextRender server.
Fail open: if ContextRender is down or refuses, the model gets the agent's messages unchanged and
the `contextrender.langchain` logger says why.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse
from langchain.tools import ToolRuntime
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, ToolMessage, convert_to_openai_messages
from langchain_core.tools import StructuredTool

from contextrender.tools import RESTORE_TOOL, restore_tool
from contextrender_integrations.common import align, render_or_none, session_name

__all__ = ["ContextRenderMiddleware", "RESTORE_TOOL", "conversation_id"]

log = logging.getLogger("contextrender.langchain")


def conversation_id(thread_id: Any, messages: list[AnyMessage]) -> str | None:
    """LangGraph's thread id, else the id of the conversation's first message."""
    if thread_id:
        return str(thread_id)
    first = next((m.id for m in messages if getattr(m, "id", None)), None)
    return f"message-{first}" if first else None


def _rebuilt(original: AnyMessage | None, rendered: dict) -> AnyMessage:
    """The LangChain message for a rendered one that differs from its original."""
    content = rendered.get("content") or ""
    if original is None:
        return HumanMessage(content=content)  # the fold marker
    if isinstance(original, ToolMessage):
        return original.model_copy(update={"content": content})
    if isinstance(original, AIMessage):
        # The calls kept, each with its arguments as rendered (a call over results of a folded
        # turn may be cut: `folded_call_room`).
        shown = {c.get("id"): json.loads((c.get("function") or {}).get("arguments") or "{}") for c in rendered.get("tool_calls") or []}
        calls = [c | {"args": shown[c.get("id")]} for c in original.tool_calls if c.get("id") in shown]
        return original.model_copy(update={"content": content, "tool_calls": calls})
    return original.model_copy(update={"content": content})


class ContextRenderMiddleware(AgentMiddleware):
    """Renders the agent's history within `budget` tokens before each model call, and gives the
    agent the `contextrender_restore` tool that takes back an omitted result."""

    def __init__(self, backend: Any, *, budget: int = 6000, selector: str = "", session_id: str | None = None,
                 restore: bool = True, **params: Any) -> None:
        """`backend`: an `Engine`, `Client` or `AsyncClient`. `session_id`: one fixed session
        (default: named by each run's thread). `params`: RenderConfig settings for every render."""
        super().__init__()
        self.backend = backend
        self.budget = budget
        self.selector = selector
        self.session_id = session_id
        self.params = params
        self.tools = [self._restore_tool()] if restore else []

    # ---------------------------------------------------------------- naming

    def session_for(self, thread_id: Any, messages: list[AnyMessage]) -> str | None:
        if self.session_id:
            return self.session_id
        conversation = conversation_id(thread_id, messages)
        return session_name("langchain", conversation) if conversation else None

    def _request_session(self, request: ModelRequest) -> str | None:
        info = getattr(request.runtime, "execution_info", None) if request.runtime is not None else None
        return self.session_for(getattr(info, "thread_id", None), request.messages)

    # ---------------------------------------------------------------- the render

    def _chat(self, request: ModelRequest) -> list[dict]:
        system = [request.system_message] if request.system_message is not None else []
        return convert_to_openai_messages(system + list(request.messages))

    def _apply(self, request: ModelRequest, chat: list[dict], rendered: Any) -> ModelRequest:
        originals = list(request.messages)
        # `chat` holds the system message first when there is one; `originals` does not.
        offset = 1 if request.system_message is not None else 0
        messages = []
        for a in align(chat[offset:], rendered.messages):
            original = originals[a.origin] if a.origin is not None else None
            messages.append(original if a.same and original is not None else _rebuilt(original, a.message))
        log.info("contextrender: %d of %d history tokens sent (%d results omitted, %d compacted)",
                 rendered.history_tokens, rendered.full_history_tokens, rendered.omitted, rendered.compacted)
        return request.override(messages=messages)

    def _prepare(self, request: ModelRequest) -> tuple[str | None, list[dict]]:
        session = self._request_session(request)
        if session is None:
            log.warning("contextrender: history sent unchanged (no thread id and no message id to name the session by)")
        return session, self._chat(request) if session else []

    def wrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], ModelResponse]) -> Any:
        session, chat = self._prepare(request)
        if session is None:
            return handler(request)
        rendered = render_or_none(self.backend, session, chat, budget=self.budget, selector=self.selector, log=log, **self.params)
        return handler(request if rendered is None else self._apply(request, chat, rendered))

    async def awrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], Awaitable[ModelResponse]]) -> Any:
        session, chat = self._prepare(request)
        if session is None:
            return await handler(request)

        if inspect.iscoroutinefunction(getattr(self.backend, "render", None)):
            rendered = await self._arender(session, chat)
        else:  # the Engine and Client block: keep the event loop free
            rendered = await asyncio.to_thread(render_or_none, self.backend, session, chat, budget=self.budget,
                                               selector=self.selector, log=log, **self.params)
        return await handler(request if rendered is None else self._apply(request, chat, rendered))

    async def _arender(self, session: str, chat: list[dict]) -> Any:
        try:
            return await self.backend.render(session, chat, budget=self.budget, selector=self.selector, **self.params)
        except Exception as error:  # noqa: BLE001 - fail open
            log.warning("contextrender: history sent unchanged for session %s (%s: %s)", session, type(error).__name__, error)
            return None

    # ---------------------------------------------------------------- the restore tool

    def _tool_session(self, runtime: ToolRuntime) -> str | None:
        thread = ((runtime.config or {}).get("configurable") or {}).get("thread_id")
        return self.session_for(thread, (runtime.state or {}).get("messages") or [])

    def _restore_tool(self) -> StructuredTool:
        middleware = self
        answer = restore_tool(self.backend)

        def contextrender_restore(handle: str, runtime: ToolRuntime) -> str:
            session = middleware._tool_session(runtime)
            if session is None:
                return "ContextRender cannot tell which conversation this is: nothing to restore."
            return answer(handle, session)

        async def acontextrender_restore(handle: str, runtime: ToolRuntime) -> str:
            session = middleware._tool_session(runtime)
            if session is None:
                return "ContextRender cannot tell which conversation this is: nothing to restore."
            return await answer.acall(handle, session)

        schema = answer.schema["function"]
        return StructuredTool.from_function(
            func=contextrender_restore, coroutine=acontextrender_restore, name=RESTORE_TOOL,
            description=schema["description"],
        )
