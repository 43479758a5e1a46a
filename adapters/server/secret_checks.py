"""The server's secret checks: it refuses to start with jac-scale's public JWT secret or a weak one,
a weak admin password, or a weak monitoring password (CONTEXTRENDER_DEV=1: a warning instead)."""

from __future__ import annotations

import collections
import logging
import math
import os
from typing import Any

__all__ = ["PUBLIC_DEFAULT_SECRET", "admin_password", "check_jwt_secret", "check_monitoring_password", "strength_problem"]

logger = logging.getLogger("contextrender.server")

PUBLIC_DEFAULT_SECRET = "supersecretkey_for_testing_only!"
MIN_SECRET_LENGTH = 32
# A secret's estimated entropy (length x the Shannon entropy of its characters) and its distinct
# characters: 48 random url-safe bytes score ~350 bits, 32 hex digits ~115, one letter repeated 0.
MIN_SECRET_BITS = 96
MIN_SECRET_DISTINCT = 10
MIN_ADMIN_PASSWORD_LENGTH = 16
MIN_ADMIN_PASSWORD_BITS = 60
MIN_ADMIN_PASSWORD_DISTINCT = 8
# jac-scale's built-in passwords (admin account, Prometheus scraping) and other first guesses.
WEAK_PASSWORDS = {"changeme", "adminpassword123", "admin", "password", "administrator", "secret"}


def estimated_bits(value: str) -> float:
    """The entropy `value` shows: the Shannon entropy of its characters, counted over its shortest
    repeating unit only (a pattern repeated adds nothing) and without the characters that continue a
    run of four or more at one step (`abcdefghij`, `97531`). 48 random url-safe bytes score ~350."""
    period = next(p for p in range(1, len(value) + 1) if all(value[i] == value[i - p] for i in range(p, len(value))))
    unit = value[:period]
    # continues[i]: character i is one step on from i-1 by the step that led from i-2 to i-1.
    continues = [i >= 2 and ord(unit[i]) - ord(unit[i - 1]) == ord(unit[i - 1]) - ord(unit[i - 2]) for i in range(len(unit))]
    free = [c for i, c in enumerate(unit)
            if not (continues[i] and ((i + 1 < len(unit) and continues[i + 1]) or continues[i - 1]))]
    counts = collections.Counter(free)
    return -len(free) * sum(n / len(free) * math.log2(n / len(free)) for n in counts.values())


def strength_problem(value: str, min_length: int, min_bits: float, min_distinct: int) -> str:
    """Why `value` is too weak to be a secret ("" when it is not): too short, too few distinct
    characters, or too little estimated entropy (a repeated pattern)."""
    if len(value) < min_length:
        return f"is shorter than {min_length} characters"
    counts = collections.Counter(value)
    if len(counts) < min_distinct:
        return f"has only {len(counts)} distinct characters (at least {min_distinct} needed)"
    bits = estimated_bits(value)
    if bits < min_bits:
        return f"has about {bits:.0f} bits of entropy (at least {min_bits} needed: use random characters)"
    return ""


def require_strong(what: str, value: str, advice: str, length: int, bits: float, distinct: int) -> None:
    """Refuse to start with a public or weak secret (CONTEXTRENDER_DEV=1: a warning instead)."""
    public = value == PUBLIC_DEFAULT_SECRET or value.lower() in WEAK_PASSWORDS
    problem = "is a well-known default" if public else strength_problem(value, length, bits, distinct)
    if not problem:
        return
    if os.environ.get("CONTEXTRENDER_DEV") == "1":
        logger.warning("%s %s: acceptable only because CONTEXTRENDER_DEV=1", what, problem)
        return
    raise SystemExit(f"ContextRender refuses to start: {what} {problem}. {advice}")


def check_jwt_secret(secret: str) -> None:
    require_strong(
        "the JWT secret", secret,
        "Anyone could forge tokens: set CONTEXTRENDER_JWT_SECRET to a random string of 32+ characters "
        "(scripts/serve.sh makes one: python -c 'import secrets; print(secrets.token_urlsafe(48))'), "
        "or set CONTEXTRENDER_DEV=1 for a local test server.",
        MIN_SECRET_LENGTH, MIN_SECRET_BITS, MIN_SECRET_DISTINCT,
    )


def admin_password() -> str | None:
    """CONTEXTRENDER_ADMIN_PASSWORD when it is strong (None: the admin portal stays off)."""
    password = os.environ.get("CONTEXTRENDER_ADMIN_PASSWORD") or None
    if password is not None:
        require_strong(
            "CONTEXTRENDER_ADMIN_PASSWORD", password,
            "The admin portal lists every user and reads any user's graph: give it a random password "
            "of 16+ characters, or unset CONTEXTRENDER_ADMIN_PASSWORD to keep the portal off.",
            MIN_ADMIN_PASSWORD_LENGTH, MIN_ADMIN_PASSWORD_BITS, MIN_ADMIN_PASSWORD_DISTINCT,
        )
    return password


def check_monitoring_password(monitoring: dict[str, Any]) -> None:
    """jac-scale's /metrics (off by default) takes Basic auth with a built-in default password."""
    if monitoring.get("enabled") and monitoring.get("prometheus_admin_password"):
        require_strong(
            "[plugins.scale.monitoring] prometheus_admin_password", str(monitoring["prometheus_admin_password"]),
            "Set a random password of 16+ characters, or leave monitoring off.",
            MIN_ADMIN_PASSWORD_LENGTH, MIN_ADMIN_PASSWORD_BITS, MIN_ADMIN_PASSWORD_DISTINCT,
        )
