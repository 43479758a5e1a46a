"""The proxy's defaults, apart from the modules that use them so that the command line can show
them without importing the web stack (FastAPI, the format layers: about a second)."""

from __future__ import annotations

__all__ = ["DEFAULT_ANSWER_DELAY", "DEFAULT_PORT", "DEFAULT_RESTORE_ROUNDS", "DEFAULT_SELECTOR", "DEFAULT_UPSTREAM_TIMEOUT"]

# The renderer a request gets without `X-ContextRender-Selector`.
DEFAULT_SELECTOR = "contextrender"
# Restore rounds one agent request may take (each is one more upstream call).
DEFAULT_RESTORE_ROUNDS = 3
# Seconds the upstream may stay silent (before its headers, or between two chunks) before a 504.
DEFAULT_UPSTREAM_TIMEOUT = 600.0
# The port `contextrender proxy` listens on without --port ($CONTEXTRENDER_PROXY_PORT).
DEFAULT_PORT = 8800
# Seconds an answer waits for the next request of its session, to be stored with that request's
# render instead of alone ($CONTEXTRENDER_ANSWER_DELAY; docs/design-decisions.md).
DEFAULT_ANSWER_DELAY = 1.0
