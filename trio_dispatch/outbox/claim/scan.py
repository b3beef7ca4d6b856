"""The due scan: which rows a claim reads, in claim order
(:data:`~.order.CLAIM_ORDER`, SPEC B5), under the claim's rules
(:class:`~.rules.ClaimRules`: their term, the destinations they leave out
and each one's room) -- at a cost that follows the claim, not the backlog
of any destination.

With nothing to leave out, the scan is one ordered range read of the due
index per live status that stops after ``limit`` rows. Leaving
destinations out inside that read would step over every row of theirs that
comes first: one capped destination with 200,000 due rows made every scan
read all of them inside the write transaction. So a scan that leaves
destinations out reads a bounded window of the due index first (``limit +
WINDOW_EXTRA`` entries per status, in one statement), which is enough while
their rows are sparse; when the window holds too few rows of the others, it
asks the destination index instead: the first row of every destination (a
loose scan, two seeks per destination), the ``limit`` earliest of those
among the destinations not left out, and from just those destinations their
rows up to the last of those heads, at most their room each. Each of the
first ``limit`` claimable rows lies at or before that point, so it belongs
to one of those destinations: the result is the rows the plain filtered
read would give, in the same order, with ties in claim order broken either
way. The cost follows ``limit``, the window, the caps and the number of
destinations with live rows -- never the rows any one of them holds.

Reads run on a snapshot or inside the claim's write transaction; nothing
here writes. Where rows lock (PostgreSQL), a scan that leaves destinations
out chooses its rows first and then locks just those, skipping a row
another claimant holds, so it never locks rows it will not claim.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Final

from ...lifecycle import WAITING_AT, Status
from ...store.base import Conn, Row
from ...store.schema import DESTINATION_INDEX
from .. import sql
from . import statements
from .order import CLAIM_ORDER
from .rules import NO_RULES, ClaimRules, Room

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
) -> list[Row]:
    """Up to ``limit`` rows due at ``now`` that ``rules`` allow, in claim
    order (SPEC B5), locked where rows lock if ``lock``: rows their term
    refuses and rows of the destinations their bounds leave out are never
    read; where some are left out, each destination's rows past its room
    are left out too, so the limit is spent on rows the claim can take.
    ``columns`` must name the order's columns and, where destinations are
    left out, ``deliver_to`` and ``status`` (and ``id`` to lock). The rows
    read are bounded by ``limit``, the window and the number of
    destinations, whatever the left-out destinations hold."""
    lock_clause = conn.dialect.lock_clause if lock else ""
    term = rules.term
    bounds = rules.bounds(conn, now)
    if not bounds.skip:  # the common claim: one ordered range read per live status
        return _merged(conn, now, limit, columns, lock_clause, term)[:limit]
    left_out = bounds.skip
    room_of = bounds.room or (lambda destination: limit)
    rows = _window(conn, now, limit, columns, left_out, room_of, term)
    if rows is None:
        rows = _by_destination(conn, now, limit, columns, left_out, room_of, term)
    rows = rows[:limit]
    if lock_clause and rows:
        ids = [row["id"] for row in rows]
        rows = conn.query(statements.lock_if_due(columns, len(ids), lock_clause, term), (*ids, now))
        rows.sort(key=_order)
    return rows


def _merged(
    conn: Conn, now: float, limit: int, columns: str, lock_clause: str, term: str = ""
) -> list[Row]:
    """Up to ``limit`` due rows of each live status, merged in claim order:
    one ordered range read of the due index per status (the index holds the
    status first, so one read cannot give both in order)."""
    rows = [
        row
        for status in (Status.PENDING, Status.DELIVERING)
        for row in conn.query(
            statements.select_due(status, columns, lock_clause, term), (now, limit)
        )
    ]
    rows.sort(key=_order)
    return rows


def _window(
    conn: Conn,
    now: float,
    limit: int,
    columns: str,
    left_out: frozenset[str],
    room: Room,
    term: str = "",
) -> list[Row] | None:
    """The first ``limit`` rows not left out (nor past their destination's
    room), read from a window of ``limit + WINDOW_EXTRA`` due-index entries
    per status; None when the window holds fewer than ``limit`` of them and
    more rows lie beyond it."""
    size = limit + WINDOW_EXTRA
    rows = conn.query(statements.due_window(columns, term), (now, size, now, size))
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
    if complete_to is not None and len(wanted) < limit:
        return None
    return wanted


def _heads(conn: Conn, now: float, left_out: frozenset[str]) -> list[Row]:
    """The first row (``deliver_to`` and the order's columns) of each
    destination not left out whose first row is due at ``now``, in claim
    order: a loose scan of the destination index."""
    indexed_by = conn.dialect.use_index(DESTINATION_INDEX)
    heads = [
        head
        for head in conn.query(statements.destination_heads(conn.dialect.row_key, indexed_by))
        if head["deliver_to"] not in left_out and head["next_attempt_at"] <= now
    ]
    heads.sort(key=_order)
    return heads


def _by_destination(
    conn: Conn,
    now: float,
    limit: int,
    columns: str,
    left_out: frozenset[str],
    room: Room,
    term: str = "",
) -> list[Row]:
    """The first ``limit`` due rows not left out, through the destination
    index: the heads of all destinations, then ranges of the ``limit``
    destinations with the earliest heads, each at most its room."""
    heads = [head for head in _heads(conn, now, left_out) if room(str(head["deliver_to"])) > 0][
        :limit
    ]
    if not heads:
        return []
    # With ``limit`` heads, the first ``limit`` claimable rows lie at or
    # before the last of them; with fewer, every due row of theirs may count.
    up_to: Sequence[Any] = (
        CLAIM_ORDER.place(heads[-1]) if len(heads) == limit else CLAIM_ORDER.after_due(now)
    )
    names = [str(head["deliver_to"]) for head in heads]
    most = [min(limit, room(name)) for name in names]
    arrays = conn.dialect.arrays
    if arrays is not None:  # every range in one statement
        rows = conn.query(
            statements.due_of_destinations(arrays, columns, term), (names, most, *up_to)
        )
    else:
        indexed_by = conn.dialect.use_index(DESTINATION_INDEX)
        statement = statements.due_of_destination(columns, indexed_by, term)
        rows = [
            row
            for name, n in zip(names, most, strict=True)
            for row in conn.query(statement, (name, *up_to, n))
        ]
    rows.sort(key=_order)
    return rows[:limit]


def next_due(conn: Conn, rules: ClaimRules = NO_RULES, *, at: float) -> float | None:
    """When the earliest live row that ``rules`` allow falls due (None:
    there is none), their bounds taken at ``at``. Bounded as
    :func:`select_due` is: the earliest head of a destination not left out
    is the answer when the window holds none of theirs. A row the rules'
    term holds back does not count; a row waiting behind its key's head
    never does."""
    term = rules.term
    skip = rules.bounds(conn, at).skip
    if not skip and not term:
        row = conn.query_one(statements.NEXT_DUE)
        due = None if row is None or row["due"] is None else float(row["due"])
    else:
        columns = "id, status, next_attempt_at, created_at, deliver_to, ordering_key"
        found = (
            _merged(conn, NO_LIMIT, 1, columns, "", term)
            if not skip
            else _window(conn, NO_LIMIT, 1, columns, skip, lambda d: 1, term)
        )
        if found is None:
            # As select_due: the destination index, with the term applied to
            # the earliest destinations' rows (a head the term holds back
            # must not read as due, or the worker would scan without pause).
            found = _by_destination(conn, NO_LIMIT, WINDOW_EXTRA, columns, skip, lambda d: 1, term)
        due = float(found[0]["next_attempt_at"]) if found else None
    return None if due is None or due >= WAITING_AT else due
