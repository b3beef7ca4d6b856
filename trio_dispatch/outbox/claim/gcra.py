"""A destination's rate as a generic cell rate algorithm (GCRA): one number
of state, the theoretical arrival time ``tat`` (``rate_tat`` in the
destination's state row), and no background refill.

With ``T`` the rate's interval (seconds per start) and ``burst`` starts
allowed at once, ``n`` more starts are admitted at time ``t`` while
``max(tat, t) + n * T - t <= burst * T``, and admitting them moves ``tat``
to ``max(tat, t) + n * T``. So over any window of ``w`` seconds at most
``burst + w / T`` starts are admitted (``rate * w + burst``), however the
starts are spread over claims, workers and hosts, as long as each decision
reads the ``tat`` the previous one wrote (the claim locks the row) and all
of them read one clock (PostgreSQL: the server's).
"""

from __future__ import annotations

import math
from typing import Final

from ...destinations.policy import Rate

SLACK: Final = 1e-9
"""Float error of a whole number of intervals (``0.02 * 3`` is not 0.06):
counted in the decision's favour, never by more than a billionth of an
interval."""


def room(rate: Rate, burst: int, tat: float | None, now: float) -> int:
    """How many starts the rate admits at ``now`` (0 or more)."""
    interval = rate.interval
    used = 0.0 if tat is None else max(0.0, tat - now)
    return max(0, math.floor((burst * interval - used) / interval + SLACK))


def advanced(rate: Rate, tat: float | None, now: float, starts: int) -> float:
    """``tat`` after admitting ``starts`` at ``now``."""
    return max(now if tat is None else tat, now) + starts * rate.interval


def next_start(rate: Rate, burst: int, tat: float | None, now: float) -> float:
    """The earliest time from ``now`` on when the rate admits a start."""
    if tat is None:
        return now
    return max(now, tat + rate.interval - burst * rate.interval)
