"""The due scan: which rows a claim reads, in claim order
(:data:`~.order.CLAIM_ORDER`, docs/controls.md), under the claim's rules
(:class:`~.rules.ClaimRules`: their term, the destinations they leave out
and each one's room), shared fairly between destinations (:mod:`.fair`)
-- at a cost that follows the claim, not the backlog of any destination.

With nothing to leave out, the scan is one ordered range read of the due
index per live status that stops after ``limit`` rows (each read, like
every read here, the claim order's lanes one after the other in one
statement: :mod:`.order`). When those reads
hold every due row, the claim shares them round-robin by destination.
When more lie beyond (a backlog), a loose scan of the destination index
(two seeks per destination with live rows) finds which destinations have
due rows: with one, the rows read are the claim; with several, the claim
reads an equal share of each one's range of the destination index (topped
up once from those that hold more) and takes them round-robin, so no
destination's backlog holds back another's next row for more than one
claim. Where the claimant keeps turns (:class:`~.fair.Turns`: a worker
does), the destinations are served least recently served first, and a
claim whose first rows are of a destination served within the last round
looks at every head too: a worker's one-row claims (one per finishing
attempt) take turns between destinations instead of always taking the
backlog's oldest row.

Leaving destinations out inside the due index's read would step over every
row of theirs that comes first: one capped destination with 200,000 due
rows made every scan read all of them inside the write transaction. So a
scan that leaves destinations out reads a bounded window of the due index
first (``limit + WINDOW_EXTRA`` entries per status, in one statement),
which holds every due row while there are few; otherwise it turns to the
destination index as above (the heads of the destinations not left out,
then a share of each one's range). The cost follows ``limit``, the window,
the rooms and the number of destinations with live rows -- never the rows
any one of them holds. Unshared (``fair=False``), the scan gives the rows
the plain filtered read would, in the same order: the ``limit`` earliest
heads bound the ranges it reads.

Reads run on a snapshot or inside the claim's write transaction; nothing
here writes. Where rows lock (PostgreSQL), the due index's read locks as it
reads (``FOR UPDATE SKIP LOCKED``), a destination's share is locked as it is
read (a row another claimant holds is passed over, and the rows this claim
locked fill in for it), and rows chosen from the unlocked window are locked
just before they are returned: a claim never waits for another's rows.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from operator import itemgetter
from typing import Any, Final

from ...lifecycle import WAITING_AT, Status
from ...store.base import Conn, Row
from .. import sql
from . import statements
from .fair import Turns, by_destination, interleave, quotas, topped_up
from .order import CLAIM_ORDER
from .rules import NO_RULES, Bounds, ClaimRules, Room

WINDOW_EXTRA: Final = 32
"""Due-index entries a scan that leaves destinations out reads beyond its
``limit`` before it turns to the destination index."""

NO_LIMIT: Final = math.inf
"""A due time past every row: ``select_due(conn, NO_LIMIT, ...)`` reads rows
whenever they fall due."""


_order: Final = CLAIM_ORDER.key


def select_due(
    conn: Conn,
    now: float,
    limit: int,
    columns: str = sql.COLUMNS,
    *,
    lock: bool = False,
    rules: ClaimRules = NO_RULES,
    bounds: Bounds | None = None,
    fair: bool = True,
) -> list[Row]:
    """Up to ``limit`` rows due at ``now`` that ``rules`` allow, locked
    where rows lock if ``lock``: rows their term refuses and rows of the
    destinations their bounds (``bounds``, if the caller read them already)
    leave out are never read, and where the read bounds each destination it
    takes at most its room. With ``fair``, the rows are shared round-robin
    by destination (:mod:`.fair`), each destination's oldest first, the
    destinations least recently served first where ``rules`` keep turns
    (:attr:`~.rules.ClaimRules.turns`); without,
    they are the first ``limit`` in claim order. ``columns`` must name the
    order's columns, ``deliver_to`` and ``status`` (and ``id`` to lock). The
    rows read are bounded by ``limit``, the window and the number of
    destinations, whatever any destination holds."""
    lock_clause = conn.dialect.lock_clause if lock else ""
    term = rules.term
    if bounds is None:
        bounds = rules.bounds(conn, now)
    room = bounds.room
    turns = rules.turns if fair else None
    if not bounds.skip:  # the common claim: one ordered range read per live status
        rows, upto = _merged(conn, now, limit, columns, lock_clause, term)
        if not fair:
            return rows[:limit]
        if upto is None:  # every due row is here: share them
            return interleave(_in_turn(by_destination(rows), turns), limit, room)
        first = _first_round(rows, limit, upto)
        if first is not None and not _turn_due(first, turns):
            return first  # as many destinations' heads as the claim takes
        alone = turns is not None and turns.alone(row["deliver_to"] for row in rows)
        heads = [] if alone else _heads(conn, now, frozenset(), room, turns)
        if len(heads) <= 1:  # one destination's backlog: the rows read are its oldest
            return interleave(by_destination(rows), limit, room)
        # Read locked where rows lock: a row another claimant holds is
        # skipped, and the rows this read locked fill what that leaves.
        shared = _fair(conn, now, limit, columns, heads, room, term, lock_clause)
        return _filled(shared, rows, limit, room)
    room_of = room or (lambda destination: limit)
    wanted, complete = _window(conn, now, limit, columns, bounds.skip, room_of, term)
    if complete:
        chosen = (
            interleave(_in_turn(by_destination(wanted), turns), limit) if fair else wanted[:limit]
        )
    elif (
        fair and (first := _first_round(wanted, limit)) is not None and not _turn_due(first, turns)
    ):
        chosen = first
    elif fair:
        heads = _heads(conn, now, bounds.skip, room_of, turns)
        shared = _fair(conn, now, limit, columns, heads, room_of, term, lock_clause)
        if len(shared) >= limit or not lock_clause:
            return shared
        # Others hold some of the rows chosen: the window's rows fill in.
        held = {row["id"] for row in shared}
        more = _locked(
            conn, [r for r in wanted if r["id"] not in held], now, columns, term, lock_clause
        )
        return _filled(shared, more, limit, room_of)
    elif len(wanted) >= limit:
        chosen = wanted[:limit]
    else:
        chosen = _by_destination(conn, now, limit, columns, bounds.skip, room_of, term)
    return _locked(conn, chosen, now, columns, term, lock_clause)


def _in_turn(
    groups: list[tuple[str, list[Row]]], turns: Turns | None
) -> list[tuple[str, list[Row]]]:
    """Destinations' rows (in the order of their oldest) least recently
    served first, where the claimant keeps turns."""
    return groups if turns is None else turns.order(groups, itemgetter(0))


def _turn_due(first: Sequence[Row], turns: Turns | None) -> bool:
    """Whether a destination of the first round (``first``, the oldest
    heads) was served within the last round: another destination, its head
    further on, may be due its turn first -- so the claim looks at every
    head."""
    return turns is not None and turns.recent(row["deliver_to"] for row in first)


def _first_round(rows: Sequence[Row], limit: int, upto: Any = None) -> list[Row] | None:
    """The first row of each of the first ``limit`` destinations of
    ``rows`` (in claim order; every due row up to ``upto`` among them, all
    with None), if that many destinations have rows up to there: their
    heads, the oldest of every destination's, are the fair share's whole
    first round of ``limit`` -- no destination beyond has an older head, so
    no loose scan of the destination index is needed. None otherwise."""
    seen: set[Any] = set()
    heads: list[Row] = []
    for row in rows:
        if upto is not None and _order(row) > upto:
            break
        if row["deliver_to"] not in seen:
            seen.add(row["deliver_to"])
            heads.append(row)
            if len(heads) == limit:
                return heads
    return None


def _locked(
    conn: Conn, chosen: list[Row], now: float, columns: str, term: str, lock_clause: str
) -> list[Row]:
    """``chosen`` (read unlocked), those still due locked where rows lock --
    one another claimant holds is left out -- in the order chosen."""
    if not lock_clause or not chosen:
        return chosen
    place = {row["id"]: index for index, row in enumerate(chosen)}
    ids = list(place)
    locked = conn.query(statements.lock_if_due(columns, len(ids), lock_clause, term), (*ids, now))
    locked.sort(key=lambda row: place[row["id"]])
    return locked


def _filled(chosen: list[Row], more: Sequence[Row], limit: int, room: Room | None) -> list[Row]:
    """``chosen``, then the rows of ``more`` (in claim order) it lacks, each
    destination within its room, up to ``limit``."""
    if len(chosen) >= limit:
        return chosen[:limit]
    held = {row["id"] for row in chosen}
    taken = Counter(row["deliver_to"] for row in chosen)
    filled = list(chosen)
    for row in more:
        if len(filled) >= limit:
            break
        name = row["deliver_to"]
        if row["id"] in held or (room is not None and taken[name] >= room(name)):
            continue
        taken[name] += 1
        filled.append(row)
    return filled


def _merged(
    conn: Conn, now: float, limit: int, columns: str, lock_clause: str, term: str = ""
) -> tuple[list[Row], Any]:
    """Up to ``limit`` due rows of each live status, merged in claim order:
    one ordered range read of the due index per status (the index holds the
    status first, so one read cannot give both in order); and the point in
    claim order up to which they are every due row (None: they are all)."""
    rows: list[Row] = []
    upto: Any = None
    hint = conn.dialect.index_hint
    for status in (Status.PENDING, Status.DELIVERING):
        statement = statements.select_due(status, columns, lock_clause, term, hint)
        found = conn.query(statement, (*CLAIM_ORDER.bound(now, limit), limit))
        if len(found) == limit:  # more may lie beyond the last one read
            last = _order(found[-1])
            upto = last if upto is None else min(upto, last)
        rows += found
    rows.sort(key=_order)
    return rows, upto


def _window(
    conn: Conn,
    now: float,
    limit: int,
    columns: str,
    left_out: frozenset[str],
    room: Room,
    term: str = "",
) -> tuple[list[Row], bool]:
    """The rows not left out (nor past their destination's room), in claim
    order, from a window of ``limit + WINDOW_EXTRA`` due-index entries per
    status; and whether the window held every due row (else the rows are
    those up to the point where it still held every one)."""
    size = limit + WINDOW_EXTRA
    each = (*CLAIM_ORDER.bound(now, size), size)
    rows = conn.query(statements.due_window(columns, term, conn.dialect.index_hint), each * 2)
    complete_to: tuple[Any, Any] | None = None  # every due row up to here is in the window
    for status in (Status.PENDING, Status.DELIVERING):
        read = [_order(row) for row in rows if row["status"] == status]
        if len(read) == size:
            complete_to = max(read) if complete_to is None else min(complete_to, max(read))
    rows.sort(key=_order)
    taken: dict[str, int] = {}
    wanted = []
    for row in rows:
        if complete_to is not None and _order(row) > complete_to:
            break
        destination = row["deliver_to"]
        if destination in left_out or taken.get(destination, 0) >= room(destination):
            continue
        taken[destination] = taken.get(destination, 0) + 1
        wanted.append(row)
    return wanted, complete_to is None


def _heads(
    conn: Conn,
    now: float,
    left_out: frozenset[str],
    room: Room | None = None,
    turns: Turns | None = None,
) -> list[Row]:
    """The first row (``deliver_to`` and the order's columns) of each
    destination not left out (and with room) whose first row is due at
    ``now``, in claim order -- least recently served first where the
    claimant keeps ``turns`` (which hear how many there are): a loose scan
    of the destination index."""
    statement = statements.destination_heads(conn.dialect.row_key, conn.dialect.index_hint)
    live = conn.query(statement, CLAIM_ORDER.bound(now))
    heads = [
        head
        for head in live
        if head["deliver_to"] not in left_out
        and head["next_attempt_at"] <= now
        and (room is None or room(str(head["deliver_to"])) > 0)
    ]
    heads.sort(key=_order)
    if turns is None:
        return heads
    turns.looked(len(heads), [head["deliver_to"] for head in live])
    return turns.order(heads, itemgetter("deliver_to"))


def _ranges(
    conn: Conn,
    now: float,
    names: Sequence[str],
    most: Sequence[int],
    up_to: Sequence[Any],
    columns: str,
    term: str,
    lock_clause: str = "",
) -> list[Row]:
    """The first ``most`` rows of each of ``names`` due at ``now`` up to
    the point ``up_to`` in claim order, each a range of the destination
    indexes (locked with ``lock_clause``: a row another claimant holds is
    passed over): one statement where the engine says it
    (:meth:`ArrayForms.each`), one per destination elsewhere."""
    arrays = conn.dialect.arrays
    if arrays is not None:  # every range in one statement
        statement = statements.due_of_destinations(arrays, columns, term, lock_clause)
        return conn.query(statement, (list(names), list(most), *CLAIM_ORDER.bound(now, *up_to)))
    hint = conn.dialect.index_hint
    statement = statements.due_of_destination(columns, hint, term, lock_clause)
    return [
        row
        for name, n in zip(names, most, strict=True)
        if n > 0
        for row in conn.query(statement, (*CLAIM_ORDER.bound(now, *up_to, n, head=(name,)), n))
    ]


def _by_destination(
    conn: Conn,
    now: float,
    limit: int,
    columns: str,
    left_out: frozenset[str],
    room: Room,
    term: str = "",
) -> list[Row]:
    """The first ``limit`` due rows not left out, in claim order, through
    the destination index: the heads of all destinations, then ranges of
    the ``limit`` destinations with the earliest heads, each at most its
    room."""
    heads = _heads(conn, now, left_out, room)[:limit]
    if not heads:
        return []
    # With ``limit`` heads, the first ``limit`` claimable rows lie at or
    # before the last of them; with fewer, every due row of theirs may count.
    up_to: Sequence[Any] = (
        CLAIM_ORDER.place(heads[-1]) if len(heads) == limit else CLAIM_ORDER.after_due(now)
    )
    names = [str(head["deliver_to"]) for head in heads]
    wanted = [min(limit, room(name)) for name in names]
    rows = _ranges(conn, now, names, wanted, up_to, columns, term)
    rows.sort(key=_order)
    return rows[:limit]


def _fair(
    conn: Conn,
    now: float,
    limit: int,
    columns: str,
    heads: Sequence[Row],
    room: Room | None,
    term: str = "",
    lock_clause: str = "",
) -> list[Row]:
    """``limit`` due rows shared round-robin among the destinations of
    ``heads`` (in the order to serve them; the first ``limit`` of them,
    since a round takes one row of each): an equal share of each one's range first, then
    once more from those that held all they were asked while the claim is
    not full; locked as read with ``lock_clause``."""
    names = [head["deliver_to"] for head in heads[:limit]]
    if not names:
        return []
    up_to = CLAIM_ORDER.after_due(now)
    wanted = quotas(names, limit, room)
    first = _ranges(conn, now, names, [wanted[n] for n in names], up_to, columns, term, lock_clause)
    groups = by_destination(first)
    got = {name: 0 for name in names} | {name: len(rows) for name, rows in groups}
    more = topped_up(names, got, wanted, limit, room) if sum(got.values()) < limit else {}
    if more:
        again = [name for name in names if name in more]
        read = _ranges(
            conn, now, again, [more[n] for n in again], up_to, columns, term, lock_clause
        )
        groups = [(n, rows) for n, rows in groups if n not in more] + by_destination(read)
    found = dict(groups)
    return interleave(((name, found.get(name, [])) for name in names), limit, room)


def next_due(conn: Conn, rules: ClaimRules = NO_RULES, *, at: float) -> float | None:
    """When the earliest live row that ``rules`` allow falls due (None:
    there is none), their bounds taken at ``at``: a row of a left-out
    destination counts from when its destination is lifted, where the rules
    know when (:attr:`~.rules.Bounds.lifts`). Bounded as :func:`select_due`
    is: with destinations left out, the earliest due of the rows the
    window (or the heads of the destinations not left out) holds. A row
    the rules' term holds back does not count; a row waiting behind its
    key's head never does. The claim order is not the due order (a head
    start ranks a row before rows due sooner), so the answer is read from
    the rows near the front of the order (:func:`~trio_dispatch.priority.earliest_due`):
    it may come later than the earliest due time when thousands of rows
    with head starts crowd the front, never sooner (a wake-up with nothing
    due asks again)."""
    term = rules.term
    bounds = rules.bounds(conn, at)
    skip = bounds.skip
    hint = conn.dialect.index_hint
    due: float | None
    if not skip:
        # The first row in claim order, of each status: one seek each. Due
        # by ``at``, it is what a claim takes next, and the worker scans at
        # once; only otherwise is the earliest due time read (its windows
        # read up to thousands of entries where head starts crowd the front).
        first = conn.query_one(statements.first_due_of_all(hint, term)) or {}
        due = min((float(v) for v in first.values() if v is not None), default=None)
        if due is None or due > at:
            row = conn.query_one(statements.next_due(hint, term))
            due = None if row is None or row["due"] is None else float(row["due"])
    else:
        columns = "id, status, next_attempt_at, created_at, deliver_to, ordering_key"
        room = lambda destination: WINDOW_EXTRA  # noqa: E731 -- every row the window holds counts
        found, complete = _window(conn, NO_LIMIT, 1, columns, skip, room, term)
        if not found and not complete:
            # As select_due: the destination index, with the term applied
            # to the earliest destinations' rows (a head the term holds
            # back must not read as due, or the worker would scan without
            # pause).
            found = _by_destination(conn, NO_LIMIT, WINDOW_EXTRA, columns, skip, room, term)
        due = min((float(row["next_attempt_at"]) for row in found), default=None)
    if due is not None and due >= WAITING_AT:
        due = None
    for name, lifted in bounds.lifts.items():
        if name not in skip:
            continue
        head = conn.query_one(statements.destination_head(hint), (name,) * 5)
        if head is not None and head["due"] is not None and float(head["due"]) < WAITING_AT:
            when = max(lifted, float(head["due"]))
            due = when if due is None else min(due, when)
    return due
