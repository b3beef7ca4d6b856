"""The worker's expiry sweep: rows that no claim reads still expire at
their own ``expires_at``.

Every worker runs :class:`ExpirySweeper` beside its claim loop (no leader:
two workers sweeping the same rows write one transition per row, see
:mod:`trio_dispatch.outbox.expiry`). It looks at the expiry index (one
read: the earliest deadline of a row it may expire), sleeps until that
deadline, and then expires what is past due, a batch a transaction, until
nothing is, pausing after each full batch (:data:`PACE`) so that the
claims keep most of the store's writes. It never sleeps longer than its
``check_seconds`` (at most :data:`CHECK_SECONDS`, or the worker's
``tick_seconds`` if shorter), for what a look cannot foresee: a row
enqueued after it with an earlier deadline, a delivering row whose lease
ends after its deadline, a row another transaction held. So a row expires
at its deadline when the sweeper knew of it, and at most
``check_seconds`` (plus the batch's own write) after it otherwise; a
backlog of many rows past due at once is worked off at the pace
:data:`PACE` allows.

The sweep is not on the claim's path: its reads run on the store's read
side, its writes are units of work of their own (short: at most
:data:`~trio_dispatch.outbox.expiry.SWEEP_BATCH` rows each), and with
nothing past due it costs one indexed read per look.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Final

import anyio

from ..outbox.expiry import SWEEP_BATCH, expire_overdue_dispatches, next_expiry_at
from ..store.base import Database

CHECK_SECONDS: Final = 1.0
"""The longest the sweeper sleeps between two looks at the expiry index."""
PACE: Final = 3.0
"""After a full batch (more rows past due remain), the sweeper waits this
many times as long as the batch took: working off a backlog of expired
rows holds the store's writes a quarter of the time at most, and the
claims keep the rest. Expiring a row writes about what finishing a
delivery does; unpaced, a sweep of 100,000 rows cut the other
destinations' deliveries/s to 0.2-0.3x while it ran (SQLite and
PostgreSQL), paced 0.7-0.9x."""


class ExpirySweeper:
    """Expire ``db``'s rows past their deadline as their deadlines pass,
    until cancelled. ``clock`` is the worker's wall clock (the claim's
    expiry reads the same); the rows it expires are added to ``counts``
    (the worker's running totals, under ``expired``)."""

    def __init__(
        self,
        db: Database,
        counts: dict[str, int],
        clock: Callable[[], float],
        actor: str,
        log: logging.Logger,
        check_seconds: float = CHECK_SECONDS,
        *,
        batch: int = SWEEP_BATCH,
    ) -> None:
        self.db = db
        self.clock = clock
        self.actor = actor
        self.log = log
        self.counts = counts
        self.check_seconds = min(check_seconds, CHECK_SECONDS)
        self.batch = batch
        self.failures = 0
        """Looks that failed in a row (a store error): logged, then retried
        at the next look."""

    async def run(self) -> None:
        """Sweep until cancelled. A store error is logged and the next look
        tries again. Cancellation lands between batches: a batch that has
        begun commits and is counted first (a batch is never cut in half)."""
        while True:
            wait = await self.look()
            await anyio.sleep(wait)

    async def look(self) -> float:
        """Expire every row past its deadline now, a batch a transaction;
        return how long to sleep before the next look."""
        try:
            wait = await self._sweep()
        except Exception:
            self.failures += 1
            self.log.log(
                logging.WARNING if self.failures == 1 else logging.DEBUG,
                "expiry sweep failed; retrying in %gs",
                self.check_seconds,
                exc_info=True,
            )
            return self.check_seconds
        self.failures = 0
        return wait

    async def _sweep(self) -> float:
        expired = 0
        try:
            while True:
                now = self.clock()
                deadline = await next_expiry_at(self.db, now=now)
                if deadline is None or deadline > now:
                    return self.check_seconds if deadline is None else self._until(deadline)
                started = anyio.current_time()
                # Shielded: a batch that commits is counted, even as the
                # worker stops (it waits one short batch at most).
                with anyio.CancelScope(shield=True):
                    swept = await expire_overdue_dispatches(
                        self.db, clock=self.clock, limit=self.batch, actor=self.actor
                    )
                    self.counts["expired"] += swept.expired
                took = anyio.current_time() - started
                expired += swept.expired
                if not swept.expired:
                    # What is past due is held by another transaction (a claim,
                    # another worker's sweep): look again later, not at once.
                    return self.check_seconds
                if swept.read >= self.batch:  # more to come: leave the writes to the claims
                    await anyio.sleep(took * PACE)
        finally:
            if expired:  # one line per look, however many batches it took
                self.log.info("expired %d dispatches past their expires_at", expired)

    def _until(self, deadline: float) -> float:
        return max(0.0, min(self.check_seconds, deadline - self.clock()))
