"""Claim ahead: a worker's slots never wait on a commit while rows are due.

A slot whose attempt has ended hands the end to the :class:`Finisher` and
at once starts the next row claimed ahead of it
(:meth:`~.slots.SlotTable.start_ahead`). The finisher writes every end
handed to it since its last write as one unit of work, and in the same
transaction claims the rows that refill the room (the free slots, and the
rows held ahead of them, up to :func:`most_ahead`): while one commit is in flight the
slots run the rows the one before it claimed, and the next write gathers
their ends. Commits and attempts overlap, and a commit carries as many ends
as came in while the one before it ran -- the cost account of the
PostgreSQL bench shows the commits and fsyncs per delivery this saves
(docs/performance.md).

A row held ahead is a claim like any other: ``delivering`` under its own
lease and fence, counted by the claim rules (ordering keys, caps,
destination limits) from its claim on, and in the slot table with its own
cancel scope, so an operator's cancel cuts it before it starts (its finish
records ``cancelled``). Its attempt is still cut at its own lease end, so
no more rows are held ahead than the slots get through, at the attempts'
mean pace, in a quarter of the lease's margin (:meth:`Pace.ahead_rows`): a
row waits for its slot far less than the margin, and none is held ahead
once attempts take longer than that.
Held rows start by destination in turns, as a claim orders them (its fair
share): rows claimed after an enqueue notice, for a destination with none
started since it had none held, go before the rows held earlier; a newcomer
waits only for the rows already held when its notice came, which the slots
run while the claim that takes it commits. A shutdown gives the rows held
ahead back at once, unsent and uncounted
(``dispatch.pending.released``); a worker killed outright loses none (their
leases bring them back, the attempt numbers never reused).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Final

import anyio

from ..destinations.outcomes import Effects
from ..outbox import Claim, Outcome
from ..outbox.claim.pins import Pins
from ..outbox.delivery import finish_and_claim_many
from ..transports import TransportResult
from .outcomes import OutcomeWriter
from .report import Ledger

AHEAD_SHARE_OF_MARGIN: Final = 0.25
"""The wait a row held ahead may expect for its slot, as a share of the
lease's margin (the lease less the transport's timeout): at most this
wait's worth of attempts is held ahead (:meth:`Pace.ahead_rows`)."""
MOST_AHEAD: Final = 128
"""Rows held ahead at most where writers run side by side (PostgreSQL):
the larger of this and twice ``concurrency``. Measured at concurrency 16
(no-op drains, 3 pairs at load 3): 64 held ahead gave 2,114-3,038
deliveries/s and 163-177 us of client CPU a delivery, against
1,192-2,485/s and 183-267 us with 16 (more ends and claims a
transaction); the postgres section, 3 rounds at load 0.8-1.3: 128 gave
1.23x pgqueuer's defaults (1.20-1.30) where 64 gave 1.06x (1.01-1.07),
a newcomer's start beside a backlog unchanged (1.14x of alone)."""
MOST_AHEAD_ONE_WRITER: Final = 64
"""The same where every write takes its turn on one writer (SQLite): a
newcomer's enqueue waits for the write under way, whose length grows with
the rows held ahead (128 made its start 10.1x of alone, 64 6.5x)."""
PACE_WEIGHT: Final = 0.2
"""The weight of the latest attempt in the mean duration (an exponential mean)."""

STOPPED_AHEAD: Final = "the worker stopped before this claimed-ahead attempt started; not sent"
"""What a row claimed ahead and given back at shutdown says (not counted)."""


@dataclasses.dataclass
class End:
    """An attempt's end, waiting for the finisher's next write."""

    claim: Claim
    result: TransportResult
    started: float
    """When its attempt started (``time.monotonic``)."""
    effects: Effects = dataclasses.field(default_factory=Effects)


def most_ahead(concurrency: int, one_writer: bool = False) -> int:
    """How many rows a worker of ``concurrency`` slots may hold ahead, on a
    store whose writes take turns on ``one_writer`` or not."""
    return max(MOST_AHEAD_ONE_WRITER if one_writer else MOST_AHEAD, 2 * concurrency)


class Pace:
    """How long attempts take (an exponential mean), and so how many rows
    may be held ahead of the slots."""

    def __init__(self, margin: float) -> None:
        self._wait = margin * AHEAD_SHARE_OF_MARGIN
        self.mean = 0.0

    def note(self, seconds: float) -> None:
        self.mean += PACE_WEIGHT * (seconds - self.mean)

    def ahead_rows(self, concurrency: int, most: int) -> int:
        """Rows to hold ahead of ``concurrency`` slots (at most ``most``):
        as many as the slots get through, at the attempts' mean pace, in
        the wait a held row may expect, so each starts well within its
        lease; none once an attempt takes longer than that wait."""
        if self.mean * most <= self._wait * concurrency:
            return most
        return int(self._wait * concurrency / self.mean)


Written = tuple[list[Outcome], list[Claim], dict[str, int]]
"""A batch's write: the ends' outcomes in order, the claims, the scan's counts."""


class Finisher:
    """Writes the ends the slots hand it, a batch a transaction, each with
    the claims that refill the room (see the module docstring). One write
    at a time: ends handed in meanwhile wait for the next."""

    def __init__(
        self,
        writer: Callable[[], OutcomeWriter],
        ledger: Ledger,
        room: Callable[[], int],
        claimed: Callable[[list[Claim], dict[str, int], float], None],
        pins: Pins | None = None,
    ) -> None:
        self._writer = writer
        self.pins = pins
        """The worker's held starts (:mod:`trio_dispatch.outbox.claim.pins`):
        told of rows given back unsent, and of writes that failed (their
        outcome may be unknown)."""
        self._ledger = ledger
        self._room = room
        self._claimed = claimed
        self._ends: list[End] = []
        self.running = False
        """A write is under way (or about to start): ends handed in now join
        the next one without a task of their own."""
        self.reserved = 0
        """Room promised to the claims being written now (by this or by a scan)."""

    def hand(self, end: End) -> bool:
        """Queue ``end``; True if no write is under way (the caller starts
        :meth:`run` in a task)."""
        self._ends.append(end)
        if self.running:
            return False
        self.running = True
        return True

    async def run(self) -> None:
        """Write what is queued, batch after batch, until none is left
        (shielded like a delivery: a shutdown waits for it)."""
        with anyio.CancelScope(shield=True):
            try:
                while self._ends:
                    batch, self._ends = self._ends, []
                    await self._write_batch(batch)
            finally:
                self.running = False

    async def write(self, ends: list[End], want: int) -> Written:
        """Record ``ends`` and claim up to ``want`` rows, in one transaction."""
        writer = self._writer()
        settings = writer.settings
        self.reserved += want
        try:
            return await finish_and_claim_many(
                writer.db,
                [(end.claim, end.result, end.effects) for end in ends],
                want=want,
                lease_seconds=settings.lease_seconds,
                rules=writer.rules,
                retry_jitter=settings.retry_jitter,
                actor=writer.actor,
                clock=writer.clock,
                retry_schedule=settings.retry_schedule,
                destinations=writer.destinations,
            )
        finally:
            self.reserved -= want

    async def _write_batch(self, batch: list[End]) -> None:
        since = anyio.current_time()
        try:
            outcomes, claims, counts = await self.write(batch, max(0, self._room()))
        except Exception:
            self.failed()
            self._ledger.log.exception(
                "recording %d attempts' ends failed; recording each", len(batch)
            )
            await self._record_each(batch)
            return
        for end, outcome in zip(batch, outcomes, strict=True):
            self._ledger.recorded(end.claim, end.result, end.effects, end.started, outcome)
        self._claimed(claims, counts, since)

    async def _record_each(self, ends: list[End]) -> None:
        """Each end on its own, with retries while the store fails."""
        for end in ends:
            outcome = await self._writer().settle(end.claim, end.result, end.effects)
            self._ledger.recorded(end.claim, end.result, end.effects, end.started, outcome)

    def failed(self) -> None:
        """A write of the worker's failed (its outcome may be unknown)."""
        if self.pins is not None:
            self.pins.failed()

    async def give_back(self, claims: list[Claim]) -> None:
        """Give ``claims`` (held ahead, never started) back at once: pending,
        due now, unsent and uncounted."""
        if not claims:
            return
        if self.pins is not None:
            self.pins.dropped(claims)
        with anyio.CancelScope(shield=True):
            unsent = TransportResult.not_sent(STOPPED_AHEAD)
            ends = [End(claim, unsent, time.monotonic()) for claim in claims]
            try:
                outcomes = (await self.write(ends, 0))[0]
            except Exception:
                self.failed()
                self._ledger.log.exception("giving back %d rows claimed ahead failed", len(ends))
                await self._record_each(ends)
                return
            for end, outcome in zip(ends, outcomes, strict=True):
                self._ledger.recorded(end.claim, end.result, end.effects, end.started, outcome)
