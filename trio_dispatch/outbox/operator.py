"""What operators and consumers do to a dispatch (docs/usage.md, docs/cli.md):
acknowledge it, retry a failed one, purge one, prune finished ones by age.
Each change is a compare-and-set of :mod:`.machine` with its transition row
(purges included: history says who removed a row and when: docs/lifecycle.md).
"""

from __future__ import annotations

import enum
import hmac
from collections.abc import Iterable, Mapping
from functools import partial
from typing import Any, Final

from ..errors import AckRefused, DispatchNotFound
from ..lifecycle import (
    DUE_SQL,
    ORDERED_SQL,
    TERMINAL_STATUSES,
    WAITING_AT,
    InvalidTransition,
    Reason,
    Source,
    Status,
    check_edge,
)
from ..store.base import Conn, Database, Row
from ..validate import clock_from, findable, require_bool, require_dispatch_id, require_number
from ..values import show
from . import sql
from .machine import cas_status, delete
from .reads import get_row

PRUNE_CHUNK: Final = 500
"""Rows deleted per prune transaction, so other writers never wait long."""
DEFAULT_RETENTION_SECONDS: Final[Mapping[str, float]] = {
    Status.DELIVERED: 7 * 86400.0,
    Status.ACKED: 7 * 86400.0,
    Status.DEAD_LETTER: 30 * 86400.0,
    Status.EXPIRED: 30 * 86400.0,
    Status.SUPERSEDED: 7 * 86400.0,
    Status.CANCELLED: 30 * 86400.0,
}
"""docs/operations.md#pruning: how long finished rows are kept by default."""
RETRYABLE: Final = (Status.DEAD_LETTER, Status.EXPIRED)

_DUE_OR_WAITING: Final = (
    # A retried keyed row with a live row of its key ahead of it waits
    # behind that row, as an enqueued one would: due now, a replay of a
    # key's many rows would leave them all at the front of the due index,
    # where every claim reads past them (the claim rule refuses them), so
    # only the first would be due. The probe reads the ordering index only.
    "CASE WHEN dispatch_outbox.ordering_key IS NOT NULL AND EXISTS (SELECT 1 FROM "
    "dispatch_outbox k WHERE k.ordering_key = dispatch_outbox.ordering_key "
    f"AND k.ordering_key IS NOT NULL AND k.{ORDERED_SQL} AND k.{DUE_SQL} "
    "AND (k.key_seq, k.id) < (dispatch_outbox.key_seq, dispatch_outbox.id)) "
    "THEN ? ELSE ? END"
)


async def ack_dispatch(
    db: Database,
    dispatch_id: str,
    ack_token: str,
    *,
    now: float | None = None,
    actor: str = "ack_dispatch",
) -> bool:
    """Acknowledge a dispatch with its token; True if it moved to ``acked``.

    Raises :class:`DispatchNotFound` (a ``LookupError``) if the row does not
    exist, :class:`AckRefused` (a ``ValueError``) if it did not ask for
    acknowledgement, has no token, or the token does not match (compared in
    constant time), and :class:`InvalidTransition` if its status has no edge
    to ``acked`` (delivered, acked, dead_letter, expired).
    Returns False if the row's status changed between the read and the write.
    """
    dispatch_id = require_dispatch_id(dispatch_id)
    if not findable(dispatch_id):
        raise DispatchNotFound(dispatch_id)
    clock = clock_from(now)
    row = await db.read(partial(get_row, dispatch_id=dispatch_id))
    if row is None:
        raise DispatchNotFound(dispatch_id)
    if not row["ack_required"]:
        raise AckRefused(f"dispatch {dispatch_id!r} did not request acknowledgement")
    if not isinstance(ack_token, str):
        raise TypeError(f"ack_token must be a str, got {show(ack_token)}")
    stored = row["ack_token"]
    if not isinstance(stored, str) or not stored:
        # Never compare against a stand-in ("None"): no token, no ack.
        raise AckRefused(f"dispatch {dispatch_id!r} has no ack token: it cannot be acknowledged")
    given = ack_token.encode("utf-8", "surrogatepass")
    if not hmac.compare_digest(given, stored.encode("utf-8")):
        raise AckRefused(f"ack token does not match dispatch {dispatch_id!r}")
    # Checked here too, so a refused ack never enters (and rolls back) a
    # group commit shared with other callers; the write checks it again.
    check_edge(dispatch_id, row["status"], Status.ACKED, source=Source.CONSUMER)
    return await db.write(
        lambda conn: cas_status(
            conn,
            row,
            Status.ACKED,
            Reason.CONSUMER_ACK,
            f"acknowledged after attempt {row['attempt']}",
            source=Source.CONSUMER,
            actor=actor,
            now=clock(),
        )
    )


class _Keep(enum.Enum):
    KEEP = "keep"


async def retry_dispatch(
    db: Database,
    dispatch_id: str,
    *,
    now: float | None = None,
    actor: str = "retry_dispatch",
    expires_at: float | _Keep | None = _Keep.KEEP,
    metadata: Mapping[str, Any] | None = None,
) -> bool:
    """Operator retry of a ``dead_letter`` or ``expired`` dispatch: back to
    ``pending`` with ``attempt = 0`` (and no throttled attempts), due now,
    ``last_error`` cleared.

    Returns False if the row does not exist or its status changed
    concurrently; raises :class:`InvalidTransition` for any other status.
    ``expires_at`` (a time, or None for no expiry) replaces the row's expiry;
    by default it is kept, so retrying an expired row whose deadline is
    still past sends it nowhere: the next scan expires it again.
    ``metadata`` goes into the transition (who asked, from where).
    """
    dispatch_id = require_dispatch_id(dispatch_id)
    if not findable(dispatch_id):
        return False
    clock = clock_from(now)
    if expires_at is not _Keep.KEEP and expires_at is not None:
        require_number("expires_at", expires_at)
    row = await db.read(partial(get_row, dispatch_id=dispatch_id))
    if row is None:
        return False
    if row["status"] not in RETRYABLE:
        raise InvalidTransition(
            dispatch_id,
            row["status"],
            Status.PENDING,
            "operator retry is only for dead_letter or expired dispatches",
        )

    def retry(conn: Conn) -> bool:
        return retry_row(conn, row, clock(), actor, expires_at, metadata)

    return await db.write(retry)


def retry_row(
    conn: Conn,
    row: Row,
    now: float,
    actor: str,
    expires_at: float | _Keep | None = _Keep.KEEP,
    metadata: Mapping[str, Any] | None = None,
) -> bool:
    """Operator retry of one ``dead_letter``/``expired`` row read with
    ``status``, ``attempt`` and ``ordering_key``: back to ``pending``, due
    now, inside the caller's transaction. False if it changed meanwhile.
    A keyed row behind a live row of its key waits for it (its
    ``next_attempt_at`` the waiting mark) and is made due when that row
    leaves, as an enqueued row would."""
    # The throttled attempts go with the attempts they were part of.
    assignments = (
        f", attempt = 0, throttles = 0, next_attempt_at = {_DUE_OR_WAITING}, last_error = NULL"
    )
    params: list[float | None] = [WAITING_AT, now]
    if expires_at is not _Keep.KEEP:
        assignments += ", expires_at = ?"
        params.append(expires_at)
    return cas_status(
        conn,
        row,
        Status.PENDING,
        Reason.OPERATOR_RETRY,
        f"operator retry from {row['status']} after attempt {row['attempt']}",
        source=Source.OPERATOR,
        actor=actor,
        now=now,
        assignments=assignments,
        params=params,
        metadata=metadata,
    )


async def purge_dispatch(
    db: Database,
    dispatch_id: str,
    *,
    now: float | None = None,
    actor: str = "purge_dispatch",
    metadata: Mapping[str, Any] | None = None,
) -> bool:
    """Delete one dispatch and record a ``dispatch.purged.operator``
    transition (with ``metadata``) in the same transaction. Returns whether
    a row was deleted. Its transition history is kept. A ``delivering`` row
    whose lease has not ended is refused with
    :class:`~trio_dispatch.lifecycle.InvalidTransition` (its attempt is
    running: were it deleted, the next row of its ordering key could be sent
    beside it); once the attempt ends, or its lease runs out, it can go."""
    dispatch_id = require_dispatch_id(dispatch_id)
    if not findable(dispatch_id):
        return False
    clock = clock_from(now)

    def purge(conn: Conn) -> bool:
        row = conn.query_one(sql.SELECT_FOR_REMOVAL, (dispatch_id,))
        if row is None:
            return False
        at = clock()
        # A delivering row's next_attempt_at is its lease's end.
        if row["status"] == Status.DELIVERING and float(row["next_attempt_at"] or 0) > at:
            raise InvalidTransition(
                dispatch_id,
                Status.DELIVERING,
                "purged",
                "its attempt is running; purge it once the attempt ends "
                f"(its lease ends in {float(row['next_attempt_at']) - at:.0f}s)",
            )
        return delete(
            conn,
            row,
            Reason.PURGED_OPERATOR,
            f"purged from {row['status']}",
            actor,
            at,
            metadata,
        )

    return await db.write(purge)


def _prune_statuses(statuses: Iterable[str] | None) -> list[Status]:
    if statuses is None:
        return sorted(TERMINAL_STATUSES)
    if isinstance(statuses, str):
        raise TypeError(f"statuses must be a list of statuses, got {show(statuses)}")
    chosen = sorted(set(statuses))
    for status in chosen:
        if status not in TERMINAL_STATUSES:
            raise ValueError(
                f"prune can only remove finished dispatches "
                f"({', '.join(sorted(TERMINAL_STATUSES))}), got {show(status)}"
            )
    return [Status(status) for status in chosen]


async def prune_dispatches(
    db: Database,
    *,
    older_than: float | None = None,
    statuses: Iterable[str] | None = None,
    now: float | None = None,
    dry_run: bool = False,
    actor: str = "prune_dispatches",
) -> int:
    """Retention: delete finished dispatches whose ``updated_at`` (else
    ``created_at``) is more than ``older_than`` seconds old, recording a
    ``dispatch.purged.retention`` transition for each; return how many were
    (or, with ``dry_run``, would be) deleted.

    ``older_than=None`` applies the per-status defaults (delivered/acked 7
    days, dead_letter/expired 30 days). ``statuses`` defaults to those four
    terminal statuses and may not name a live one: pending and delivering
    rows are never pruned. Deletes run in short transactions of at most
    :data:`PRUNE_CHUNK` rows, so other writers are never blocked for long.
    Then the schedule runs no dispatch refers to any more go too, except
    each schedule's newest run.
    """
    clock = clock_from(now)
    if older_than is not None:
        older_than = require_number("older_than", older_than, minimum=0.0)
    chosen = _prune_statuses(statuses)
    require_bool("dry_run", dry_run)
    at = clock()
    cutoffs = {
        status: at - (DEFAULT_RETENTION_SECONDS[status] if older_than is None else older_than)
        for status in chosen
    }
    if dry_run:

        def count(conn: Conn) -> int:
            total = 0
            for status, cutoff in cutoffs.items():
                row = conn.query_one(sql.finished_older_than(status, count=True), (cutoff,))
                total += int(row["n"]) if row else 0
            return total

        return await db.read(count)

    def prune_chunk(conn: Conn) -> int:
        removed = 0
        for status, cutoff in cutoffs.items():
            rows = conn.query(sql.finished_older_than(status), (cutoff, PRUNE_CHUNK - removed))
            for row in rows:
                removed += delete(
                    conn,
                    row,
                    Reason.PURGED_RETENTION,
                    f"retention: {status} older than cutoff",
                    actor,
                    at,
                )
            if removed >= PRUNE_CHUNK:
                break
        return removed

    total = 0
    while True:
        removed = await db.write(prune_chunk)
        total += removed
        if removed < PRUNE_CHUNK:
            break
    while await db.write(_prune_runs) >= PRUNE_CHUNK:
        pass
    return total


def _prune_runs(conn: Conn) -> int:
    # A schedule's runs that no dispatch refers to any more, except its
    # newest (docs/schedules.md); runs a service wrote itself are not ours.
    return conn.execute(sql.PRUNE_SCHEDULE_RUNS, (PRUNE_CHUNK,))


__all__ = [
    "DEFAULT_RETENTION_SECONDS",
    "PRUNE_CHUNK",
    "ack_dispatch",
    "prune_dispatches",
    "purge_dispatch",
    "retry_dispatch",
]
