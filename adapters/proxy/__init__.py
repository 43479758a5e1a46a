"""The proxy: it renders the history of every conversation request within the budget before
forwarding it upstream, and passes everything else through unchanged.

    contextrender proxy --upstream https://api.openai.com/v1 --budget 6000 --port 8800

Requests to `/v1/<path>` go to `<upstream>/<path>` (the upstream is a base URL as an OpenAI or
Anthropic client takes it, `/v1` included); other paths are appended to the upstream URL as they are.

Three protocols are managed, each by a format layer that converts its request to the engine's
message normal form (OpenAI chat-completions messages) and the rendered history back:
`POST /v1/chat/completions` (`chat.py`), `POST /v1/messages` (Anthropic, `adapters/proxy/messages/wire.py`) and
`POST /v1/responses` (OpenAI Responses, `adapters/proxy/responses/wire.py`). For each, the proxy
1. names the session: the `X-ContextRender-Session` header (its bytes read as UTF-8; any value is
   managed: one that is not a valid session id as it stands is stored under a digest of it,
   `named_session`), else a hash of the conversation's stable prefix (`derive_session`);
2. asks the backend (the in-process `Engine`, or a `Client` of a running server) to ingest the
   conversation and render it within the budget (`X-ContextRender-Budget` and
   `X-ContextRender-Selector` override the proxy's for one request), and forwards the request
   rebuilt around the rendered history; every other field, and every header but ContextRender's
   own, is forwarded as is;
3. returns the upstream's answer unchanged (status, headers and body bytes, streamed chunk by chunk
   when the upstream streams) with the render's summary in `X-ContextRender-*` headers;
4. ingests the answer into the session once it is complete, with the usage the upstream reported.

On every protocol, when the render omitted or compacted a result, the forwarded request also
offers the tool `contextrender_restore`: the proxy answers the model's restore calls itself from
the store and asks the upstream again, up to `restore_rounds` times, so the agent gets one
ordinary answer (each protocol's `Rounds` says how an answer is read: `restore_loop.py`,
`anthropic_restore.py`, `responses_restore.py`; docs/protocols.md). Where it cannot be offered,
no text names it.

If the backend fails, the proxy logs it once per session and forwards the original request
(fail-open), unless it was created with `fail_closed=True`: then it answers with the error (the
engine's 4xx status, or 502). Every chat-completions answer says which happened in the header
`X-ContextRender-Status`: `managed`, or `unmanaged; reason=<why>`.

The upstream must answer within `upstream_timeout` seconds of silence (504 otherwise); a
non-streamed answer cut short is a 502, a streamed one cut before its final event ends with an
error event the SDKs raise on (or, compressed, a broken connection: `relay`); when the client
leaves, the upstream call is cancelled.

The package, one job per module:
- `app`: the routes (`create_app`) and one conversation request's way through the proxy;
- `admission`: what a request must be before it is read (its Origin, its body's size and read time);
- `upstream`: forwarding, the headers forwarded and relayed, the upstream's errors (504/502);
- `relay`: the streaming relay;
- `restores`: restore rounds, their I/O for every protocol (its `Rounds` reads the answers);
- `sessions`: per-session state (`derive_session`, `model_encoding`, stored answers);
- `chat`: the chat-completions format layer; `interfaces`: what the proxy needs of a backend and
  of a format layer; `command`: `contextrender proxy`.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module of this package that defines it, imported on first use (PEP 562): the
# command line imports `command` and shows the defaults without loading FastAPI.
_EXPORTS = {
    **dict.fromkeys(("BUDGET_HEADER", "SELECTOR_HEADER", "SESSION_HEADER", "SESSION_NAME_HEADER", "STATUS_HEADER",
                     "UNMANAGED_HEADER", "create_app"), "app"),
    **dict.fromkeys(("DEFAULT_RESTORE_ROUNDS", "DEFAULT_SELECTOR", "DEFAULT_UPSTREAM_TIMEOUT"), "defaults"),
    **dict.fromkeys(("register", "run"), "command"),
    "Backend": "interfaces",
    **dict.fromkeys(("RESTORE_ROUNDS_HEADER", "RESTORE_USAGE_HEADER"), "restores"),
    **dict.fromkeys(("derive_session", "model_encoding", "named_session"), "sessions"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
