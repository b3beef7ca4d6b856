"""The registry of sections: each name ``--section`` accepts, the function
that measures it, in the order a full run takes them.

A new section is a module of this package with a function
``run_<name>(bench: Bench) -> Outcome`` (its figures, notes and engine rows)
and one line here; describe it in ``scripts/bench.py``'s docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from . import (
    cancel,
    capped,
    coalesce,
    core,
    destinations,
    huey_section,
    ordering,
    postgres,
    priority,
    schedules,
    sync_section,
    table,
    tracing_section,
    tx,
    webhook,
)
from .harness import Bench, Outcome

Section = Callable[[Bench], Outcome]
"""A section: run it on the run's settings, get what it measured."""

SECTIONS: Final[dict[str, Section]] = {
    "core": core.run_core,
    "huey": huey_section.run_huey,
    "tx": tx.run_tx,
    "table": table.run_table,
    "postgres": postgres.run_postgres,
    "sync": sync_section.run_sync,
    "webhook": webhook.run_webhook,
    "capped": capped.run_capped,
    "ordering": ordering.run_ordering,
    "schedules": schedules.run_schedules,
    "tracing": tracing_section.run_tracing,
    "destinations": destinations.run_destinations,
    "cancel": cancel.run_cancel,
    "priority": priority.run_priority,
    "coalesce": coalesce.run_coalesce,
}
