"""ContextRender's Python layer: the in-process engine (more adapters build on it)."""

from contextrender_adapters.engine import (
    ContextRenderError,
    Engine,
    HistoryConflict,
    InvalidRequest,
    RenderConfig,
    RenderResult,
    ResultDecision,
    UnknownSession,
)

__all__ = [
    "Engine",
    "RenderConfig",
    "RenderResult",
    "ResultDecision",
    "ContextRenderError",
    "InvalidRequest",
    "UnknownSession",
    "HistoryConflict",
]
