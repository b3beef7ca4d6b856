"""How a time is shown to a person, the same in the CLI, the dashboard and
the logs: UTC, ISO 8601, then how far it is from now."""

from __future__ import annotations

import datetime


def relative_time(when: float | None, now: float) -> str:
    """``in 1m05s`` / ``3h02m ago`` / ``now``; ``-`` for None."""
    if when is None:
        return "-"
    delta = when - now
    if abs(delta) < 1:
        return "now"
    seconds = int(abs(delta))
    if seconds < 60:
        text = f"{seconds}s"
    elif seconds < 3600:
        text = f"{seconds // 60}m{seconds % 60:02d}s"
    elif seconds < 86400:
        text = f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    else:
        text = f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"
    return f"in {text}" if delta > 0 else f"{text} ago"


def format_time(when: float | None, now: float) -> str:
    """``2026-12-01T11:34:29Z (3m05s ago)``: the time in UTC as ISO 8601,
    then how far it is from ``now``; ``-`` for None. The one way every
    command prints a time (``--json`` keeps the Unix seconds)."""
    if when is None:
        return "-"
    try:
        stamp = datetime.datetime.fromtimestamp(when, datetime.UTC)
    except (OverflowError, OSError, ValueError):  # beyond what a calendar holds
        return repr(when)
    return f"{stamp:%Y-%m-%dT%H:%M:%SZ} ({relative_time(when, now)})"
