"""Retry backoff: the ADR schedule, with optional jitter."""

from __future__ import annotations

import random
from typing import Final

BASE_BACKOFF_SECONDS: Final = 30
MAX_BACKOFF_SECONDS: Final = 1800


def backoff_seconds(attempt: int) -> float:
    """Delay before the next attempt after ``attempt`` sends:
    ``min(30 * 2**attempt, 1800)``. With the standard flow the first failure
    (attempt 1) waits 60 s, then 120, 240, 480, 960, then the 1,800 s cap."""
    if attempt >= 16:  # 30 * 2**6 already exceeds the cap; avoid huge ints
        return float(MAX_BACKOFF_SECONDS)
    return float(min(BASE_BACKOFF_SECONDS * (2**attempt), MAX_BACKOFF_SECONDS))


def jittered_backoff(attempt: int, jitter: float, *, rng: random.Random | None = None) -> float:
    """``backoff_seconds(attempt)`` spread by up to ``+-jitter`` of itself.

    ``jitter`` is a fraction in ``[0, 1]``; 0 returns the exact ADR schedule.
    """
    if not 0.0 <= jitter <= 1.0:
        raise ValueError(f"retry jitter must be between 0 and 1, got {jitter!r}")
    delay = backoff_seconds(attempt)
    if jitter == 0.0:
        return delay
    spread = (rng or random).uniform(-jitter, jitter)
    return max(0.0, delay * (1.0 + spread))
