"""Schedules: periodic dispatches with no leader, one per tick (docs/schedules.md).

- :mod:`.spec`: a :class:`Schedule`'s fields and checks, its ticks (cron by
  ``cronsim``, or ``every``), and the plan for missed ticks.
- :mod:`.runs`: firing a tick (its run and its dispatch in one
  transaction, the dispatch made by the outbox's
  :class:`~trio_dispatch.outbox.enqueue.EnqueueCall`), manual runs, pause
  and resume, the operators' listing.
- :mod:`.service`: the worker service that sleeps until the next tick.
"""

from __future__ import annotations

from .runs import ORIGINS, Fired, Listing, State
from .service import Scheduler
from .spec import MISSED_POLICIES, Schedule, schedules_from_config

__all__ = [
    "MISSED_POLICIES",
    "ORIGINS",
    "Fired",
    "Listing",
    "Schedule",
    "Scheduler",
    "State",
    "schedules_from_config",
]
