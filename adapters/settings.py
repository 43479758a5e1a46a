"""The number settings read from the environment (`CONTEXTRENDER_*`), in one place: every one is a
finite positive number, and a bad value is told what it must be and what it got."""

from __future__ import annotations

import math
import os


def positive_number(name: str, default: float, *, unit: str = "", at_least: float = 0.0) -> float:
    """`name`'s value (unset or blank: `default`): a finite number above 0, and at least `at_least`;
    else a ValueError naming the setting, what it must be (in `unit`s) and the value it got."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0 and value >= at_least):
        what = f" of {unit}" if unit else ""
        bound = f", at least {at_least:g}" if at_least > 0 else ""
        raise ValueError(f"{name} must be a positive number{what}{bound} (got {raw!r})")
    return value


def start_setting(name: str, default: float, *, unit: str = "", at_least: float = 0.0) -> float:
    """`positive_number` for a setting read when a server starts: a bad value stops the start."""
    try:
        return positive_number(name, default, unit=unit, at_least=at_least)
    except ValueError as bad:
        raise SystemExit(f"ContextRender refuses to start: {bad}") from None
