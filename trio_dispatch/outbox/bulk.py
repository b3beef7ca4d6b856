"""Operator actions on every row that matches a filter (SPEC section 15):
retry or purge by ``status`` and optional ``kind`` and ``ordering_key``,
at most :data:`BULK_LIMIT` rows per call.

Each row goes through the same compare-and-set as the one-row action
(:func:`~.operator.retry_row`, :func:`~.machine.delete`) with its own
transition, in transactions of :data:`~.operator.PRUNE_CHUNK` rows; a row
that changed since it was matched is left alone and counted as skipped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from functools import partial
from typing import Any, Final, Literal

from ..errors import ActionRefused
from ..lifecycle import Reason, Status
from ..store.base import Conn, Database, Row
from ..validate import clock_from
from ..values import show
from .machine import delete
from .operator import PRUNE_CHUNK, RETRYABLE, retry_row
from .ordering import lock_keys, require_ordering_key

BULK_LIMIT: Final = 10_000
"""Most rows one bulk action applies to."""
BulkAction = Literal["retry", "purge"]
BULK_ACTIONS: Final[tuple[BulkAction, ...]] = ("retry", "purge")


@dataclasses.dataclass(frozen=True)
class Filter:
    """Which rows a bulk action applies to."""

    status: Status
    kind: str | None = None
    ordering_key: str | None = None

    def where(self) -> tuple[str, list[Any]]:
        """The ``WHERE`` clause and its parameters."""
        clause, params = "status = ?", [str(self.status)]
        if self.kind is not None:
            clause, params = clause + " AND kind = ?", [*params, self.kind]
        if self.ordering_key is not None:
            clause, params = clause + " AND ordering_key = ?", [*params, self.ordering_key]
        return clause, params


@dataclasses.dataclass(frozen=True)
class BulkResult:
    """What a bulk action did."""

    action: BulkAction
    matched: int
    """Rows that matched when the action began (at most the limit)."""
    applied: int
    """Rows retried or purged."""

    @property
    def skipped(self) -> int:
        """Matched rows that changed before their turn, left as they were."""
        return self.matched - self.applied

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "skipped": self.skipped}


def bulk_filter(
    action: object, status: object, kind: object = None, ordering_key: object = None
) -> tuple[BulkAction, Filter]:
    """Check a bulk request: ``ValueError`` naming a bad value, and
    :class:`~trio_dispatch.errors.ActionRefused` for an action the
    status has no edge for (retry is for ``dead_letter`` and ``expired``
    rows; ``delivered``/``acked`` rows may only be purged)."""
    if action not in BULK_ACTIONS:
        raise ValueError(f"action must be one of {', '.join(BULK_ACTIONS)}, got {show(action)}")
    if status not in {str(s) for s in Status}:
        raise ValueError(
            f"status must be one of {', '.join(str(s) for s in Status)}, got {show(status)}"
        )
    chosen = Status(str(status))
    if kind is not None and (not isinstance(kind, str) or not kind):
        raise ValueError(f"kind must be a non-empty string, got {show(kind)}")
    key = require_ordering_key(ordering_key)
    if action == "purge" and chosen == Status.DELIVERING:
        raise ActionRefused(
            "purge of delivering rows is not allowed: their attempts are running (a "
            "purged head of an ordering key would let the next row go beside it); "
            "purge them once their attempts end"
        )
    if action == "retry" and chosen not in RETRYABLE:
        raise ActionRefused(
            f"retry of {chosen} rows is not allowed: operator retry is only for "
            "dead_letter or expired dispatches"
        )
    return action, Filter(chosen, kind, key)


def _matching(conn: Conn, chosen: Filter, limit: int, count: bool) -> list[Row]:
    clause, params = chosen.where()
    if count:
        return conn.query(
            f"SELECT COUNT(*) AS n FROM (SELECT 1 FROM dispatch_outbox WHERE {clause} "
            "LIMIT ?) AS matched",
            [*params, limit],
        )
    return conn.query(
        f"SELECT id, status, attempt, kind, ordering_key FROM dispatch_outbox "
        f"WHERE {clause} ORDER BY id LIMIT ?",
        [*params, limit],
    )


async def count_matching(db: Database, chosen: Filter, limit: int = BULK_LIMIT) -> int:
    """How many rows match (at most ``limit``): what a confirmation shows."""
    rows = await db.read(partial(_matching, chosen=chosen, limit=limit, count=True))
    return int(rows[0]["n"]) if rows else 0


async def apply_bulk(
    db: Database,
    action: BulkAction,
    chosen: Filter,
    *,
    actor: str,
    metadata: Mapping[str, Any] | None = None,
    now: float | None = None,
    limit: int = BULK_LIMIT,
) -> BulkResult:
    """Retry or purge the rows ``chosen`` matches, oldest first, at most
    ``limit``; each with its own transition (source ``operator``)."""
    clock = clock_from(now)
    rows = await db.read(partial(_matching, chosen=chosen, limit=limit, count=False))

    def chunk(conn: Conn, part: list[Row]) -> int:
        at = clock()
        done = 0
        lock_keys(conn, [row["ordering_key"] for row in part])  # all at once, in order
        for row in part:
            if action == "retry":
                done += retry_row(conn, row, at, actor, metadata=metadata)
            else:
                summary = f"purged from {row['status']}"
                done += delete(conn, row, Reason.PURGED_OPERATOR, summary, actor, at, metadata)
        return done

    applied = 0
    for start in range(0, len(rows), PRUNE_CHUNK):
        applied += await db.write(partial(chunk, part=rows[start : start + PRUNE_CHUNK]))
    return BulkResult(action, len(rows), applied)
