"""Which stretch of time a report covers: a named period that contains now (UTC), or explicit
bounds given as epoch seconds or ISO 8601."""

from __future__ import annotations

import datetime as dt
import math

PERIODS = ("all", "hour", "day", "month")


def parse_instant(text: str) -> float:
    """Epoch seconds, or an ISO 8601 time (UTC unless it says otherwise)."""
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(value):
            raise ValueError(f"not a time: {text!r}")
        return value
    try:
        t = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"not a time: {text!r} (epoch seconds or ISO 8601)") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)
    return t.timestamp()


def resolve_period(
    period: str, since: str | None, until: str | None, now_s: float
) -> tuple[float, float]:
    """`[since_s, until_s)`: explicit bounds win over the named period's."""
    if period not in PERIODS:
        raise ValueError(f"period must be one of {', '.join(PERIODS)}, got {period!r}")
    t = dt.datetime.fromtimestamp(now_s, tz=dt.UTC)
    if period == "all":
        start = 0.0
    elif period == "hour":
        start = t.replace(minute=0, second=0, microsecond=0).timestamp()
    elif period == "day":
        start = t.replace(hour=0, minute=0, second=0, microsecond=0).timestamp()
    else:
        start = t.replace(day=1, hour=0, minute=0, second=0, microsecond=0).timestamp()
    since_s = parse_instant(since) if since is not None else start
    until_s = parse_instant(until) if until is not None else now_s
    if until_s < since_s:
        raise ValueError("the period ends before it starts")
    return since_s, until_s
