"""Retry backoff: ``backoff_seconds`` or a configured schedule, with optional jitter."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Final

from .values import show

BASE_BACKOFF_SECONDS: Final = 30
MAX_BACKOFF_SECONDS: Final = 1800


def backoff_seconds(attempt: int) -> float:
    """Delay before the next attempt after ``attempt`` sends:
    ``min(30 * 2**attempt, 1800)``. With the standard flow the first failure
    (attempt 1) waits 60 s, then 120, 240, 480, 960, then the 1,800 s cap."""
    if attempt >= 16:  # 30 * 2**6 already exceeds the cap; avoid huge ints
        return float(MAX_BACKOFF_SECONDS)
    return float(min(BASE_BACKOFF_SECONDS * (2**attempt), MAX_BACKOFF_SECONDS))


MAX_SCHEDULE_SECONDS: Final = 10 * 365 * 86400
"""The longest delay a retry schedule may name: ten years."""


def check_retry_schedule(name: str, value: object) -> tuple[float, ...] | None:
    """A retry schedule as the worker uses it: None (``backoff_seconds``) or a
    non-empty list of seconds, each a finite number from 0 to
    :data:`MAX_SCHEDULE_SECONDS`. Raises ``ValueError`` naming ``name``."""
    if value is None:
        return None
    if isinstance(value, str | bytes) or not isinstance(value, Sequence) or not value:
        raise ValueError(
            f"{name} must be a non-empty list of seconds (before attempt 2, 3, ...), "
            f"got {show(value)}"
        )
    delays = []
    for index, item in enumerate(value):
        if (
            isinstance(item, bool)
            or not isinstance(item, int | float)
            or (isinstance(item, float) and not math.isfinite(item))
            or not 0 <= item <= MAX_SCHEDULE_SECONDS  # exact for an int of any size
        ):
            raise ValueError(
                f"{name}[{index}] must be a number of seconds from 0 to "
                f"{MAX_SCHEDULE_SECONDS}, got {show(item)}"
            )
        delays.append(float(item))
    return tuple(delays)


def retry_delay(attempt: int, schedule: Sequence[float] | None = None) -> float:
    """Seconds before the attempt after ``attempt``: ``schedule[attempt - 1]``
    (the last value repeating) when a schedule is configured, else
    :func:`backoff_seconds`."""
    if not schedule:
        return backoff_seconds(attempt)
    return float(schedule[min(max(attempt, 1), len(schedule)) - 1])


def jittered_backoff(
    attempt: int,
    jitter: float,
    *,
    rng: random.Random | None = None,
    schedule: Sequence[float] | None = None,
) -> float:
    """:func:`retry_delay` spread by up to ``+-jitter`` of itself.

    ``jitter`` is a fraction in ``[0, 1]``; 0 returns the exact schedule.
    """
    if not 0.0 <= jitter <= 1.0:
        raise ValueError(f"retry jitter must be between 0 and 1, got {jitter!r}")
    delay = retry_delay(attempt, schedule)
    if jitter == 0.0:
        return delay
    spread = (rng or random).uniform(-jitter, jitter)
    return max(0.0, delay * (1.0 + spread))
