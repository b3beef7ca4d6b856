"""Operator actions on every row that matches a filter (docs/dashboard.md,
docs/destinations.md#replay, docs/controls.md#cancel): retry, purge or
cancel by ``status`` and optional ``kind``,
``ordering_key``, ``deliver_to`` and the time each row last changed.

- The dashboard's bulk retry, purge and cancel (:func:`apply_bulk`): at
  most :data:`BULK_LIMIT` rows a request.
- A replay (:func:`retry_dispatches`, ``trio-dispatch retry --deliver-to
  NAME``): every matching ``dead_letter``/``expired`` row, however many.
- A bulk cancel (:func:`cancel_dispatches`, ``trio-dispatch cancel
  --deliver-to NAME``): every matching ``pending``/``delivering`` row, each
  as :func:`~.cancel.cancel_row` cancels one (a running attempt is marked
  for its worker to cut; nothing waits for it).

They walk the matching rows in id order (a cancel newest first: cancelling
a key's rows from its tail, no row of the key is made due only to be
cancelled by the next chunk), :data:`~.operator.PRUNE_CHUNK`
rows per transaction. Each chunk reads the next rows after the last id of
the chunk before it, holds their ordering keys' locks, and puts each row
through the same compare-and-set as the one-row action
(:func:`~.operator.retry_row`, :func:`~.machine.delete`) with its own
transition; a row that changed since its chunk read it is left alone and
counted as skipped. So a key's rows go back in their order, a row one run
retried that fails again while the run goes on is behind the walk (one run
never retries a row twice), and a chunk once committed stays so: an
interrupted replay run again takes up what is left, since the rows it
retried are ``pending`` and match no more.

``since`` and ``until`` compare the row's last change (``updated_at``,
else ``created_at``): for a ``dead_letter`` or ``expired`` row, when it
failed, which is what "failed since 09:00" means. ``since`` is inclusive
and ``until`` exclusive, so consecutive windows never share a row.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping
from functools import partial
from typing import Any, Final, Literal

from ..errors import ActionRefused
from ..lifecycle import Reason, Status
from ..store.base import Conn, Database
from ..times import iso_time
from ..validate import MAX_REASON_LENGTH as MAX_REASON_LENGTH
from ..validate import (
    clock_from,
    require_bool,
    require_int,
    require_number,
    require_reason,
    require_route,
)
from ..values import show
from . import sql
from .cancel import CANCELLABLE, cancel_row
from .machine import delete
from .operator import PRUNE_CHUNK, RETRYABLE, _Keep, retry_row
from .ordering import lock_keys, require_ordering_key

BULK_LIMIT: Final = 10_000
"""Most rows one dashboard bulk action applies to."""
BulkAction = Literal["retry", "purge", "cancel"]
BULK_ACTIONS: Final[tuple[BulkAction, ...]] = ("retry", "purge", "cancel")

Instant = float | int | datetime.datetime
"""A time a filter takes: Unix seconds, or a datetime with a time zone."""


@dataclasses.dataclass(frozen=True)
class Filter:
    """Which rows a bulk action applies to. ``status`` None: every status
    the action is for (``defaults``; a retry's: ``dead_letter`` and
    ``expired``, a cancel's: ``pending`` and ``delivering``).
    ``since``/``until`` (Unix seconds) bound the row's last change,
    ``since <= updated_at < until``."""

    status: Status | None = None
    kind: str | None = None
    ordering_key: str | None = None
    deliver_to: str | None = None
    since: float | None = None
    until: float | None = None
    defaults: tuple[Status, ...] = RETRYABLE

    def terms(self) -> dict[str, Any]:
        """The filter as the keywords :func:`retry_dispatches` and
        :func:`cancel_dispatches` take."""
        return {
            "deliver_to": self.deliver_to,
            "status": self.status,
            "since": self.since,
            "until": self.until,
            "kind": self.kind,
            "ordering_key": self.ordering_key,
        }

    @property
    def statuses(self) -> tuple[Status, ...]:
        return self.defaults if self.status is None else (self.status,)

    def where(self) -> tuple[str, list[Any]]:
        """The ``WHERE`` clause and its parameters. The status and the
        last-change terms are the finished-age index's."""
        clause = f"status IN ({', '.join('?' * len(self.statuses))})"
        params: list[Any] = [str(status) for status in self.statuses]
        for column, value in (
            ("kind", self.kind),
            ("ordering_key", self.ordering_key),
            ("deliver_to", self.deliver_to),
        ):
            if value is not None:
                clause, params = f"{clause} AND {column} = ?", [*params, value]
        if self.since is not None:
            clause, params = f"{clause} AND {sql.AGE} >= ?", [*params, self.since]
        if self.until is not None:
            clause, params = f"{clause} AND {sql.AGE} < ?", [*params, self.until]
        return clause, params

    def fields(self) -> dict[str, str]:
        """As form fields, each present ("" when not set); times in ISO 8601
        UTC to the microsecond, so a form posted back matches the same rows."""
        return {
            "status": "" if self.status is None else str(self.status),
            "deliver_to": self.deliver_to or "",
            "kind": self.kind or "",
            "ordering_key": self.ordering_key or "",
            "since": "" if self.since is None else iso_time(self.since),
            "until": "" if self.until is None else iso_time(self.until),
        }

    def to_dict(self) -> dict[str, Any]:
        """For JSON and a transition's metadata: the statuses as a list,
        times in Unix seconds, unset fields None."""
        return {
            "statuses": [str(status) for status in self.statuses],
            "deliver_to": self.deliver_to,
            "kind": self.kind,
            "ordering_key": self.ordering_key,
            "since": self.since,
            "until": self.until,
        }

    def describe(self) -> str:
        """One line for people: ``status dead_letter or expired, deliver_to
        'billing', changed since 2026-12-02T09:00:00Z``."""
        parts = [f"status {' or '.join(str(status) for status in self.statuses)}"]
        parts += [
            f"{name} {show(value)}"
            for name, value in (
                ("deliver_to", self.deliver_to),
                ("kind", self.kind),
                ("ordering_key", self.ordering_key),
            )
            if value is not None
        ]
        if self.since is not None:
            parts.append(f"changed since {_shown(self.since)}")
        if self.until is not None:
            parts.append(f"changed before {_shown(self.until)}")
        return ", ".join(parts)


def _shown(when: float) -> str:
    return datetime.datetime.fromtimestamp(when, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass(frozen=True)
class BulkResult:
    """What a dashboard bulk action did."""

    action: BulkAction
    matched: int
    """Rows that matched as the walk reached them (at most the limit)."""
    applied: int
    """Rows retried, purged or cancelled (a cancel's: marked ones too)."""
    requested: int = 0
    """A cancel: of :attr:`applied`, the running attempts marked for their
    workers to cut (the rest were cancelled at once)."""

    @property
    def skipped(self) -> int:
        """Matched rows that changed before their turn, left as they were."""
        return self.matched - self.applied

    def to_dict(self) -> dict[str, Any]:
        found = {**dataclasses.asdict(self), "skipped": self.skipped}
        if self.action != "cancel":
            del found["requested"]
        return found


@dataclasses.dataclass(frozen=True)
class CancelManyResult:
    """What :func:`cancel_dispatches` did (or, with ``dry_run``, would do)."""

    matched: int
    """Rows that matched as the walk reached them; with ``dry_run``, the
    rows that match now."""
    cancelled: int
    """Rows ``cancelled`` at once (pending, or running with no worker)."""
    requested: int
    """Running attempts marked: their workers cut them and record
    ``cancelled`` (unless an attempt succeeds first)."""
    dry_run: bool = False

    @property
    def skipped(self) -> int:
        """Matched rows that changed before their turn, left as they were."""
        return 0 if self.dry_run else self.matched - self.cancelled - self.requested

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "skipped": self.skipped}


@dataclasses.dataclass(frozen=True)
class RetryResult:
    """What :func:`retry_dispatches` did (or, with ``dry_run``, would do)."""

    matched: int
    """Rows that matched as the walk reached them; with ``dry_run``, the
    rows that match now."""
    retried: int
    """Rows put back to ``pending`` (0 with ``dry_run``)."""
    dry_run: bool = False

    @property
    def skipped(self) -> int:
        """Matched rows that changed before their turn, left as they were."""
        return 0 if self.dry_run else self.matched - self.retried

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "skipped": self.skipped}


def _instant(name: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"{name} must have a time zone, got {show(value)}")
        return value.timestamp()
    number = require_number(name, value)
    try:
        iso_time(number)
    except (OverflowError, OSError, ValueError):
        raise ValueError(f"{name} is beyond what a calendar holds, got {show(value)}") from None
    return number


def bulk_filter(
    action: object,
    status: object = None,
    kind: object = None,
    ordering_key: object = None,
    *,
    deliver_to: object = None,
    since: object = None,
    until: object = None,
) -> tuple[BulkAction, Filter]:
    """Check a bulk request: ``ValueError`` (``TypeError`` for a value of
    the wrong type) naming a bad value, and
    :class:`~trio_dispatch.errors.ActionRefused` for an action the status
    has no edge for (retry is for ``dead_letter`` and ``expired`` rows,
    cancel for ``pending`` and ``delivering`` ones; ``delivered``/``acked``
    rows may only be purged). A retry without a status takes both
    ``dead_letter`` and ``expired`` rows, a cancel both ``pending`` and
    ``delivering`` ones; a purge needs one. ``since``/``until``: Unix
    seconds or a datetime with a time zone."""
    if action not in BULK_ACTIONS:
        raise ValueError(f"action must be one of {', '.join(BULK_ACTIONS)}, got {show(action)}")
    if status is None and action == "purge":
        raise ValueError("a bulk purge needs a status")
    if status is not None and status not in {str(s) for s in Status}:
        raise ValueError(
            f"status must be one of {', '.join(str(s) for s in Status)}, got {show(status)}"
        )
    chosen = None if status is None else Status(str(status))
    if kind is not None and (not isinstance(kind, str) or not kind):
        raise ValueError(f"kind must be a non-empty string, got {show(kind)}")
    key = require_ordering_key(ordering_key)
    route = None if deliver_to is None else require_route(deliver_to)
    start, end = _instant("since", since), _instant("until", until)
    if start is not None and end is not None and start >= end:
        raise ValueError(
            f"since ({iso_time(start)}) must be before until ({iso_time(end)}): "
            "no row changed in between"
        )
    if action == "purge" and chosen == Status.DELIVERING:
        raise ActionRefused(
            "purge of delivering rows is not allowed: their attempts are running (a "
            "purged head of an ordering key would let the next row go beside it); "
            "purge them once their attempts end"
        )
    if action == "retry" and chosen is not None and chosen not in RETRYABLE:
        raise ActionRefused(
            f"retry of {chosen} rows is not allowed: operator retry is only for "
            "dead_letter or expired dispatches"
        )
    if action == "cancel" and chosen is not None and chosen not in CANCELLABLE:
        raise ActionRefused(
            f"cancel of {chosen} rows is not allowed: only pending or delivering "
            "dispatches can be cancelled"
        )
    defaults = CANCELLABLE if action == "cancel" else RETRYABLE
    return action, Filter(chosen, kind, key, route, start, end, defaults)


def _count(conn: Conn, chosen: Filter, limit: int | None) -> int:
    clause, params = chosen.where()
    if limit is None:
        row = conn.query_one(f"SELECT COUNT(*) AS n FROM dispatch_outbox WHERE {clause}", params)
    else:
        row = conn.query_one(
            f"SELECT COUNT(*) AS n FROM (SELECT 1 FROM dispatch_outbox WHERE {clause} "
            "LIMIT ?) AS matched",
            [*params, limit],
        )
    return int(row["n"]) if row else 0


async def count_matching(db: Database, chosen: Filter, limit: int | None = BULK_LIMIT) -> int:
    """How many rows match (at most ``limit``; None: all): what a
    confirmation or a dry run shows."""
    return await db.read(partial(_count, chosen=chosen, limit=limit))


def _chunk(
    conn: Conn,
    action: BulkAction,
    chosen: Filter,
    after: str | None,
    size: int,
    at: float,
    actor: str,
    metadata: Mapping[str, Any],
    expires_at: float | _Keep | None,
    reason: str | None = None,
) -> tuple[int, int, int, str | None]:
    """One transaction of a walk: the next ``size`` matching rows after id
    ``after`` (a cancel's: before it, newest first), each retried, purged
    or cancelled. Returns (rows read, rows changed, running attempts
    marked, the last id read)."""
    clause, params = chosen.where()
    newest_first = action == "cancel"
    if after is not None:
        clause, params = f"{clause} AND id {'<' if newest_first else '>'} ?", [*params, after]
    rows = conn.query(
        f"SELECT id, status, attempt, kind, ordering_key FROM dispatch_outbox "
        f"WHERE {clause} ORDER BY id{' DESC' if newest_first else ''} LIMIT ?",
        [*params, size],
    )
    lock_keys(conn, [row["ordering_key"] for row in rows])  # all at once, in order
    done = marked = 0
    for row in rows:
        if action == "retry":
            done += retry_row(conn, row, at, actor, expires_at, metadata)
        elif action == "cancel":
            cancelled = cancel_row(conn, row["id"], at, actor, reason, metadata)
            applied = "refused" if cancelled is None else cancelled[0]
            done += applied != "refused"
            marked += applied == "marked"
        else:
            summary = f"purged from {row['status']}"
            done += delete(conn, row, Reason.PURGED_OPERATOR, summary, actor, at, metadata)
    return len(rows), done, marked, str(rows[-1]["id"]) if rows else after


async def _walk(
    db: Database,
    action: BulkAction,
    chosen: Filter,
    *,
    actor: str,
    metadata: Mapping[str, Any] | None,
    now: float | None,
    limit: int | None,
    expires_at: float | _Keep | None = _Keep.KEEP,
    reason: str | None = None,
) -> tuple[int, int, int]:
    """Apply ``action`` to the rows ``chosen`` matches, in id order (a
    cancel: newest first), a chunk a transaction, up to ``limit`` rows
    (None: all). Returns (matched, applied, running attempts marked).
    Cancelled, the chunks committed so far stay committed."""
    clock = clock_from(now)
    note = {"bulk": True, "filter": chosen.to_dict(), **(metadata or {})}
    matched = applied = requested = 0
    after: str | None = None
    while limit is None or matched < limit:
        size = PRUNE_CHUNK if limit is None else min(PRUNE_CHUNK, limit - matched)
        unit = partial(
            _chunk,
            action=action,
            chosen=chosen,
            after=after,
            size=size,
            at=clock(),
            actor=actor,
            metadata=note,
            expires_at=expires_at,
            reason=reason,
        )
        seen, done, marked, after = await db.write(unit)
        matched, applied, requested = matched + seen, applied + done, requested + marked
        if seen < size:
            break
    return matched, applied, requested


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
    """Retry, purge or cancel the rows ``chosen`` matches, oldest id first
    (a cancel: newest first), at most ``limit``; each with its own
    transition (source ``operator``, its metadata ``metadata`` with
    ``bulk`` and the filter)."""
    matched, applied, requested = await _walk(
        db, action, chosen, actor=actor, metadata=metadata, now=now, limit=limit
    )
    return BulkResult(action, matched, applied, requested)


async def _command(
    db: Database,
    action: Literal["retry", "cancel"],
    chosen: Filter,
    dry_run: bool,
    reason: str | None,
    limit: int | None,
    now: float | None,
    actor: str,
    metadata: Mapping[str, Any] | None,
    expires_at: float | _Keep | None = _Keep.KEEP,
) -> tuple[int, int, int]:
    """What :func:`retry_dispatches` and :func:`cancel_dispatches` share:
    their arguments checked before anything is read, then the walk of the
    rows ``chosen`` matches. Returns (matched, applied, running attempts
    marked); with ``dry_run``, (the rows that match now, 0, 0) and nothing
    written."""
    require_bool("dry_run", dry_run)
    why = require_reason(reason)
    if limit is not None:
        limit = require_int("limit", limit, minimum=1)
    if expires_at is not _Keep.KEEP and expires_at is not None:
        expires_at = require_number("expires_at", expires_at)
    clock_from(now)  # checks ``now`` before anything is read
    if dry_run:
        return await count_matching(db, chosen, limit), 0, 0
    if action == "cancel":  # each cancel records the reason as cancel_row does
        return await _walk(
            db, "cancel", chosen, actor=actor, metadata=metadata, now=now, limit=limit, reason=why
        )
    # A retry's reason goes into each transition's metadata.
    note = {**({} if why is None else {"reason": why}), **(metadata or {})}
    return await _walk(
        db, "retry", chosen, actor=actor, metadata=note, now=now, limit=limit, expires_at=expires_at
    )


async def retry_dispatches(
    db: Database,
    *,
    deliver_to: str | None = None,
    status: str | None = None,
    since: Instant | None = None,
    until: Instant | None = None,
    kind: str | None = None,
    ordering_key: str | None = None,
    dry_run: bool = False,
    actor: str = "retry_dispatches",
    reason: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    expires_at: float | _Keep | None = _Keep.KEEP,
    limit: int | None = None,
    now: float | None = None,
) -> RetryResult:
    """Replay (docs/cli.md, "Replay after an outage"): every ``dead_letter`` and ``expired`` row
    (``status``: one of them) that matches the filters goes back to
    ``pending`` -- attempt 0, due now, ``last_error`` cleared, reason
    ``dispatch.pending.operator_retry``, source ``operator`` -- in id
    order, :data:`~.operator.PRUNE_CHUNK` rows a transaction (a keyed row
    behind a live row of its key waits for it, so each key keeps its order).

    ``since``/``until`` (Unix seconds, or a datetime with a time zone)
    bound when each row last changed (``updated_at``: when it failed),
    ``since <= updated_at < until``. ``limit`` stops after that many rows
    (None: all of them). ``dry_run`` counts the matching rows and writes
    nothing. ``reason`` (the operator's why) and ``metadata`` go into each
    transition with the filter. ``expires_at`` (a time, or None for no
    expiry) replaces each row's expiry; by default each keeps its own, so an
    expired row whose deadline has passed expires again at the next scan.

    A bad value raises ``ValueError``/``TypeError`` naming it, and
    ``status`` other than ``dead_letter``/``expired``
    :class:`~trio_dispatch.errors.ActionRefused`, before anything is
    written. Cancelled or failing mid-way, the chunks committed stay
    committed and a second call takes up the rest: a row retried is
    ``pending`` and matches no more, so no row is retried twice. Given a
    transaction handle, every chunk runs inside it."""
    _, chosen = bulk_filter(
        "retry", status, kind, ordering_key, deliver_to=deliver_to, since=since, until=until
    )
    matched, retried, _ = await _command(
        db, "retry", chosen, dry_run, reason, limit, now, actor, metadata, expires_at=expires_at
    )
    return RetryResult(matched, retried, dry_run=dry_run)


async def cancel_dispatches(
    db: Database,
    *,
    deliver_to: str | None = None,
    status: str | None = None,
    since: Instant | None = None,
    until: Instant | None = None,
    kind: str | None = None,
    ordering_key: str | None = None,
    dry_run: bool = False,
    actor: str = "cancel_dispatches",
    reason: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    limit: int | None = None,
    now: float | None = None,
) -> CancelManyResult:
    """Cancel (docs/controls.md) every ``pending`` and ``delivering`` row
    (``status``: one of them) that matches the filters, as
    :func:`~.cancel.cancel_dispatch` cancels one, newest id first,
    :data:`~.operator.PRUNE_CHUNK` rows a transaction: a pending row is
    ``cancelled`` at once, a running attempt is marked for its worker to cut
    (this does not wait for it: :attr:`CancelManyResult.requested`).
    ``since``/``until`` bound when each row last changed, as for
    :func:`retry_dispatches`; ``limit`` stops after that many rows (None:
    all); ``dry_run`` counts the matching rows and writes nothing;
    ``reason`` and ``metadata`` go into each transition with the filter.

    A bad value raises ``ValueError``/``TypeError`` naming it, and
    ``status`` other than ``pending``/``delivering``
    :class:`~trio_dispatch.errors.ActionRefused`, before anything is
    written. Cancelled or failing mid-way, the chunks committed stay
    committed; run again, it takes up the rest (a cancelled row matches no
    more; a marked one is marked again, which changes nothing)."""
    _, chosen = bulk_filter(
        "cancel", status, kind, ordering_key, deliver_to=deliver_to, since=since, until=until
    )
    matched, applied, requested = await _command(
        db, "cancel", chosen, dry_run, reason, limit, now, actor, metadata
    )
    return CancelManyResult(matched, applied - requested, requested, dry_run=dry_run)


__all__ = [
    "BULK_LIMIT",
    "BulkResult",
    "CancelManyResult",
    "Filter",
    "RetryResult",
    "apply_bulk",
    "bulk_filter",
    "cancel_dispatches",
    "count_matching",
    "require_reason",
    "retry_dispatches",
]
