"""ContextRender for the OpenAI Agents SDK (openai-agents 0.21): a `call_model_input_filter` that
renders the run's input within a token budget before every model call, and a function tool for
restores.

    from agents import Agent, RunConfig, Runner, SQLiteSession
    from contextrender import Engine
    from contextrender_integrations.openai_agents import ContextRender

    session = SQLiteSession("chat-42")
    context = ContextRender(Engine(), budget=6000, conversation=session)
    agent = Agent(name="coder", tools=[..., context.restore_tool])
    Runner.run_sync(agent, "Fix the test.", session=session, run_config=RunConfig(call_model_input_filter=context))

The filter changes only what one model call sends (`ModelInputData.input`); the SDK's own items,
and a `Session`'s stored history, stay whole. Items are read and rebuilt by the proxy's Responses
format layer (adapters/proxy/responses/wire.py): every item the render kept goes to the model exactly as the
SDK made it, an omitted result becomes a `function_call_output` holding the stub.

The session is named by the SDK's own conversation id: the `Session` given (its `session_id`), or
a string; without one, the trace's `group_id` (RunConfig.group_id, "a chat thread ID"). Fail
open: if ContextRender is down or refuses, or the input holds items it does not manage (hosted
tool calls, item references), the model gets the SDK's input unchanged and the
`contextrender.openai_agents` logger says why.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any

from agents import FunctionTool, function_tool
from agents.run_config import CallModelData, ModelInputData
from agents.tracing import get_current_trace

from contextrender.proxy.responses.wire import to_items, to_normal, unmanaged_reason
from contextrender.tools import RESTORE_TOOL, restore_tool
from contextrender_integrations.common import session_name

__all__ = ["ContextRender", "RESTORE_TOOL"]

log = logging.getLogger("contextrender.openai_agents")


class ContextRender:
    """The model-input filter (call it with `CallModelData`, or pass the object as
    `RunConfig(call_model_input_filter=...)`) and its `restore_tool`."""

    def __init__(self, backend: Any, *, budget: int = 6000, selector: str = "", conversation: Any = None,
                 **params: Any) -> None:
        """`backend`: an `Engine`, `Client` or `AsyncClient`. `conversation`: the SDK `Session`
        (or its id) this run belongs to; default: the trace's group_id. `params`: RenderConfig
        settings for every render."""
        self.backend = backend
        self.budget = budget
        self.selector = selector
        self.conversation = conversation
        self.params = params
        self._restore = restore_tool(backend, self.session_id)
        self.restore_tool = self._function_tool()

    def session_id(self) -> str:
        """`openai-agents-<conversation id>`; ValueError when the run names no conversation."""
        conversation = self.conversation
        if conversation is not None and not isinstance(conversation, str):
            conversation = getattr(conversation, "session_id", None)
        if not conversation:
            trace = get_current_trace()
            conversation = getattr(trace, "group_id", None) if trace is not None else None
        if not conversation:
            raise ValueError("no conversation id: pass conversation= (an SDK Session or its id) or set RunConfig.group_id")
        return session_name("openai-agents", conversation)

    async def __call__(self, data: CallModelData[Any]) -> ModelInputData:
        model_data = data.model_data
        body = {"instructions": model_data.instructions, "input": list(model_data.input)}
        try:
            session = self.session_id()
            reason = unmanaged_reason(body)
            if reason:
                raise ValueError(reason)
            normal, origins = to_normal(body)
            rendered = await self._render(session, normal)
            items = to_items(rendered.messages, normal, origins)
        except Exception as error:  # noqa: BLE001 - fail open: the SDK's input goes unchanged
            log.warning("contextrender: model input sent unchanged (%s: %s)", type(error).__name__, error)
            return model_data
        log.info("contextrender: %d of %d history tokens sent (%d results omitted, %d compacted)",
                 rendered.history_tokens, rendered.full_history_tokens, rendered.omitted, rendered.compacted)
        return ModelInputData(input=items, instructions=model_data.instructions)

    async def _render(self, session: str, normal: list[dict]) -> Any:
        render = self.backend.render
        if inspect.iscoroutinefunction(render):
            return await render(session, normal, budget=self.budget, selector=self.selector, **self.params)
        # The Engine and Client block: keep the SDK's event loop free.
        return await asyncio.to_thread(render, session, normal, budget=self.budget, selector=self.selector, **self.params)

    def _function_tool(self) -> FunctionTool:
        restore = self._restore

        async def contextrender_restore(handle: str) -> str:
            """Show again, complete, a tool result that ContextRender left out of this conversation.

            Args:
                handle: The handle the placeholder names, such as r17.
            """
            try:
                session = self.session_id()
            except ValueError as error:
                return f"ContextRender cannot tell which conversation this is ({error}): nothing to restore."
            return await restore.acall(handle, session)

        return function_tool(contextrender_restore, name_override=RESTORE_TOOL, description_override=restore.description)
