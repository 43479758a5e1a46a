"""ContextRender for Hermes Agent (hermes-agent 0.19): a plugin that renders every provider request
within a token budget, in-process with the `Engine` (no server needed), and keeps Hermes's own
compression from rewriting the stored history.

Two parts, registered by `register(ctx)`:
- `llm_request` middleware: before each provider call, the request's `messages` (chat
  completions) are rendered within B and replace that one call's messages. Hermes's stored
  history is not changed. Each render ingests what the engine has not seen of the conversation,
  so every finished turn is stored by the next request of the session.
- A context engine (`context.engine: contextrender`) that never compresses: `compress` returns
  the history unchanged, so Hermes's summarising compressor does not destroy what ContextRender
  renders from. It takes the model's context length from Hermes (`update_model`): B is
  CONTEXTRENDER_BUDGET tokens if set, else CONTEXTRENDER_BUDGET_SHARE (default 0.5) of it. It
  also offers the `contextrender_restore` tool, answered from the engine's store.

The session is named by Hermes's own session id: `hermes-<session_id>`. The backend is the
in-process Engine on CONTEXTRENDER_STORE (default $HERMES_HOME/contextrender), or a server when
CONTEXTRENDER_URL is set (CONTEXTRENDER_TOKEN). Fail open: a render that fails leaves the
request as Hermes made it, and the `contextrender.hermes` logger says why.

Enable it (config.yaml): `plugins: {enabled: [contextrender]}` and `context: {engine: contextrender}`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from agent.context_engine import ContextEngine

from contextrender.tools import RESTORE_TOOL, restore_tool
from contextrender_integrations.common import render_or_none, session_name

__all__ = ["ContextRenderEngine", "RESTORE_TOOL", "register"]

log = logging.getLogger("contextrender.hermes")
NAME = "contextrender"


class _Shared:
    """What every agent's copy of the engine shares: the backend and each model's context length
    (Hermes deep-copies a plugin's engine for every agent)."""

    def __init__(self) -> None:
        self._backend: Any = None
        self._lock = threading.Lock()
        self.context_length: dict[str, int] = {}

    @property
    def backend(self) -> Any:
        with self._lock:
            if self._backend is None:
                url = os.environ.get("CONTEXTRENDER_URL")
                if url:
                    from contextrender.client import Client

                    self._backend = Client(url, token=os.environ.get("CONTEXTRENDER_TOKEN") or None)
                else:
                    from contextrender.local import Engine

                    home = Path(os.environ.get("HERMES_HOME") or Path.home() / ".hermes")
                    self._backend = Engine(os.environ.get("CONTEXTRENDER_STORE") or home / "contextrender")
            return self._backend

    def budget(self, model: str) -> int | None:
        """B for a request to `model`: CONTEXTRENDER_BUDGET, else a share of its context length."""
        fixed = os.environ.get("CONTEXTRENDER_BUDGET")
        if fixed:
            return int(fixed)
        length = self.context_length.get(model) or max(self.context_length.values(), default=0)
        if not length:
            return None
        return int(length * float(os.environ.get("CONTEXTRENDER_BUDGET_SHARE") or 0.5))


SHARED = _Shared()


class ContextRenderEngine(ContextEngine):
    """A context engine that keeps the history whole (ContextRender renders each request from
    it) and answers `contextrender_restore`."""

    def __init__(self, shared: _Shared = SHARED) -> None:
        self.shared = shared
        self.session_id = ""

    def __deepcopy__(self, memo: dict) -> ContextRenderEngine:
        copy = ContextRenderEngine(self.shared)  # the backend and lengths are shared, counters are not
        copy.__dict__.update({k: v for (k, v) in self.__dict__.items() if k not in ("shared",)})
        return copy

    @property
    def name(self) -> str:
        return NAME

    def update_model(self, model: str, context_length: int, *args: Any, **kwargs: Any) -> None:
        super().update_model(model, context_length, *args, **kwargs)
        self.shared.context_length[model] = int(context_length or 0)

    def update_from_response(self, usage: dict[str, Any]) -> None:
        self.last_prompt_tokens = int(usage.get("prompt_tokens") or 0)
        self.last_completion_tokens = int(usage.get("completion_tokens") or 0)
        self.last_total_tokens = int(usage.get("total_tokens") or 0)

    def should_compress(self, prompt_tokens: int | None = None) -> bool:
        return False  # every request is rendered within B: the stored history never needs to shrink

    def has_content_to_compress(self, messages: list[dict[str, Any]]) -> bool:
        return False

    def compress(self, messages: list[dict[str, Any]], current_tokens: int | None = None, focus_topic: str | None = None,
                 force: bool = False, memory_context: str = "") -> list[dict[str, Any]]:
        log.info("contextrender: history kept whole (%d messages); each request is rendered within its budget", len(messages))
        return messages

    def on_session_start(self, session_id: str, **kwargs: Any) -> None:
        self.session_id = session_id or ""

    def get_tool_schemas(self) -> list[dict[str, Any]]:
        return [restore_tool(None).schema["function"]]

    def handle_tool_call(self, name: str, args: dict[str, Any], **kwargs: Any) -> str:
        if name != RESTORE_TOOL:
            return json.dumps({"error": f"Unknown context engine tool: {name}"})
        if not self.session_id:
            return json.dumps({"error": "ContextRender cannot tell which conversation this is: nothing to restore."})
        handle = (args or {}).get("handle")
        text = restore_tool(self.shared.backend)(handle, session_name("hermes", self.session_id))
        return json.dumps({"handle": handle, "result": text})


def on_llm_request(request: dict[str, Any], session_id: str = "", model: str = "", api_mode: str = "", **_: Any) -> dict | None:
    """The `llm_request` middleware: `{"request": ...}` with the rendered messages, or None to
    leave the request as Hermes made it."""
    messages = request.get("messages")
    if api_mode not in ("", "chat_completions") or not isinstance(messages, list):
        log.warning("contextrender: request sent unchanged (api_mode %r has no chat-completions messages)", api_mode)
        return None
    if not session_id:
        log.warning("contextrender: request sent unchanged (Hermes gave no session id)")
        return None
    budget = SHARED.budget(model)
    if budget is None:
        log.warning("contextrender: request sent unchanged (no context length known for %s; set CONTEXTRENDER_BUDGET)", model)
        return None
    session = session_name("hermes", session_id)
    try:
        backend = SHARED.backend
    except Exception as error:  # noqa: BLE001 - fail open
        log.warning("contextrender: request sent unchanged for session %s (%s: %s)", session, type(error).__name__, error)
        return None
    rendered = render_or_none(backend, session, messages, budget=budget, log=log)
    if rendered is None:
        return None
    log.info("contextrender: %d of %d history tokens sent (%d results omitted)", rendered.history_tokens,
             rendered.full_history_tokens, rendered.omitted)
    return {"request": {**request, "messages": rendered.messages}}


def register(ctx: Any) -> None:
    """Hermes's plugin entry: the request middleware and the non-destructive context engine."""
    ctx.register_middleware("llm_request", on_llm_request)
    ctx.register_context_engine(ContextRenderEngine())
