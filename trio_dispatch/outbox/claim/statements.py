"""The claim's reads, as statement builders: every one orders, bounds and
compares rows through :data:`~.order.CLAIM_ORDER`, reads its lanes one
after the other (:func:`in_lanes`), and takes the claim's rules as one SQL
term (``term``: :attr:`~.rules.ClaimRules.term`), so a new rule changes
none of them. Portable SQL (``?`` placeholders); where an engine can say a
read in one statement that SQLite cannot, the engine's
:class:`~trio_dispatch.store.dialect.ArrayForms` spells it. ``index_hint``
is the engine's :attr:`~trio_dispatch.store.dialect.Dialect.index_hint`
(``{}`` for the index's name; empty where the planner chooses): each lane
names the index that holds it. Every row read carries its rank
(:data:`~.order.RANK_COLUMN`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Final

from ...lifecycle import DUE_SQL, Status
from ...priority import earliest_due, first_due
from ...store.dialect import ArrayForms
from ...store.schema import (
    DESTINATION_INDEX,
    DUE_INDEX,
    HELD_BACK_DESTINATION_INDEX,
    HELD_BACK_INDEX,
)
from .order import CLAIM_ORDER, Lane

_ORDER: Final = CLAIM_ORDER.sql
_UP_TO: Final = CLAIM_ORDER.up_to
_RANK: Final = CLAIM_ORDER.selected


def _and(term: str) -> str:
    return f" AND {term}" if term else ""


def _hint(index_hint: str, lane: Lane, lead: str) -> str:
    return index_hint.format(lane.index(lead)) if index_hint else ""


def in_lanes(arm: Callable[[Lane], str], limit: str = "?") -> str:
    """``arm(lane)`` -- an ordered read of one lane with its own ``LIMIT`` --
    for each lane of the claim order, one after the other, at most
    ``limit`` rows in all: one statement that reads a lane only while the
    lanes before it fell short (SQLite runs a compound select's arms in
    turn and PostgreSQL an Append's children, and both stop at the
    ``LIMIT``; a row lock is taken as a row is read, so no row is locked
    past it). The lanes' ranges follow each other in the order, so the rows
    come in claim order. Parameters: those of each arm in turn
    (:meth:`~.order.ClaimOrder.bound`), then ``limit``'s."""
    return (
        " UNION ALL ".join(
            f"SELECT * FROM ({arm(lane)}) AS {lane.name}" for lane in CLAIM_ORDER.lanes
        )
        + f" LIMIT {limit}"
    )


def select_due(
    status: Status, columns: str, lock_clause: str, term: str = "", index_hint: str = ""
) -> str:
    """Due rows of one live status at the time ``?`` (each lane's), in
    claim order, at most ``?`` of them (each lane's, then in all:
    ``CLAIM_ORDER.bound(now, limit) + (limit,)``). The verbatim
    partial-index terms let the planner read each lane's index in order and
    stop after ``LIMIT`` rows: the cost follows the limit, not the table.
    ``term`` (the rules' term) leaves out the rows it does not allow."""

    def arm(lane: Lane) -> str:
        return (
            f"SELECT {columns}, {_RANK} FROM dispatch_outbox{_hint(index_hint, lane, 'status')} "
            f"WHERE {DUE_SQL} AND status = '{status}' AND {lane.term}{_and(term)} "
            f"ORDER BY {_ORDER} LIMIT ?{lock_clause}"
        )

    return in_lanes(arm)


def due_window(columns: str, term: str = "", index_hint: str = "") -> str:
    """:func:`select_due` of each live status (parameters: its own, for
    each), unlocked, in one statement: the ordered ranges of the due
    indexes, one after the other."""
    return " UNION ALL ".join(
        f"SELECT * FROM ({select_due(status, columns, '', term, index_hint)}) AS {status}"
        for status in (Status.PENDING, Status.DELIVERING)
    )


def destination_heads(row_key: str, index_hint: str = "") -> str:
    """The first row due at the time ``?`` (``CLAIM_ORDER.bound(now)``), in
    claim order (``deliver_to``, the order's columns and
    ``next_attempt_at``), of every destination that has a live row: a loose
    scan of the destination index (one seek to the next destination name),
    then one seek to the destination's first due row in each lane until
    one is found, so the cost follows the number of destinations, never
    the rows any of them holds. A destination with no due row is left
    out."""
    table = f"dispatch_outbox{index_hint.format(DESTINATION_INDEX) if index_hint else ''}"

    def arm(lane: Lane) -> str:
        return (
            f"SELECT {row_key} FROM dispatch_outbox{_hint(index_hint, lane, 'deliver_to')} "
            f"WHERE {DUE_SQL} AND deliver_to = destinations.destination AND {lane.term} "
            f"ORDER BY {_ORDER} LIMIT 1"
        )

    return (
        "WITH RECURSIVE destinations(destination) AS ("
        f"SELECT MIN(deliver_to) FROM {table} WHERE {DUE_SQL} "
        "UNION ALL "
        f"SELECT (SELECT MIN(deliver_to) FROM {table} WHERE {DUE_SQL} "
        "AND deliver_to > destinations.destination) "
        "FROM destinations WHERE destinations.destination IS NOT NULL) "
        f"SELECT head.deliver_to, {CLAIM_ORDER.of('head')} "
        f"FROM destinations JOIN dispatch_outbox head ON head.{row_key} = ({in_lanes(arm, '1')})"
    )


@functools.cache
def destination_head(index_hint: str = "") -> str:
    """When one ``deliver_to``'s earliest live row falls due (column ``due``;
    parameter: the destination, five times): bounded reads of the
    destination indexes (:func:`~trio_dispatch.priority.earliest_due`)."""
    hint = index_hint.format
    return earliest_due(
        "deliver_to = ?",
        hint(DESTINATION_INDEX) if index_hint else "",
        hint(HELD_BACK_DESTINATION_INDEX) if index_hint else "",
    )


def oldest_of_destination(index_hint: str = "", term: str = "") -> str:
    """The id of one ``deliver_to``'s first row in claim order that is due
    (and that ``term`` allows), or none: each lane's range of its
    destination index up to its first such row. Parameters:
    ``CLAIM_ORDER.bound(now, head=(destination,))``."""

    def arm(lane: Lane) -> str:
        return (
            f"SELECT id FROM dispatch_outbox{_hint(index_hint, lane, 'deliver_to')} "
            f"WHERE {DUE_SQL} AND deliver_to = ? AND {lane.term}{_and(term)} "
            f"ORDER BY {_ORDER} LIMIT 1"
        )

    return in_lanes(arm, "1")


def due_of_destination(
    columns: str, index_hint: str = "", term: str = "", lock_clause: str = ""
) -> str:
    """The rows of one ``deliver_to`` due at a time and up to a point in
    claim order (:attr:`~.order.ClaimOrder.up_to`), in claim order, at most
    ``?`` of them (locked with ``lock_clause``): each lane's range of its
    destination index. Parameters: ``CLAIM_ORDER.bound(now, *point, most,
    head=(destination,)) + (most,)``."""

    def arm(lane: Lane) -> str:
        return (
            f"SELECT {columns}, {_RANK} "
            f"FROM dispatch_outbox{_hint(index_hint, lane, 'deliver_to')} "
            f"WHERE {DUE_SQL} AND deliver_to = ? AND {lane.term} AND {_UP_TO}{_and(term)} "
            f"ORDER BY {_ORDER} LIMIT ?{lock_clause}"
        )

    return in_lanes(arm)


@functools.cache
def due_of_destinations(
    arrays: ArrayForms, columns: str, term: str = "", lock_clause: str = ""
) -> str:
    """:func:`due_of_destination` for many destinations at once, each one's
    lanes a range of an index of its own, in one statement (the engine's
    :meth:`~trio_dispatch.store.dialect.ArrayForms.each`). Parameters: the
    destinations (an array), the most rows of each (an array, in the same
    order), then ``CLAIM_ORDER.bound(now, *point)``."""

    def arm(lane: Lane) -> str:
        return (
            f"SELECT {columns}, {_RANK} FROM dispatch_outbox WHERE {DUE_SQL} "
            f"AND deliver_to = wanted.destination AND {lane.term} AND {_UP_TO}{_and(term)} "
            f"ORDER BY {_ORDER} LIMIT wanted.most{lock_clause}"
        )

    each = arrays.each(
        "wanted",
        (("destination", "text"), ("most", "int8")),
        in_lanes(arm, "wanted.most"),
        "chosen",
    )
    return f"SELECT chosen.* FROM {each}"


def lock_if_due(columns: str, count: int, lock_clause: str, term: str = "") -> str:
    """``count`` rows by id, those still due at ``?`` (after the ids), locked
    with ``lock_clause``: the rows a scan chose without locking, taken for
    the claim (a row another claimant holds is left out)."""
    return (
        f"SELECT {columns}, {_RANK} FROM dispatch_outbox "
        f"WHERE id IN ({', '.join('?' * count)}) "
        f"AND {DUE_SQL} AND next_attempt_at <= ?{_and(term)}{lock_clause}"
    )


def select_if_due(columns: str, lock_clause: str, term: str = "") -> str:
    """One row by id, if it is due (a live status, ``next_attempt_at <= ?``)."""
    return (
        f"SELECT {columns}, {_RANK} FROM dispatch_outbox WHERE id = ? AND {DUE_SQL} "
        f"AND next_attempt_at <= ?{_and(term)}{lock_clause}"
    )


@functools.cache
def first_due_of_all(index_hint: str = "", term: str = "") -> str:
    """When the first live row in claim order that ``term`` allows falls due,
    of each live status (columns ``pending`` and ``delivering``; NULL:
    none): one seek each. A row due by then is due: the claim reads it
    first. No parameters."""
    main = index_hint.format(DUE_INDEX) if index_hint else ""
    firsts = (
        "(" + first_due(f"status = '{status}'", main, _and(term)) + f") AS {status}"
        for status in (Status.PENDING, Status.DELIVERING)
    )
    return "SELECT " + ", ".join(firsts)


@functools.cache
def next_due(index_hint: str = "", term: str = "") -> str:
    """When the earliest live row that ``term`` allows falls due (column
    ``due``; NULL: there is none): bounded reads of the due indexes for each
    live status (:func:`~trio_dispatch.priority.earliest_due`), a few seeks
    whatever the table holds. No parameters."""
    hint = index_hint.format
    return (
        "SELECT MIN(due) AS due FROM ("
        + " UNION ALL ".join(
            "SELECT * FROM ("
            + earliest_due(
                f"status = '{status}'",
                hint(DUE_INDEX) if index_hint else "",
                hint(HELD_BACK_INDEX) if index_hint else "",
                _and(term),
            )
            + f") AS {status}"
            for status in (Status.PENDING, Status.DELIVERING)
        )
        + ") AS heads"
    )
