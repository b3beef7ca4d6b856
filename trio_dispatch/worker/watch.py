"""What a worker hears from other processes while it runs: enqueues that
should wake its claim loop, and cancels of the attempts it is running
(docs/controls.md), which it cuts.

A cancel marks its row and, in the same transaction, tells the workers:
PostgreSQL sends a notice carrying the dispatch id; on SQLite the commit
itself is the signal, seen by the listener's ``PRAGMA data_version`` watch
(which cannot say which row changed); in the cancelling process the store
calls its cancel listeners. Either way the :class:`CancelWatch` reads the
marks of the attempts it runs (one primary-key probe each) and cuts those
an operator cancelled: its slot's cancel scope is cancelled, which kills a
command's process group, cancels a callable's scope and drops an HTTP
request; the attempt's fenced finish then records ``cancelled``, or the
success that came first. Without a listener (``listen=False``, a store
that cannot tell, a listener that failed) the watch reads the marks every
:data:`CANCEL_POLL_SECONDS` while attempts run. The watch runs until the
worker's deliveries have stopped, through a shutdown's grace too: a cancel
during shutdown is carried out, not left to the lease.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Final

import anyio

from ..outbox import Claim
from ..outbox.cancel import marked_attempts
from ..store.base import Listener, Store
from .slots import SlotTable

CANCEL_POLL_SECONDS: Final = 0.5
"""How often a worker with no listener reads the cancel marks of the
attempts it runs."""
LOOK_GAP_SECONDS: Final = 0.025
"""The least time between two reads of the marks: SQLite's commit watch
hears every commit (a busy worker's own too), so reads are held to 40 a
second at most whatever a worker commits."""
HEARD_KEEP_SECONDS: Final = 5.0
"""How long a cancel heard by id is remembered for a claim that reaches
the slot table after the cancel was heard (the claim's commit came first,
its slot later)."""


class CancelWatch:
    """Cuts the attempts of one worker's :class:`~.slots.SlotTable` that an
    operator cancels, within a second of the cancel's commit on both
    engines."""

    def __init__(self, db: Store, slots: SlotTable, log: logging.Logger) -> None:
        self._db = db
        self._slots = slots
        self._log = log
        self._look: anyio.Event | None = None
        """Set to look now; made when :meth:`run` starts (in the event loop)."""
        self._heard: dict[str, float] = {}
        """Cancels heard by id, and when (event-loop time)."""
        self._heard_unknown = -math.inf
        """When a cancel of some row (SQLite: any commit) was last heard."""
        self._polling = True
        self.cut = 0
        """Attempts this watch cut."""

    @property
    def polling(self) -> bool:
        """No listener tells this worker of cancels: read the marks every
        :data:`CANCEL_POLL_SECONDS` while attempts run."""
        return self._polling

    @polling.setter
    def polling(self, value: bool) -> None:
        self._polling = value
        self._wake()  # a wait begun under the other mode ends now

    def heard(self, dispatch_id: str | None = None) -> None:
        """A cancel of ``dispatch_id``'s running attempt (None: of some
        row) committed: look (call it in the event loop)."""
        now = anyio.current_time()
        if dispatch_id is None:
            self._heard_unknown = now
        else:
            self._heard[dispatch_id] = now
        self._wake()

    def claimed(self, claims: Sequence[Claim], since: float) -> None:
        """``claims``, made by a write that began at ``since`` (event-loop
        time), have just taken their slots: a cancel heard meanwhile may
        have found them not yet there, so look again."""
        if self._heard_unknown >= since or any(
            claim.dispatch_id in self._heard for claim in claims
        ):
            self._wake()

    def _wake(self) -> None:
        if self._look is not None:
            self._look.set()

    async def run(self) -> None:
        """Look whenever told (or, :attr:`polling`, every
        :data:`CANCEL_POLL_SECONDS`), until cancelled. A read that fails is
        logged and tried at the next look."""
        remove = self._db.on_cancel(self.heard)
        self._look = anyio.Event()
        try:
            while True:
                with anyio.move_on_after(CANCEL_POLL_SECONDS if self.polling else math.inf):
                    await self._look.wait()
                self._look = anyio.Event()
                await self._look_once()
                await anyio.sleep(LOOK_GAP_SECONDS)  # what is heard meanwhile waits its turn
        finally:
            self._look = None
            remove()

    async def _look_once(self) -> None:
        now = anyio.current_time()
        for dispatch_id, at in list(self._heard.items()):
            if now - at > HEARD_KEEP_SECONDS:
                del self._heard[dispatch_id]
        running = list(self._slots)
        if not running:
            return
        try:
            cancelled = await marked_attempts(self._db, running)
        except Exception:
            self._log.warning("reading the cancels of running attempts failed", exc_info=True)
            return
        for claim in cancelled:
            if self._slots.cut_by_cancel(claim):
                self.cut += 1
                self._heard.pop(claim.dispatch_id, None)
                self._log.info(
                    "dispatch %s attempt %d: cancelled by an operator; cutting the attempt",
                    claim.dispatch_id,
                    claim.attempt,
                )


async def listen_to_others(
    db: Listener,
    wake: Callable[[], None],
    cancels: CancelWatch,
    tick_seconds: float,
    log: logging.Logger,
) -> None:
    """Wake on other processes' enqueues and hear their cancels; if
    notifications fail (a pooler, a server restart), poll on the tick (and
    the cancel marks every :data:`CANCEL_POLL_SECONDS`) and try listening
    again. Runs until cancelled."""
    failures = 0
    while True:
        try:
            cancels.polling = False  # the listener looks once it is listening
            await db.listen(wake, on_cancel=cancels.heard)
        except Exception:
            cancels.polling = True
            failures += 1
            log.log(
                logging.WARNING if failures == 1 else logging.DEBUG,
                "cross-process wake-ups unavailable; polling every %gs",
                tick_seconds,
                exc_info=True,
            )
        wake()  # catch up on anything enqueued meanwhile
        await anyio.sleep(tick_seconds)
