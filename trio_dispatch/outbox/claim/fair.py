"""Fair share (SPEC 17): when several destinations have due rows, one
claim takes them round-robin by destination -- the destinations in the
order of their oldest due row, each one's rows oldest first -- so a
destination with a million-row backlog delays another's next row by at
most one claim.

Not a rule that narrows a claim: how the scan (:mod:`.scan`) chooses among
the rows the rules allow. Pure functions over rows already read; the scan
decides what to read (the destination index's heads, then a range of each
destination, :func:`quotas` rows at a time).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from ...store.base import Row
from .rules import Room


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
