"""How an operator's typed end of a pause is read, the same on the command
line and in the dashboard: a duration (``30m``, ``2h``: the grammar of the
CLI's other durations) or a time (ISO 8601 with an offset or ``Z``, in the
future). Each refusal is a ``ValueError`` naming the text and what is
allowed."""

from __future__ import annotations

import datetime
import re
import time
from typing import Final

from ..values import show

TIME_HELP: Final = "ISO 8601 with an offset or Z (2026-12-02T18:00:00Z, 2026-12-02T19:00+01:00)"
DURATION_HELP: Final = "a number with s, m, h, d or w (e.g. 30m, 2h)"

MIN_PAUSE_SECONDS: Final = 0.001
"""The shortest pause with an end (``pause_destination``'s ``for_seconds``)."""
_DURATION: Final = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS: Final = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_for(text: str) -> float:
    """``90``, ``45s``, ``30m``, ``12h``, ``7d``, ``2w`` -> seconds (the
    grammar of the CLI's ``parse_duration``), at least :data:`MIN_PAUSE_SECONDS`."""
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"invalid duration {show(text)}: use {DURATION_HELP}")
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if seconds < MIN_PAUSE_SECONDS:
        raise ValueError(f"invalid duration {show(text)}: a pause lasts at least 1ms")
    return seconds


def parse_until(text: str, now: float | None = None) -> float:
    """A time as Unix seconds: ISO 8601 with a UTC offset or ``Z`` (a time
    without one is refused: whose 18:00 would it be?), after ``now``."""
    given = text.strip()
    if given[-1:] in ("z", "Z"):
        given = given[:-1] + "+00:00"
    try:
        stamp = datetime.datetime.fromisoformat(given)
    except ValueError:
        raise ValueError(f"invalid time {show(text)}: use {TIME_HELP}") from None
    if stamp.tzinfo is None:
        raise ValueError(f"invalid time {show(text)}: no UTC offset; add Z, or one such as +01:00")
    until = stamp.timestamp()
    if until <= (time.time() if now is None else now):
        raise ValueError(f"invalid time {show(text)}: it is not in the future")
    return until
