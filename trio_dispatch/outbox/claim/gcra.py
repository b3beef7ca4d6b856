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

A start claimed ahead of a free slot begins later than its claim. Counted
at the claim, such starts could begin together as slots free up, beyond
the burst; so where a worker claims ahead (:mod:`.pins`) the claim admits
them into ``rate_held`` instead -- spent in full for as long as they wait,
without draining -- and the worker's next write moves each into ``tat``
at the time it began (``max(tat, began) + T``), or out of the count if it
never will. The bucket's level plus the held starts never exceeds the
burst, and the level alone is exactly the one of the starts as they
began, so every window keeps to ``rate * w + burst``.
"""

from __future__ import annotations

import math
from typing import Final

from ...destinations.policy import Rate

SLACK: Final = 1e-9
"""Float error of a whole number of intervals (``0.02 * 3`` is not 0.06):
counted in the decision's favour, never by more than a billionth of an
interval."""


def room(rate: Rate, burst: int, tat: float | None, now: float, held: int = 0) -> int:
    """How many starts the rate admits at ``now`` (0 or more), ``held`` of
    its starts claimed ahead and not yet begun (:mod:`.pins`)."""
    interval = rate.interval
    used = 0.0 if tat is None else max(0.0, tat - now)
    return max(0, math.floor((burst * interval - used) / interval + SLACK) - held)


def advanced(rate: Rate, tat: float | None, now: float, starts: int) -> float:
    """``tat`` after admitting ``starts`` at ``now``."""
    return max(now if tat is None else tat, now) + starts * rate.interval


def next_start(rate: Rate, burst: int, tat: float | None, now: float) -> float:
    """The earliest time from ``now`` on when the rate admits a start."""
    if tat is None:
        return now
    return max(now, tat + rate.interval - burst * rate.interval)
