"""Walker errors as HTTP statuses: a walker that raised one of ContextRender's errors answers
with that error's status (400, 404, 409) and a code, instead of jac-scale's generic 500; other
failures stay 500, with the traceback in the server log and never in the response."""

from __future__ import annotations

import logging
import re
from typing import Any

__all__ = ["map_walker_error"]

logger = logging.getLogger("contextrender.server")

# A traceback ends with the exception: "graph.errors.InvalidRequest: message" (a message may
# run over several lines).
_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w+): ")


def _error_statuses() -> dict[str, int]:
    """HTTP status of each ContextRender error class, by class name."""
    # Imported here: this module loads while jaclang itself is being imported (a plugin).
    from contextrender.core import ContextRenderError

    statuses = {ContextRenderError.__name__: ContextRenderError.status}
    pending = list(ContextRenderError.__subclasses__())
    while pending:
        cls = pending.pop()
        statuses[cls.__name__] = cls.status
        pending.extend(cls.__subclasses__())
    return statuses


def _error_code(name: str) -> str:
    """InvalidRequest -> INVALID_REQUEST."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()


def map_walker_error(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """The status and envelope for a failed walker call (jac-scale answers 500 for every error)."""
    error = body.get("error") or {}
    details = error.pop("details", None)
    if not details and str(error.get("message") or "").lower().startswith(("writeconflict", "write_conflict")):
        # jaclang gave up replaying a commit that kept conflicting with concurrent ones: nothing was
        # written (it says 409; jac-scale answers 500).
        name, status = "WriteConflict", 409
        error["message"] = f"{error.get('message')}: nothing was written; retry the request"
    else:
        # The exception that ended the walker: the first unindented line after the frames of the
        # last traceback (an error raised while handling another comes last).
        last = str(details or "").rpartition("Traceback (most recent call last):")[2]
        match = next((_ERROR_LINE.match(line) for line in last.splitlines() if line and not line[0].isspace()), None)
        name = match.group(1) if match else ""
        status = _error_statuses().get(name)
    if status is None or status >= 500:
        if details:
            logger.error("walker failed: %s\n%s", error.get("message"), details)
        return 500, body
    error["code"] = _error_code(name)
    body["error"] = error
    if isinstance(body.get("meta"), dict) and isinstance(body["meta"].get("extra"), dict):
        body["meta"]["extra"]["http_status"] = status
    return status, body
