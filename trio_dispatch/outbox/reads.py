"""Reads: one dispatch, a filtered list, a history, a health summary. They
run on a read snapshot (never the writer), write nothing, and answer a value
no row can hold (a NUL, a lone surrogate) with "not found" on every engine.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, Final

from ..lifecycle import ENTITY_TYPE, STATUSES, WAITING_AT, Reason, Status
from ..store.base import Conn, Database, Row, Undecodable
from ..store.schema import DUE_INDEX, HELD_BACK_INDEX
from ..validate import clock_from, findable, require_dispatch_id, require_int, require_text
from ..values import show
from . import sql
from .claim import NO_RULES, ClaimRules
from .claim.keys import claimable
from .claim.scan import next_due
from .coalesce import require_coalesce
from .ordering import (
    BLOCKED_KEYS_CAP,
    DEFAULT_ORDERING_POLICY,
    OrderingPolicy,
    ahead_of,
    blocked_heads,
    count_blocked_keys,
    require_ordering_key,
    require_policy,
)

DEFAULT_LIST_LIMIT: Final = 50


def waiting_term(policy: OrderingPolicy, table: str = "dispatch_outbox") -> str:
    """What a row that waits for its ordering key is, as an SQL term on
    ``table``: the one definition every reader uses (``ls``, ``show``,
    ``stats``, the dashboard, ``/metrics``). A pending keyed row waits when
    it carries the waiting mark (:data:`~trio_dispatch.lifecycle.WAITING_AT`:
    a live row of its key is ahead of it) or when the claim's ordering rule
    under ``policy`` refuses it -- under ``block``, the row right behind a
    ``dead_letter`` or ``expired`` head, which promotion made due but no
    claim takes until an operator retries or purges that head. A waiting
    row has no next attempt time and is never counted as due, whatever its
    ``next_attempt_at`` holds."""
    return (
        f"({table}.status = '{Status.PENDING}' AND {table}.ordering_key IS NOT NULL "
        f"AND ({table}.next_attempt_at >= {WAITING_AT!r} OR NOT {claimable(policy, table)}))"
    )


WAITING: Final = {policy: waiting_term(policy) for policy in ("block", "skip")}
""":func:`waiting_term` of each policy on ``dispatch_outbox``."""
_WAITING_CHUNK: Final = 500


async def waiting_ids(
    db: Database,
    rows: Sequence[Mapping[str, Any]],
    ordering: OrderingPolicy = DEFAULT_ORDERING_POLICY,
) -> set[str]:
    """The ids of ``rows`` that wait for their ordering key under the
    ``ordering`` policy (:func:`waiting_term`), as the store holds them
    now: one indexed read per :data:`_WAITING_CHUNK` pending keyed rows,
    none when no row is pending and keyed."""
    ordering = require_policy("ordering", ordering)
    ids = [
        str(row["id"])
        for row in rows
        if row["status"] == Status.PENDING and row.get("ordering_key") is not None
    ]
    if not ids:
        return set()
    term = WAITING[ordering]

    def collect(conn: Conn) -> set[str]:
        found: set[str] = set()
        for start in range(0, len(ids), _WAITING_CHUNK):
            chunk = ids[start : start + _WAITING_CHUNK]
            marks = ", ".join("?" * len(chunk))
            statement = f"SELECT id FROM dispatch_outbox WHERE id IN ({marks}) AND {term}"
            found.update(str(row["id"]) for row in conn.query(statement, tuple(chunk)))
        return found

    return await db.read(collect)


def decode(row: Row | None) -> dict[str, Any] | None:
    """A row with its JSON columns (payload, evidence_refs, metadata)
    decoded; one that does not hold JSON (bytes that are not UTF-8, written
    by something else) stays the text it reads as, so the row can still be
    listed and shown."""
    if row is None:
        return None
    out = dict(row)
    for key in ("payload", "evidence_refs", "metadata"):
        value = out.get(key)
        if isinstance(value, str) and not isinstance(value, Undecodable):
            with contextlib.suppress(ValueError):
                out[key] = json.loads(value)
    return out


def get_row(conn: Conn, dispatch_id: str) -> Row | None:
    return conn.query_one(sql.SELECT_BY_ID, (dispatch_id,))


async def get_dispatch(db: Database, dispatch_id: str) -> dict[str, Any] | None:
    """The dispatch's row (payload decoded), or None."""
    dispatch_id = require_dispatch_id(dispatch_id)
    if not findable(dispatch_id):
        return None
    return decode(await db.read(partial(get_row, dispatch_id=dispatch_id)))


def _filters(
    status: str | None, kind: str | None, ordering_key: str | None, coalesce_key: str | None = None
) -> tuple[list[str], list[object]] | None:
    """The ``?`` terms of a list's filters and their values; None when no
    row can match (a NUL: the same answer on every engine)."""
    if status is not None and status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(sorted(STATUSES))}, got {show(status)}")
    if kind is not None:
        require_text("kind", kind)
        if not findable(kind):
            return None
    ordering_key = require_ordering_key(ordering_key)
    rule = require_coalesce(coalesce_key)
    coalesce_key = None if rule is None else rule.key
    clauses: list[str] = []
    params: list[object] = []
    for column, value in (
        ("status", status),
        ("kind", kind),
        ("ordering_key", ordering_key),
        ("coalesce_key", coalesce_key),
    ):
        if value is not None:
            clauses.append(f"{column} = ?")
            params.append(value)
    return clauses, params


async def list_dispatches(
    db: Database,
    *,
    status: str | None = None,
    limit: int = DEFAULT_LIST_LIMIT,
    kind: str | None = None,
    ordering_key: str | None = None,
    coalesce_key: str | None = None,
) -> list[dict[str, Any]]:
    """Rows newest first, optionally of one ``status`` (one of the six),
    ``kind``, ``ordering_key`` and ``coalesce_key`` (checked as enqueue
    checks them), at most
    ``limit``."""
    limit = require_int("limit", limit, minimum=1)
    found = _filters(status, kind, ordering_key, coalesce_key)
    if found is None:
        return []
    clauses, params = found
    query = sql.list_newest(f"WHERE {' AND '.join(clauses)} " if clauses else "")
    rows = await db.read(lambda conn: conn.query(query, (*params, limit)))
    return [row for row in map(decode, rows) if row is not None]


async def list_transitions(db: Database, dispatch_id: str) -> list[dict[str, Any]]:
    """The dispatch's ``status_transitions`` rows, oldest first (kept after
    the dispatch itself is purged)."""
    dispatch_id = require_dispatch_id(dispatch_id)
    if not findable(dispatch_id):
        return []
    rows = await db.read(
        lambda conn: conn.query(
            "SELECT * FROM status_transitions WHERE entity_type = ? AND entity_id = ? ORDER BY id",
            (ENTITY_TYPE, dispatch_id),
        )
    )
    return [row for row in map(decode, rows) if row is not None]


async def next_due_at(
    db: Database, *, rules: ClaimRules = NO_RULES, now: float | None = None
) -> float | None:
    """When the earliest pending or delivering row that a claim under
    ``rules`` could take falls due, or None: the destinations their bounds
    leave out at ``now`` (default: the wall clock's now) and the rows their
    term holds back do not count."""
    at = clock_from(now)()
    return await db.read(lambda conn: next_due(conn, rules, at=at))


def _oldest_due(conn: Conn, at: float, waiting: str) -> float | None:
    """When the pending row due the longest fell due, among the rows a
    claim could take (``waiting``: the rows waiting for their ordering key,
    left out), or None when none is due at ``at``: bounded reads of the due
    indexes (:func:`~.sql.oldest_due_pending`)."""
    hint = conn.dialect.use_index
    statement = sql.oldest_due_pending(waiting, hint(DUE_INDEX), hint(HELD_BACK_INDEX))
    row = conn.query_one(statement)
    due = None if row is None or row["due"] is None else float(row["due"])
    return due if due is not None and due <= at else None


async def dispatch_stats(
    db: Database,
    *,
    now: float | None = None,
    ordering: OrderingPolicy = DEFAULT_ORDERING_POLICY,
) -> dict[str, Any]:
    """A health summary: ``counts`` per status (every status), ``total``,
    ``oldest_due_pending_age_seconds`` (how long the pending row due the
    longest has been due, among the rows a claim could take: a row waiting
    for its ordering key under the ``ordering`` policy is not one, see
    :func:`waiting_term`; None when none is due) and
    ``dead_letters_last_24h`` (rows now in ``dead_letter`` that got there in
    the last 24 hours; both queries use the status indexes, never a scan of
    finished rows or history)."""
    at = clock_from(now)()
    waiting = WAITING[require_policy("ordering", ordering)]

    def collect(conn: Conn) -> dict[str, Any]:
        counts: dict[str, int] = dict.fromkeys(sorted(STATUSES), 0)
        for row in conn.query(sql.COUNT_BY_STATUS):
            counts[str(row["status"])] = int(row["n"])
        dead = conn.query_one(sql.DEAD_LETTERS_SINCE, (at - 86400.0,))
        due = _oldest_due(conn, at, waiting)
        return {
            "counts": counts,
            "total": sum(counts.values()),
            "oldest_due_pending_age_seconds": None if due is None else max(0.0, at - due),
            "dead_letters_last_24h": int(dead["n"]) if dead else 0,
        }

    return await db.read(collect)


COUNT_CAP: Final = 10_000
"""Status counts for metrics and the dashboard stop at this many (a
bounded query: a scrape costs the same at a million finished rows)."""


async def bounded_stats(
    db: Database,
    *,
    now: float | None = None,
    cap: int = COUNT_CAP,
    ordering: OrderingPolicy = DEFAULT_ORDERING_POLICY,
) -> dict[str, Any]:
    """:func:`dispatch_stats` with bounded queries only: ``counts`` per
    status up to ``cap`` each, ``capped`` (the statuses that reached it:
    their real count is higher), ``oldest_due_pending_age_seconds`` (rows
    waiting for their ordering key under ``ordering`` left out, as there),
    ``dead_letters_last_24h`` (also up to ``cap``), and ``blocked_keys``
    (up to :data:`~.ordering.BLOCKED_KEYS_CAP`, ``blocked_keys_capped`` at
    it; always 0 under the ``skip`` ``ordering`` policy, where no key
    blocks). Every query reads a partial index and stops at its cap."""
    at = clock_from(now)()
    cap = require_int("cap", cap, minimum=1)
    ordering = require_policy("ordering", ordering)

    def collect(conn: Conn) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for status in sorted(STATUSES):
            row = conn.query_one(sql.count_capped(Status(status)), (cap,))
            counts[status] = int(row["n"]) if row else 0
        dead = conn.query_one(sql.DEAD_LETTERS_SINCE_CAPPED, (at - 86400.0, cap))
        due = _oldest_due(conn, at, WAITING[ordering])
        dead_letters = int(dead["n"]) if dead else 0
        blocked = count_blocked_keys(conn, BLOCKED_KEYS_CAP) if ordering == "block" else 0
        return {
            "blocked_keys": blocked,
            "blocked_keys_cap": BLOCKED_KEYS_CAP,
            "blocked_keys_capped": blocked >= BLOCKED_KEYS_CAP,
            "counts": counts,
            "capped": sorted(status for status, n in counts.items() if n >= cap),
            "cap": cap,
            "oldest_due_pending_age_seconds": None if due is None else max(0.0, at - due),
            "dead_letters_last_24h": dead_letters,
            "dead_letters_capped": dead_letters >= cap,
        }

    return await db.read(collect)


async def frequent_kinds(db: Database, *, among: int = COUNT_CAP, limit: int = 50) -> list[str]:
    """The ``limit`` most frequent kinds among the newest ``among`` rows,
    most frequent first (a bounded read)."""
    rows = await db.read(lambda conn: conn.query(sql.RECENT_KINDS, (among, limit)))
    return [str(row["kind"]) for row in rows]


async def list_page(
    db: Database,
    *,
    status: str | None = None,
    kind: str | None = None,
    ordering_key: str | None = None,
    before: tuple[float, str] | None = None,
    limit: int = DEFAULT_LIST_LIMIT,
    coalesce_key: str | None = None,
) -> list[dict[str, Any]]:
    """One page of :func:`list_dispatches`: rows newest first that come
    after ``before`` (the ``(created_at, id)`` of the last row of the
    previous page), at most ``limit``."""
    if before is None:
        return await list_dispatches(
            db,
            status=status,
            kind=kind,
            ordering_key=ordering_key,
            coalesce_key=coalesce_key,
            limit=limit,
        )
    limit = require_int("limit", limit, minimum=1)
    found = _filters(status, kind, ordering_key, coalesce_key)
    if found is None:
        return []
    clauses, params = found
    created, last_id = before
    query = sql.list_page(" AND ".join(clauses))
    rows = await db.read(
        lambda conn: conn.query(query, (*params, created, created, last_id, limit))
    )
    return [row for row in map(decode, rows) if row is not None]


RECENT_FAILURES_LIMIT: Final = 10


async def recent_failures(
    db: Database, *, limit: int = RECENT_FAILURES_LIMIT
) -> list[dict[str, Any]]:
    """The newest ``limit`` attempts that failed -- retried or
    dead-lettered (:data:`~trio_dispatch.lifecycle.FAILURE_REASONS`) --
    newest first: each the transition's ``created_at``, ``id`` (the
    dispatch's), ``status``, ``reason_code``, ``reason_summary`` and the
    dispatch's ``deliver_to`` (None once purged). A bounded read of a
    partial index."""
    limit = require_int("limit", limit, minimum=1)
    rows = await db.read(lambda conn: conn.query(sql.RECENT_FAILURES, (limit,)))
    return [dict(row) for row in rows]


# -- labels and id prefixes for operators ----------------------------------------

AWAITING_ACK: Final = "awaiting ack"
"""The label of a pending row whose last send succeeded and that now waits
for its consumer's ack (and a resend when its backoff ends)."""


def awaiting_ack(row: Mapping[str, Any], last_reason: str | None = None) -> bool:
    """Whether ``row`` waits for an ack: pending, ``ack_required``, sent at
    least once, and its last transition ``dispatch.pending.awaiting_ack``.
    Without ``last_reason`` (see :func:`last_reasons`) the row alone
    decides: a failed send records its error, a successful one clears it."""
    if row["status"] != Status.PENDING or not row["ack_required"] or not row["attempt"]:
        return False
    if last_reason is not None:
        return last_reason == Reason.AWAITING_ACK
    return row.get("last_error") is None


def status_label(row: Mapping[str, Any], last_reason: str | None = None) -> str:
    """What to show as a row's status: :data:`AWAITING_ACK` for a row that
    waits for an ack (:func:`awaiting_ack`), else its status."""
    return AWAITING_ACK if awaiting_ack(row, last_reason) else str(row["status"])


_REASON_CHUNK: Final = 500


async def last_reasons(db: Database, rows: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The newest transition's reason code of each row that could wait for
    an ack (pending, ``ack_required``, sent), by id; one indexed read per
    :data:`_REASON_CHUNK` rows. Pass it to :func:`status_label`."""
    ids = [str(row["id"]) for row in rows if awaiting_ack(row, Reason.AWAITING_ACK)]
    if not ids:
        return {}

    def collect(conn: Conn) -> dict[str, str]:
        found: dict[str, str] = {}
        for start in range(0, len(ids), _REASON_CHUNK):
            chunk = ids[start : start + _REASON_CHUNK]
            for row in conn.query(sql.last_reasons(len(chunk)), (ENTITY_TYPE, *chunk)):
                found[str(row["id"])] = str(row["reason_code"])
        return found

    return await db.read(collect)


async def status_labels(db: Database, rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """:func:`status_label` of each row, from its last transition (one
    bounded read): "awaiting ack" or the row's status."""
    reasons = await last_reasons(db, rows)
    return [status_label(row, reasons.get(str(row["id"]))) for row in rows]


# -- ordering keys for operators ------------------------------------------------


async def waiting_behind(
    db: Database, row: Mapping[str, Any], ordering: OrderingPolicy = DEFAULT_ORDERING_POLICY
) -> dict[str, str] | None:
    """The ``{"id", "status"}`` of the row a live keyed ``row`` waits
    behind under the ``ordering`` policy (its key's first row that still
    counts), or None: unkeyed, finished, or first of its key."""
    key = row.get("ordering_key")
    if key is None or row["status"] not in (Status.PENDING, Status.DELIVERING):
        return None
    dispatch_id = str(row["id"])
    found = await db.read(lambda conn: ahead_of(conn, str(key), dispatch_id, ordering))
    return None if found is None else {"id": str(found["id"]), "status": str(found["status"])}


_SUPERSEDED_BY: Final = (
    "SELECT reason_summary FROM status_transitions WHERE entity_type = ? AND entity_id = ? "
    "AND reason_code = ? ORDER BY id DESC LIMIT 1"
)


async def superseded_by(db: Database, row: Mapping[str, Any]) -> str | None:
    """The id of the row that superseded ``row`` (docs/controls.md: its
    transition names it), or None: not superseded."""
    if row.get("status") != Status.SUPERSEDED:
        return None
    dispatch_id = str(row["id"])
    found = await db.read(
        lambda conn: conn.query_one(_SUPERSEDED_BY, (ENTITY_TYPE, dispatch_id, Reason.COALESCED))
    )
    summary = "" if found is None else str(found["reason_summary"])
    return summary.rsplit(" ", 1)[-1] if summary.startswith("superseded by ") else None


async def list_blocked_heads(
    db: Database,
    *,
    ordering: OrderingPolicy = DEFAULT_ORDERING_POLICY,
    limit: int = DEFAULT_LIST_LIMIT,
    ordering_key: str | None = None,
) -> list[dict[str, Any]]:
    """The whole rows of the heads of blocked keys (of ``ordering_key``
    only, if given), in id order, at most ``limit``: none under the
    ``skip`` policy, where a dead head lets the next row go."""
    limit = require_int("limit", limit, minimum=1)
    key = require_ordering_key(ordering_key)
    if require_policy("ordering", ordering) == "skip":
        return []

    def collect(conn: Conn) -> list[Row]:
        heads = blocked_heads(conn, limit, key)
        rows = (get_row(conn, str(head["id"])) for head in heads)
        return [row for row in rows if row is not None]

    rows = await db.read(collect)
    return [row for row in map(decode, rows) if row is not None]


MIN_ID_PREFIX: Final = 8
"""The shortest id prefix an operator command resolves (UUIDv7 ids made
in the same minute share their first 8 characters anyway)."""
ID_PREFIX_CAP: Final = 1000
"""Matches of a prefix counted at most (an ambiguous prefix is an error)."""
_HEX: Final = re.compile(r"[0-9a-fA-F]+")


def is_id_prefix(text: str) -> bool:
    """Whether ``text`` reads as a shortened dispatch id (hex, shorter than
    an id); whether it is long enough is the caller's question."""
    return len(text) < 32 and _HEX.fullmatch(text) is not None


async def ids_with_prefix(
    db: Database, prefix: str, *, in_history: bool = False, cap: int = ID_PREFIX_CAP
) -> list[str]:
    """The ids of dispatches that start with ``prefix`` (case-insensitive
    hex), in order, at most ``cap``: an indexed range read. With
    ``in_history``, ids in the transition history (purged dispatches
    included) when no dispatch row matches."""
    if _HEX.fullmatch(prefix) is None:
        return []
    low = prefix.lower()
    bounds = (low, low + "g")
    rows = await db.read(lambda conn: conn.query(sql.IDS_IN_RANGE, (*bounds, cap)))
    if not rows and in_history:
        rows = await db.read(
            lambda conn: conn.query(sql.HISTORY_IDS_IN_RANGE, (ENTITY_TYPE, *bounds, cap))
        )
    return [str(row["id"]) for row in rows]


__all__ = [
    "AWAITING_ACK",
    "COUNT_CAP",
    "DEFAULT_LIST_LIMIT",
    "ID_PREFIX_CAP",
    "MIN_ID_PREFIX",
    "RECENT_FAILURES_LIMIT",
    "awaiting_ack",
    "bounded_stats",
    "decode",
    "dispatch_stats",
    "frequent_kinds",
    "get_dispatch",
    "get_row",
    "ids_with_prefix",
    "is_id_prefix",
    "last_reasons",
    "list_blocked_heads",
    "list_dispatches",
    "list_page",
    "list_transitions",
    "next_due_at",
    "recent_failures",
    "status_label",
    "status_labels",
    "waiting_behind",
    "waiting_ids",
    "waiting_term",
]
