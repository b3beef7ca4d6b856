"""The claim's reads, as statement builders: every one orders, bounds and
compares rows through :data:`~.order.CLAIM_ORDER`, and takes the claim's
rules as one SQL term (``term``: :attr:`~.rules.ClaimRules.term`), so a new
rule changes none of them. Portable SQL (``?`` placeholders); where an
engine can say a read in one statement that SQLite cannot, the engine's
:class:`~trio_dispatch.store.dialect.ArrayForms` spells it.
"""

from __future__ import annotations

import functools
from typing import Final

from ...lifecycle import DUE_SQL, Status
from ...store.dialect import ArrayForms
from .order import CLAIM_ORDER

_ORDER: Final = CLAIM_ORDER.sql
_UP_TO: Final = CLAIM_ORDER.up_to


def _and(term: str) -> str:
    return f" AND {term}" if term else ""


def select_due(status: Status, columns: str, lock_clause: str, term: str = "") -> str:
    """Due rows of one live status up to the due time ``?``, in claim
    order, at most ``?`` of them. The verbatim partial-index term lets the
    planner read the due index in order and stop after ``LIMIT`` rows: the
    cost follows the limit, not the table. ``term`` (the rules' term)
    leaves out the rows it does not allow."""
    return (
        f"SELECT {columns} FROM dispatch_outbox WHERE {DUE_SQL} "
        f"AND status = '{status}' AND next_attempt_at <= ?{_and(term)} "
        f"ORDER BY {_ORDER} LIMIT ?{lock_clause}"
    )


def due_window(columns: str, term: str = "") -> str:
    """:func:`select_due` of each live status (parameters: the due time and
    the limit, for each), unlocked, in one statement: two ordered range reads
    of the due index, one after the other."""
    return " UNION ALL ".join(
        f"SELECT * FROM ({select_due(status, columns, '', term)}) AS {status}"
        for status in (Status.PENDING, Status.DELIVERING)
    )


def destination_heads(row_key: str, indexed_by: str = "") -> str:
    """The first row in claim order (``deliver_to`` and the order's
    columns) of every destination that has a live row: a loose scan of the
    destination index (one seek to the next destination name, one to its
    first row), so the cost follows the number of destinations, never the
    rows any of them holds."""
    table = f"dispatch_outbox{indexed_by}"
    return (
        "WITH RECURSIVE destinations(destination) AS ("
        f"SELECT MIN(deliver_to) FROM {table} WHERE {DUE_SQL} "
        "UNION ALL "
        f"SELECT (SELECT MIN(deliver_to) FROM {table} WHERE {DUE_SQL} "
        "AND deliver_to > destinations.destination) "
        "FROM destinations WHERE destinations.destination IS NOT NULL) "
        f"SELECT head.deliver_to, {CLAIM_ORDER.of('head')} "
        f"FROM destinations JOIN dispatch_outbox head ON head.{row_key} = ("
        f"SELECT {row_key} FROM {table} WHERE {DUE_SQL} "
        "AND deliver_to = destinations.destination "
        f"ORDER BY {_ORDER} LIMIT 1)"
    )


def destination_head(indexed_by: str = "") -> str:
    """When one ``deliver_to``'s first live row in claim order falls due
    (column ``due``): one seek of the destination index."""
    return (
        f"SELECT next_attempt_at AS due FROM dispatch_outbox{indexed_by} WHERE {DUE_SQL} "
        f"AND deliver_to = ? ORDER BY {_ORDER} LIMIT 1"
    )


def oldest_of_destination(indexed_by: str = "", term: str = "") -> str:
    """The id of one ``deliver_to``'s first row in claim order that is due
    at the parameter after it (and that ``term`` allows), or none: a range
    of the destination index up to its first such row."""
    return (
        f"SELECT id FROM dispatch_outbox{indexed_by} WHERE {DUE_SQL} AND deliver_to = ? "
        f"AND next_attempt_at <= ?{_and(term)} ORDER BY {_ORDER} LIMIT 1"
    )


def due_of_destination(
    columns: str, indexed_by: str = "", term: str = "", lock_clause: str = ""
) -> str:
    """The live rows of one ``deliver_to`` up to the point in claim order of
    the parameters after it (:attr:`~.order.ClaimOrder.up_to`), in claim
    order, at most ``?`` of them (locked with ``lock_clause``): a range of
    the destination index."""
    return (
        f"SELECT {columns} FROM dispatch_outbox{indexed_by} WHERE {DUE_SQL} AND deliver_to = ? "
        f"AND {_UP_TO}{_and(term)} ORDER BY {_ORDER} LIMIT ?{lock_clause}"
    )


@functools.cache
def due_of_destinations(
    arrays: ArrayForms, columns: str, term: str = "", lock_clause: str = ""
) -> str:
    """:func:`due_of_destination` for many destinations at once, one range
    of the destination index each, in one statement (the engine's
    :meth:`~trio_dispatch.store.dialect.ArrayForms.each`). Parameters: the
    destinations (an array), the most rows of each (an array, in the same
    order), then the bound."""
    each = arrays.each(
        "wanted",
        (("destination", "text"), ("most", "int8")),
        f"SELECT {columns} FROM dispatch_outbox WHERE {DUE_SQL} "
        f"AND deliver_to = wanted.destination AND {_UP_TO}{_and(term)} "
        f"ORDER BY {_ORDER} LIMIT wanted.most{lock_clause}",
        "chosen",
    )
    return f"SELECT chosen.* FROM {each}"


def lock_if_due(columns: str, count: int, lock_clause: str, term: str = "") -> str:
    """``count`` rows by id, those still due at ``?`` (after the ids), locked
    with ``lock_clause``: the rows a scan chose without locking, taken for
    the claim (a row another claimant holds is left out)."""
    return (
        f"SELECT {columns} FROM dispatch_outbox WHERE id IN ({', '.join('?' * count)}) "
        f"AND {DUE_SQL} AND next_attempt_at <= ?{_and(term)}{lock_clause}"
    )


def select_if_due(columns: str, lock_clause: str, term: str = "") -> str:
    """One row by id, if it is due (a live status, ``next_attempt_at <= ?``)."""
    return (
        f"SELECT {columns} FROM dispatch_outbox WHERE id = ? AND {DUE_SQL} "
        f"AND next_attempt_at <= ?{_and(term)}{lock_clause}"
    )


NEXT_DUE: Final = (
    "SELECT MIN(due) AS due FROM ("
    + " UNION ALL ".join(
        f"SELECT MIN(next_attempt_at) AS due FROM dispatch_outbox WHERE {DUE_SQL} "
        f"AND status = '{status}'"
        for status in (Status.PENDING, Status.DELIVERING)
    )
    + ") AS heads"
)
"""When the earliest live row falls due (NULL: none): the first entry of
the due index for each live status, two seeks whatever the table holds."""
