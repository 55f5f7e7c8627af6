"""The one rule for every duration a person gives vigil (timeouts, intervals, worker policy):
a finite number of seconds, above 0, at most a day. A longer wait would hold one of the
agent's drive slots for it (an `inf` drain never sends SIGKILL), and NaN compares false
with everything. The store holds the same bound as a constraint (migration 0006)."""

from __future__ import annotations

import math
from datetime import datetime, timedelta

from models.errors import BadInput

MAX_SECONDS = 86400.0  # a day
# The duration columns of `hosts` (max_run may be NULL: no recycling).
DURATIONS = ("drain_timeout", "health_timeout", "max_run", "restart_floor", "restart_cap",
             "restart_reset", "converge_grace")


def parse_seconds(text: str, what: str) -> float:
    """A duration given as text (a command-line option, an environment variable)."""
    try:
        return check_seconds(float(text), what)
    except ValueError:
        return check_seconds(text, what)  # not a number: refused by name


def check_seconds(value: object, what: str, example: str = "10") -> float:
    """`value` as seconds, or BadInput naming `what` (an option or a key) and the bound."""
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not math.isfinite(value) or not 0 < value <= MAX_SECONDS):
        start = f"{what} must" if what else "must"
        shown = f"{value:g}" if isinstance(value, float) else value
        raise BadInput(f"{start} be a positive number of seconds up to {MAX_SECONDS:.0f} "
                       f"(a day), not {shown}",
                       f"give e.g. {what} {example}" if what.startswith("-") else f"give e.g. {example}")
    return float(value)  # type: ignore[arg-type]


def iso(d: datetime | None) -> str | None:
    """A stored time (naive UTC) as ISO 8601 with its Z."""
    return d.isoformat() + "Z" if d is not None else None


def sql_check(column: str, nullable: bool = False) -> str:
    """The same bound as a CHECK expression (NaN: NULL on SQLite, above every number on
    PostgreSQL, so refused either way)."""
    bound = f"{column} > 0 AND {column} <= {MAX_SECONDS:.0f}"
    return f"({column} IS NULL OR ({bound}))" if nullable else f"({bound})"


AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
MIN_AGE, MAX_AGE = 3600.0, 36500 * 86400.0  # an hour; a hundred years


def parse_age(text: str, what: str) -> timedelta | None:
    """How long history is kept (`--keep-history`): a number and a unit, s, m, h, d or w
    (`30d`, `12h`), from an hour to a hundred years; `forever` keeps all of it (None)."""
    t = text.strip().lower()
    if t == "forever":
        return None
    fix = f"give e.g. {what} 30d (units s, m, h, d, w), or {what} forever"
    unit = t[-1:] if t[-1:] in AGE_UNITS else ""
    try:
        seconds = float(t[: len(t) - len(unit)]) * AGE_UNITS[unit or "s"]
    except ValueError:
        raise BadInput(f"{what} {text!r} is not an age", fix) from None
    if not unit:
        raise BadInput(f"{what} {text!r} has no unit", fix)
    if not math.isfinite(seconds) or not MIN_AGE <= seconds <= MAX_AGE:
        raise BadInput(f"{what} {text} is out of range: keep history from an hour to a "
                       "hundred years", fix)
    return timedelta(seconds=seconds)
