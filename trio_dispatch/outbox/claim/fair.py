"""Fair share (docs/destinations.md): when several destinations have due rows, one
claim takes them round-robin by destination -- each one's rows oldest
first -- so a destination with a million-row backlog delays another's next
row by at most one claim.

Round-robin holds across claims too (:class:`Turns`): a worker's claims
are often of one row (a finishing attempt claims the next row for its slot
in its own transaction), and a one-row claim in head order would always
take the backlog's oldest row. So the destinations are served least
recently served first (by the worker's claims: each row claimed is a
turn), in the order of their oldest due row among equals; a claim whose
first rows belong to a destination served within the last round looks at
every destination's head before it takes them.

Not a rule that narrows a claim: how the scan (:mod:`.scan`) chooses among
the rows the rules allow. Pure functions over rows already read, and the
turns a claim's rules keep; the scan decides what to read (the destination
index's heads, then a range of each destination, :func:`quotas` rows at a
time).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Final, TypeVar

from ...store.base import Row
from .rules import Room

T = TypeVar("T")

REMEMBERED: Final = 10_000
"""Destinations :class:`Turns` remembers at most: the least recently served
are forgotten first, and a forgotten destination counts as never served --
first in line, where it was anyway."""


RELOOK_TURNS: Final = 100
"""Turns after which a look that found one destination alone is taken
again, news or not (a default claim's batch)."""


class Turns:
    """The rotation of one claimant's claims: when it last served each
    destination, counted in rows claimed (each row a turn), and how many
    destinations had due rows when it last looked at every head (the round
    a destination waits at most). Decides nothing by itself: the scan
    orders destinations by it (:meth:`order`) and asks it whether its first
    rows need a look at every head (:meth:`recent`). Safe to share between
    threads; lost on restart (a new worker starts a new rotation) and kept
    across rolled-back claims (it only orders, it admits nothing).

    A look that found one destination alone with live rows holds until
    :meth:`news` (a worker calls it on every enqueue notice, its own or
    another process's) or for :data:`RELOOK_TURNS` turns: another
    destination's rows become live by an enqueue, so a one-destination
    backlog's claims do not pay a look each. A row made live without a
    notice (an operator's retry) is seen within that many turns."""

    __slots__ = ("_alone", "_last", "_lock", "_looked_at", "_round", "_turn")

    def __init__(self) -> None:
        self._last: OrderedDict[Hashable, int] = OrderedDict()
        self._lock = threading.Lock()
        self._turn = 0
        self._round = 1
        self._alone: Hashable | None = None
        """The one destination with live rows at the last look, until news."""
        self._looked_at = 0

    def served(self, names: Iterable[Hashable]) -> None:
        """A claim took a row of each of ``names`` (in the order it took
        them: each is a turn)."""
        with self._lock:
            for name in names:
                self._turn += 1
                self._last[name] = self._turn
                self._last.move_to_end(name)
            while len(self._last) > REMEMBERED:
                self._last.popitem(last=False)

    def looked(self, due: int, live: Sequence[Hashable]) -> None:
        """A look at every head found ``due`` destinations with due rows
        (a destination served within that many turns is not due its turn
        yet) among the ``live`` ones (every destination with live rows,
        whatever the claim leaves out)."""
        with self._lock:
            self._round = max(1, due)
            self._alone = live[0] if len(live) == 1 else None
            self._looked_at = self._turn

    def news(self) -> None:
        """Rows may have become live (an enqueue notice): the next claim
        that would look at every head does, even after a look that found
        one destination alone."""
        with self._lock:
            self._alone = None

    def recent(self, names: Iterable[Hashable]) -> bool:
        """Whether any of ``names`` was served within the last round: the
        destinations behind them may be due their turn first (not while
        the last look, a while ago and with no news since, found ``names``
        alone)."""
        listed = list(names)
        with self._lock:
            if self._found_alone(listed):
                return False
            since = self._turn - self._round  # turns count from 1: 0 is never served
            return any(self._last.get(name, 0) > max(0, since) for name in listed)

    def alone(self, names: Iterable[Hashable]) -> bool:
        """Whether the last look, a while ago and with no news since, found
        ``names`` (one destination, however often named) alone with live
        rows: a claim of its rows need not look at every head again."""
        with self._lock:
            return self._found_alone(list(names))

    def _found_alone(self, names: list[Hashable]) -> bool:
        alone = self._alone
        if alone is None or self._turn - self._looked_at >= RELOOK_TURNS:
            return False
        return all(name == alone for name in names)

    def order(self, items: Iterable[T], name: Callable[[T], Hashable]) -> list[T]:
        """``items`` (each of the destination ``name`` gives, in claim
        order) least recently served first; claim order among equals (never
        served counts as longest ago)."""
        listed = list(items)
        with self._lock:
            turns = [self._last.get(name(item), 0) for item in listed]
        # Stable: equal turns keep claim order.
        return [listed[i] for i in sorted(range(len(listed)), key=turns.__getitem__)]


def interleave(
    groups: Iterable[tuple[str, Sequence[Row]]], limit: int, room: Room | None = None
) -> list[Row]:
    """The first ``limit`` rows of ``groups`` (each a destination's rows, in
    claim order; the destinations in the order to serve them) taken
    round-robin, at most ``room`` of each destination."""
    queues = [rows if room is None else rows[: max(0, room(name))] for name, rows in groups]
    chosen: list[Row] = []
    depth = 0
    while len(chosen) < limit:
        turn = [rows[depth] for rows in queues if depth < len(rows)]
        if not turn:
            break
        chosen.extend(turn[: limit - len(chosen)])
        depth += 1
    return chosen


def by_destination(rows: Iterable[Row]) -> list[tuple[str, list[Row]]]:
    """``rows`` (in claim order) grouped by ``deliver_to`` (as read: a name
    not valid UTF-8 keeps its bytes), the destinations in the order of their
    first row."""
    groups: dict[str, list[Row]] = {}
    for row in rows:
        groups.setdefault(row["deliver_to"], []).append(row)
    return list(groups.items())


def quotas(names: Sequence[str], limit: int, room: Room | None) -> dict[str, int]:
    """How many rows of each of ``names`` a fair claim of ``limit`` reads
    first: an equal share, within each one's room."""
    share = math.ceil(limit / len(names)) if names else 0
    return {name: min(share, limit if room is None else room(name)) for name in names}


def topped_up(
    names: Sequence[str],
    got: Mapping[str, int],
    wanted: Mapping[str, int],
    limit: int,
    room: Room | None,
) -> dict[str, int]:
    """After a first read of ``wanted`` rows each gave ``got`` (fewer than
    ``limit`` in all): how many rows to read again of the destinations that
    gave all they were asked (they may hold more), so that the claim can
    still fill ``limit`` from them; empty when none can give more."""
    left = limit - sum(got.values())
    more: dict[str, int] = {}
    for name in names:
        most = limit if room is None else min(limit, room(name))
        if left > 0 and got[name] == wanted[name] and wanted[name] < most:
            more[name] = min(most, wanted[name] + left)
    return more
