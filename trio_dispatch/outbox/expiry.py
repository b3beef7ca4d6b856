"""The expiry sweep: a row past its ``expires_at`` becomes ``expired`` at
its deadline, not when a claim happens to read it.

A claim expires the rows it reads (:func:`~.machine.claim_batch`), but it
never reads the rows its rules hold back: those of a paused, throttled,
open, disabled, rate-exhausted or concurrency-full destination, of a
destination at a worker's cap, and the rows of an ordering key waiting
behind its head (docs/destinations.md#expiry-of-rows-held-back). Left to the claim, they would
stay ``pending`` long past their deadline, and ``ls``, the dashboard, the
metrics and a consumer would all see a row that can no longer be sent. The
sweep finds them through the expiry index (schema version 12: the live rows
that have a deadline, by deadline), a batch a transaction, and expires each
through the state machine with the claim's transition
(:func:`~.machine.expire_overdue`): pending rows whatever holds them back,
delivering rows once their lease has ended; a delivering row whose lease
runs is left to its attempt's end, as at a claim.

Every worker sweeps (:class:`~trio_dispatch.worker.expiry.ExpirySweeper`),
with no leader: rows are locked as they are read where rows lock, and each
write restates its guard, so two workers sweeping the same rows write one
transition per row. The time is the worker's clock, as for the claim's own
expiry (the deadline is the producer's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from ..lifecycle import ACTOR_DELIVERY
from ..store.base import Conn, Database
from ..store.schema import EXPIRY_INDEX
from ..validate import clock_from, require_int
from . import sql
from .machine import Swept, expire_overdue

SWEEP_BATCH: Final = 500
"""Rows one sweep transaction expires at most: a million rows past their
deadline are two thousand short transactions, never one long one."""


async def expire_overdue_dispatches(
    db: Database,
    *,
    now: float | None = None,
    clock: Callable[[], float] | None = None,
    limit: int = SWEEP_BATCH,
    actor: str = ACTOR_DELIVERY,
) -> Swept:
    """Expire up to ``limit`` rows past their ``expires_at`` at the time
    the transaction runs (``clock``, default the wall clock; or the fixed
    ``now``), earliest deadline first, in one transaction (see
    :func:`~.machine.expire_overdue`). Returns how many it read and how
    many it expired; fewer read than ``limit`` means none was left but
    rows another transaction held. Cancelled before its transaction
    starts, it writes nothing; once started, the batch commits whole."""
    read_clock = clock or clock_from(now)
    limit = require_int("limit", limit, minimum=1)
    return await db.write(lambda conn: expire_overdue(conn, read_clock(), limit, actor))


def next_expiry(conn: Conn, at: float) -> float | None:
    """The earliest deadline among the rows the sweep may expire once it
    passes -- pending rows, and delivering rows whose lease ended by
    ``at`` -- or None: one seek of the expiry index."""
    statement = sql.next_expiry(conn.dialect.use_index(EXPIRY_INDEX))
    found = conn.query_one(statement, (float(at),))
    return None if found is None else float(found["expires_at"])


async def next_expiry_at(db: Database, *, now: float | None = None) -> float | None:
    """:func:`next_expiry` at ``now`` (default: the wall clock's now), on a
    snapshot: a deadline at or before ``now`` says a sweep has work."""
    at = clock_from(now)()
    return await db.read(lambda conn: next_expiry(conn, at))
