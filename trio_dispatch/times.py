"""How a time is shown to a person, the same in the CLI, the dashboard and
the logs: UTC, ISO 8601, then how far it is from now; and how a time a
person types there is read (:func:`read_time`)."""

from __future__ import annotations

import datetime
import re
from typing import Final


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


_AGO: Final = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])(?:\s+ago)?$")
_AGO_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
TIME_HELP: Final = (
    "ISO 8601 with an offset or Z (2026-12-02T09:00:00Z, 2026-12-02T10:00+01:00), "
    "or a duration before now with its unit (90s, 30m, 2h, 7d, 1w)"
)
"""What :func:`read_time` accepts, for help texts and errors."""


def read_time(name: str, text: str, now: float) -> float:
    """A time a person typed, as Unix seconds: ISO 8601 with a UTC offset or
    ``Z`` (a time without one is refused: whose 09:00 would it be?), or a
    duration with its unit meaning that long before ``now`` (``2h``, ``2h
    ago``). Anything else is a ``ValueError`` naming ``name`` and the text."""
    given = text.strip()
    ago = _AGO.match(given.lower())
    if ago is not None:
        return now - float(ago.group(1)) * _AGO_UNITS[ago.group(2)]
    if given[-1:] in ("z", "Z"):
        given = given[:-1] + "+00:00"
    try:
        stamp = datetime.datetime.fromisoformat(given)
    except ValueError:
        raise ValueError(f"invalid {name} {text!r}: use {TIME_HELP}") from None
    if stamp.tzinfo is None:
        raise ValueError(f"invalid {name} {text!r}: no UTC offset; add Z, or one such as +01:00")
    return stamp.timestamp()


def iso_time(when: float) -> str:
    """``2026-12-02T09:00:00.250000Z``: Unix seconds as ISO 8601 in UTC, to
    the microsecond, so :func:`read_time` reads back the same instant."""
    stamp = datetime.datetime.fromtimestamp(when, datetime.UTC)
    return stamp.isoformat(timespec="microseconds").replace("+00:00", "Z")
