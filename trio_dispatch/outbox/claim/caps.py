"""Per-destination concurrency in one worker (``per_destination_concurrency``):
at most ``limit`` attempts to one ``deliver_to`` at once in one worker, so
a slow destination cannot hold every slot while rows for the others wait
(docs/webhooks.md). A claim rule (:class:`~.rules.ClaimRule`).

The caps are read and changed where claims are made: inside the claim's
unit of work, which the store runs one at a time on its writer thread. A
claim leaves out destinations already at their cap (:meth:`~DestinationCaps.bounds`:
in SQL, so it does not spend its limit on rows it cannot take, and through
the destination index, so their backlog costs it nothing: :mod:`.scan`) and
takes at most the room left for each of the rest
(:meth:`~DestinationCaps.admit`); a finishing attempt gives its place back
in the same unit that claims its slot's next row. The worker also gives a
place back when an attempt ends any other way (both are idempotent). A hold
that outlives its lease -- a claim whose transaction failed after it was
counted -- stops counting when that lease ends, so an error can only make
the cap stricter for a while, never looser.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ...store.base import Conn, Row
from ...validate import require_int
from .rules import Bounds, Claiming, ClaimRule

if TYPE_CHECKING:
    from ..transitions import Claim


class DestinationCaps(ClaimRule):
    """The attempts each destination has running in this worker, against
    ``limit``. Equal only to itself: one worker's caps."""

    def __init__(self, limit: int) -> None:
        self.limit = require_int("per_destination_concurrency", limit, minimum=1)
        self._lock = threading.Lock()
        # (dispatch id, lease end) -> deliver_to: an attempt is its row and its
        # lease, so a row claimed again at once is a new hold, not the old one.
        self._held: dict[tuple[str, float], str] = {}

    def _counts(self, now: float) -> dict[str, int]:
        counts: dict[str, int] = {}
        for key, destination in list(self._held.items()):
            if key[1] > now:
                counts[destination] = counts.get(destination, 0) + 1
            else:  # its lease is over: whatever happened, it no longer runs here
                del self._held[key]
        return counts

    def full(self, now: float) -> list[str]:
        """The destinations at their cap: a claim leaves their rows out."""
        with self._lock:
            return sorted(name for name, n in self._counts(now).items() if n >= self.limit)

    def room(self, now: float) -> Callable[[str], int]:
        """How many more attempts each destination may start now (a
        snapshot: the holds taken or dropped after it do not change it)."""
        with self._lock:
            counts = self._counts(now)
        return lambda destination: max(0, self.limit - counts.get(destination, 0))

    def fit(self, rows: Sequence[Any], now: float) -> list[Any]:
        """The rows (in order, each with a ``deliver_to``) that fit under
        the caps together with what is running."""
        with self._lock:
            counts = self._counts(now)
        chosen = []
        for row in rows:
            destination = row["deliver_to"]
            if counts.get(destination, 0) < self.limit:
                counts[destination] = counts.get(destination, 0) + 1
                chosen.append(row)
        return chosen

    def hold(self, dispatch_id: str, destination: str, lease_until: float) -> None:
        """Count a claimed attempt until :meth:`drop` or its lease end."""
        with self._lock:
            self._held[(dispatch_id, lease_until)] = destination

    def drop(self, attempts: Iterable[tuple[str, float]]) -> None:
        """Stop counting these attempts -- ``(dispatch id, lease end)`` of
        their claims -- ended, released, or never sent."""
        with self._lock:
            for attempt in attempts:
                self._held.pop(attempt, None)

    def running(self, now: float) -> dict[str, int]:
        """Attempts running per destination (for statistics and tests)."""
        with self._lock:
            return self._counts(now)

    # -- as a claim rule ------------------------------------------------------------

    def bounds(self, conn: Conn, at: float) -> Bounds:
        """The destinations at their cap left out; the room of the others."""
        with self._lock:
            counts = self._counts(at)
        full = frozenset(name for name, n in counts.items() if n >= self.limit)
        return Bounds(full, lambda destination: max(0, self.limit - counts.get(destination, 0)))

    def admit(self, conn: Conn, rows: list[Row], claiming: Claiming) -> list[Row]:
        """:meth:`fit`."""
        return self.fit(rows, claiming.at)

    def claimed(self, conn: Conn, claims: Sequence[Claim], claiming: Claiming) -> None:
        """:meth:`hold` each claim until it ends or its lease does."""
        for claim in claims:
            self.hold(claim.dispatch_id, claim.deliver_to, claim.lease_until)

    def ended(self, attempts: Iterable[tuple[str, float]]) -> None:
        """:meth:`drop`."""
        self.drop(attempts)
