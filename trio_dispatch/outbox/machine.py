"""The state machine: the one module that writes a dispatch's status.

Every function here is a unit of work (or part of one): it runs inside one
transaction on the store's thread, never awaits, and writes a status change
together with its ``status_transitions`` row, so both commit or neither
does. Each change goes through :func:`transition_rows`, which checks its
edge against the closed graph of :mod:`trio_dispatch.lifecycle` before the
statement that makes it runs -- an edge outside the graph raises
:class:`~trio_dispatch.lifecycle.InvalidTransition` and nothing is written.

Every change that ends an attempt is fenced on the claim it ends: status
``delivering``, its attempt and its lease end. A claimant whose lease another
worker recovered can never overwrite the newer attempt (SPEC B4).

Nothing else in the package writes ``dispatch_outbox.status``; the modules
around this one validate, schedule and call transports.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, NamedTuple

from ..attempt import LAST_ERROR_LIMIT, Delivery, TransportResult
from ..errors import StoreError
from ..lifecycle import (
    ACTOR_ENQUEUE,
    ENTITY_TYPE,
    PURGED,
    REASON_CODES,
    Reason,
    Source,
    Status,
    check_edge,
)
from ..redact import scrubbed_logger, visible
from ..store.base import Conn, Row, undecodable_columns
from . import sql
from .caps import DestinationCaps
from .scan import select_due

log = scrubbed_logger("trio_dispatch.outbox")

MAX_RETRY_AFTER_SECONDS: Final = 86400.0
"""The longest a destination's ``Retry-After`` may delay the next attempt."""

COUNTER_KEYS: Final = ("attempted", "delivered", "dead_letter", "expired", "retried")
"""The counters of a delivery pass (ADR D4/D5 meanings)."""


class EnqueueResult(NamedTuple):
    """One enqueue's outcome: the row's id, and whether an existing row with
    the same dedup key answered instead of a new one."""

    id: str
    dedup_hit: bool


@dataclasses.dataclass(frozen=True)
class NewDispatch:
    """A validated enqueue: the row to insert, id, token and envelope made."""

    id: str
    kind: str
    deliver_to: str
    payload: str
    dedup_key: str | None
    max_attempts: int
    ack_required: bool
    ack_token: str | None
    session_id: str | None
    schedule_run_id: str | None
    expires_at: float | None

    @property
    def plain(self) -> bool:
        """No dedup key and no provenance link: nothing to look up first."""
        return self.dedup_key is None and self.session_id is None and (self.schedule_run_id is None)


@dataclasses.dataclass(frozen=True)
class Claim:
    """One attempt of one dispatch, owned by this process until it finishes
    or its lease (``lease_until``, wall-clock seconds) runs out."""

    dispatch_id: str
    kind: str
    deliver_to: str
    payload: str
    attempt: int
    max_attempts: int
    ack_required: bool
    lease_until: float
    ack_token: str | None = dataclasses.field(default=None, repr=False)
    """Kept to mask it in failure texts: a destination that echoes its input
    must not put the token into ``last_error``, history or a log line."""
    recovered: bool = False
    """The row was ``delivering`` under an earlier claim whose lease ran out."""

    def delivery(self) -> Delivery:
        return Delivery(
            dispatch_id=self.dispatch_id,
            kind=self.kind,
            deliver_to=self.deliver_to,
            attempt=self.attempt,
            payload=self.payload,
        )


class Outcome(enum.Enum):
    """What ending an attempt did to its row."""

    DELIVERED = "delivered"
    AWAITING_ACK = "awaiting_ack"
    RETRY = "retry"
    DEAD_LETTER = "dead_letter"
    ACK_TIMEOUT = "ack_timeout"
    RELEASED = "released"
    """Worker shutdown interrupted the attempt, or a local resource error
    kept it from being made: back to pending, due now."""
    CONFLICT = "conflict"
    """The row was no longer (delivering, this attempt): nothing written."""


# -- transitions -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Change:
    """One status change and the transition row that records it."""

    dispatch_id: str
    previous: str | None
    """The status it had (None: the row is new)."""
    status: str
    """The status it gets, or :data:`~trio_dispatch.lifecycle.PURGED`."""
    reason: Reason
    summary: str
    source: Source
    actor: str
    now: float
    metadata: Mapping[str, Any] | str | None = None
    """A mapping, or already JSON text."""


def _check(change: Change) -> None:
    if change.reason not in REASON_CODES:  # a programming error, never user input
        raise AssertionError(f"unknown reason code {change.reason!r}")
    if change.previous is None:
        if (change.status, change.reason) != (Status.PENDING, Reason.ENQUEUED):
            raise AssertionError(f"a new row starts pending, not {change.status!r}")
    elif change.status == PURGED:
        if change.source is not Source.OPERATOR:
            raise AssertionError("only an operator (or retention) removes a row")
    else:
        check_edge(change.dispatch_id, change.previous, change.status, source=change.source)


def transition_rows(changes: Sequence[Change]) -> list[tuple[Any, ...]]:
    """The :data:`~.sql.INSERT_TRANSITION` parameters of ``changes``, each
    change's edge checked first (raises before anything is written)."""
    rows = []
    for change in changes:
        _check(change)
        metadata = change.metadata
        if not isinstance(metadata, str):
            metadata = json.dumps(dict(metadata or {}))
        rows.append(
            (
                ENTITY_TYPE,
                change.dispatch_id,
                change.previous,
                change.status,
                change.reason,
                change.summary,
                change.source,
                change.actor,
                "[]",
                metadata,
                change.now,
            )
        )
    return rows


def insert_rows(conn: Conn, rows: Sequence[tuple[Any, ...]]) -> None:
    """Insert transition rows built (and checked) by :func:`transition_rows`."""
    if len(rows) == 1:
        conn.execute(sql.INSERT_TRANSITION, rows[0])
    elif rows and conn.dialect.arrays:  # PostgreSQL: one statement, an array per column
        *texts, created = (list(column) for column in zip(*rows, strict=True))
        # An array holds one type: a caller's clock may give ints among floats.
        conn.execute(sql.INSERT_TRANSITIONS_ARRAYS, [*texts, [float(t) for t in created]])
    elif rows:
        conn.executemany(sql.INSERT_TRANSITION, rows)


def record(conn: Conn, changes: Sequence[Change]) -> None:
    """Check and insert the transition rows of changes being made."""
    insert_rows(conn, transition_rows(changes))


def _enqueued(new: NewDispatch, now: float) -> Change:
    return Change(
        new.id,
        None,
        Status.PENDING,
        Reason.ENQUEUED,
        f"enqueued kind={new.kind}",
        Source.SYSTEM,
        ACTOR_ENQUEUE,
        now,
        "{}",
    )


# -- enqueue ---------------------------------------------------------------------


def _row(new: NewDispatch, now: float) -> tuple[Any, ...]:
    return (
        new.id,
        new.kind,
        new.deliver_to,
        new.payload,
        new.dedup_key,
        new.max_attempts,
        now,
        int(new.ack_required),
        new.ack_token,
        new.session_id,
        new.schedule_run_id,
        now,
        new.expires_at,
        now,
    )


def insert_new(conn: Conn, new: NewDispatch, now: float) -> EnqueueResult:
    """Insert one dispatch and its ``dispatch.pending.enqueued`` transition,
    or -- its dedup key already committed -- return that row's id and write
    nothing. An unknown ``session_id``/``schedule_run_id`` is a ValueError
    naming it."""
    for column, value, table, exists in (
        ("session_id", new.session_id, "sessions", sql.SESSION_EXISTS),
        ("schedule_run_id", new.schedule_run_id, "schedule_runs", sql.SCHEDULE_RUN_EXISTS),
    ):
        if value is not None and conn.query_one(exists, (value,)) is None:
            raise ValueError(f"{column} {value!r} does not exist in {table}")
    # The insert comes first: a key already committed makes it do nothing
    # (and the first row's id is read after), so the write lock -- or, on
    # PostgreSQL, the wait for a concurrent same-key transaction -- comes
    # before any read, and a read never sees a snapshot older than the
    # winner (B3).
    if conn.dialect.arrays:  # row, history and NOTIFY in one round trip
        entity_type, _, *history = transition_rows([_enqueued(new, now)])[0]
        inserted = (
            conn.query_one(sql.INSERT_DISPATCH_RECORDED, (*_row(new, now), entity_type, *history))
            is not None
        )
    else:
        inserted = conn.execute(sql.INSERT_DISPATCH, _row(new, now)) != 0
        if inserted:
            record(conn, [_enqueued(new, now)])
            conn.announce_enqueue()
    if inserted:
        return EnqueueResult(new.id, False)
    winner = conn.query_one(sql.SELECT_BY_DEDUP_KEY, (new.dedup_key,))
    if winner is None:
        raise StoreError(f"dedup_key {new.dedup_key!r} conflicted but no row holds it")
    return EnqueueResult(_text(winner["id"]), True)


def _text(value: object) -> str:
    # A caller's own sqlite3 connection may return text as bytes.
    return value.decode() if isinstance(value, bytes) else str(value)


def insert_plain(conn: Conn, items: Sequence[tuple[NewDispatch, float]]) -> list[EnqueueResult]:
    """Insert plain dispatches (see :attr:`NewDispatch.plain`), each at its
    own ``now``, with two bulk statements; coalesced, this serves every
    concurrent plain enqueue of a group commit at once. On an engine with
    data-modifying ``WITH`` it is one statement per row instead, sent in
    one pipelined round trip (the server delivers the repeated ``NOTIFY``
    of one transaction once)."""
    if conn.dialect.arrays:
        rows = [
            (*_row(new, now), entity_type, *history)
            for (new, now), (entity_type, _, *history) in zip(
                items, transition_rows([_enqueued(new, now) for new, now in items]), strict=True
            )
        ]
        if len(rows) == 1:
            conn.execute(sql.INSERT_DISPATCH_RECORDED, rows[0])
        else:
            conn.executemany(sql.INSERT_DISPATCH_RECORDED, rows)
        return [EnqueueResult(new.id, False) for new, _ in items]
    conn.executemany(sql.INSERT_DISPATCH, [_row(new, now) for new, now in items])
    record(conn, [_enqueued(new, now) for new, now in items])
    conn.announce_enqueue()
    return [EnqueueResult(new.id, False) for new, _ in items]


def insert_all(
    conn: Conn, batch: Sequence[NewDispatch], now: float, name_items: bool = False
) -> list[EnqueueResult]:
    """Insert a batch: plain rows with two bulk statements, the others one
    by one (a key repeated within the batch resolves to its first row, in
    order). With ``name_items``, an error (an unknown session, say) names
    its item."""

    def one(index: int, new: NewDispatch) -> EnqueueResult:
        try:
            return insert_new(conn, new, now)
        except ValueError as exc:
            if not name_items:
                raise
            raise ValueError(f"item {index}: {exc}") from None

    plain = [new for new in batch if new.plain]
    if len(plain) < 2:
        return [one(index, new) for index, new in enumerate(batch)]
    done = {result.id: result for result in insert_plain(conn, [(new, now) for new in plain])}
    return [done[new.id] if new.id in done else one(index, new) for index, new in enumerate(batch)]


# -- claims ----------------------------------------------------------------------


def expire(conn: Conn, row: Row, now: float, actor: str) -> bool:
    """A due row past ``expires_at`` becomes ``expired`` (guarded on the
    status and attempt it was read with)."""
    change = Change(
        row["id"],
        row["status"],
        Status.EXPIRED,
        Reason.DEADLINE,
        f"expires_at {row['expires_at']} passed before attempt {row['attempt'] + 1}",
        Source.SCHEDULER,
        actor,
        now,
        {"expires_at": row["expires_at"], "attempt": row["attempt"]},
    )
    history = transition_rows([change])
    changed = conn.execute(sql.EXPIRE, (now, row["id"], row["status"], row["attempt"], now))
    if changed:
        insert_rows(conn, history)
    return bool(changed)


def spend(conn: Conn, row: Row, now: float, actor: str) -> bool:
    """A delivering row whose lease ran out during its last allowed attempt
    is dead-lettered instead of sent again (``max_attempts`` bounds every
    send)."""
    attempt = row["attempt"]
    change = Change(
        row["id"],
        Status.DELIVERING,
        Status.DEAD_LETTER,
        Reason.MAX_ATTEMPTS,
        f"lease expired during attempt {attempt} of {row['max_attempts']}",
        Source.SCHEDULER,
        actor,
        now,
        {"attempt": attempt},
    )
    history = transition_rows([change])
    changed = conn.execute(
        sql.SPEND, (now, "lease expired during the last attempt", row["id"], attempt, now)
    )
    if changed:
        insert_rows(conn, history)
    return bool(changed)


_SCAN_COLUMNS: Final = (
    "id, {row_key} AS row_key, status, attempt, max_attempts, expires_at, next_attempt_at, "
    "created_at, deliver_to"
)


def claim_batch(
    conn: Conn,
    at: float,
    limit: int,
    lease: float,
    actor: str,
    *,
    ids: Sequence[str] | None = None,
    caps: DestinationCaps | None = None,
) -> tuple[list[Claim], dict[str, int]]:
    """The claim: one indexed select of up to ``limit`` due rows (locked
    where rows lock) -- or, given ``ids``, those rows if they are still due
    -- then in the same transaction expire those past their deadline,
    dead-letter spent ones, and claim the rest with one statement per
    previous status, each leased until ``at + lease``. Returns the claims
    in scan order and the scan's counters (``attempted``, ``expired``,
    ``dead_letter``; the others 0). With ``caps``, destinations at their
    cap are left out and no more rows are claimed for one destination than
    its cap has room for; the claims are counted against it."""
    counts = dict.fromkeys(COUNTER_KEYS, 0)
    columns = _SCAN_COLUMNS.format(row_key=conn.dialect.row_key)
    if ids is None:
        # Bounded whatever the capped destinations hold (see .scan).
        skip = caps.full(at) if caps is not None else ()
        room = caps.room(at) if caps is not None else None
        rows = select_due(conn, at, limit, columns, lock=True, skip=skip, room=room)
    else:
        rows = [
            row
            for dispatch_id in ids[:limit]
            for row in conn.query(
                sql.select_if_due(columns, conn.dialect.lock_clause), (dispatch_id, at)
            )
        ]
    counts["attempted"] = len(rows)
    fresh: dict[Status, list[Row]] = {Status.PENDING: [], Status.DELIVERING: []}
    for row in rows:
        if row["expires_at"] is not None and row["expires_at"] <= at:
            counts["expired"] += expire(conn, row, at, actor)
        elif row["status"] == Status.DELIVERING and row["attempt"] >= row["max_attempts"]:
            counts["dead_letter"] += spend(conn, row, at, actor)
        else:
            fresh[Status(row["status"])].append(row)
    if caps is not None:
        candidates = {row["id"] for group in fresh.values() for row in group}
        allowed = {row["id"] for row in caps.fit([r for r in rows if r["id"] in candidates], at)}
        fresh = {
            status: [row for row in group if row["id"] in allowed]
            for status, group in fresh.items()
        }
    order = {row["id"]: index for index, row in enumerate(rows)}
    lease_until = at + lease
    claims: list[Claim] = []
    spoiled: list[tuple[Claim, list[str]]] = []
    changes: list[Change] = []
    for previous, group in fresh.items():
        if not group:
            continue
        for row in group:  # every edge checked before the UPDATE runs
            check_edge(row["id"], previous, Status.DELIVERING, source=Source.SCHEDULER)
        # Selected in this same write transaction, so (status, attempt) are
        # still what was read, and the row key still names the same row; the
        # status guard restates it for the record.
        keys = [row["row_key"] for row in group]
        won = (
            conn.query(sql.CLAIM_ROWS_ARRAY, (lease_until, at, keys, previous))
            if conn.dialect.arrays
            else conn.query(
                sql.claim_rows(conn.dialect.row_key, len(group)), (lease_until, at, *keys, previous)
            )
        )
        recovered = previous == Status.DELIVERING
        for row in won:
            claim = Claim(
                dispatch_id=row["id"],
                kind=row["kind"],
                deliver_to=row["deliver_to"],
                payload=row["payload"]
                if isinstance(row["payload"], str)
                else json.dumps(row["payload"]),
                attempt=row["attempt"],
                max_attempts=row["max_attempts"],
                ack_required=bool(row["ack_required"]),
                lease_until=lease_until,
                ack_token=row["ack_token"],
                recovered=recovered,
            )
            if unreadable := undecodable_columns(row):
                spoiled.append((claim, unreadable))
            else:
                claims.append(claim)
            changes.append(
                Change(
                    row["id"],
                    previous,
                    Status.DELIVERING,
                    Reason.ATTEMPT,
                    f"{'lease expired; ' if recovered else ''}attempt {row['attempt']} of "
                    f"{row['max_attempts']}",
                    Source.SCHEDULER,
                    actor,
                    at,
                    f'{{"attempt": {row["attempt"]}, "lease_until": {lease_until!r}}}',
                )
            )
    record(conn, changes)
    if spoiled:
        counts["dead_letter"] += _dead_letter_unreadable(conn, spoiled, at, actor)
    claims.sort(key=lambda claim: order[claim.dispatch_id])
    if caps is not None:
        for claim in claims:
            caps.hold(claim.dispatch_id, claim.deliver_to, claim.lease_until)
    return claims, counts


def _dead_letter_unreadable(
    conn: Conn, spoiled: Sequence[tuple[Claim, list[str]]], at: float, actor: str
) -> int:
    """End the attempts of claimed rows whose stored text is not valid
    UTF-8 as permanent failures (dead-lettered, the bad columns named in
    ``last_error`` and history): no send could carry them, and left due
    they would come first in every scan. Returns how many were ended."""
    ends = []
    for claim, columns in spoiled:
        named = ", ".join(repr(column) for column in columns)
        message = (
            f"stored {'column' if len(columns) == 1 else 'columns'} {named} "
            f"{'is' if len(columns) == 1 else 'are'} not valid UTF-8; "
            "no attempt can send this dispatch"
        )
        log.warning("dispatch %s: %s; dead-lettered", visible(claim.dispatch_id), message)
        ends.append(
            AttemptEnd(claim, TransportResult.failure(message, permanent=True), at, 0.0, actor)
        )
    return sum(outcome is Outcome.DEAD_LETTER for outcome in finish_many(conn, ends))


# -- attempt ends ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttemptEnd:
    """How one attempt ended, ready to record."""

    claim: Claim
    result: TransportResult
    now: float
    delay: float
    """Seconds until a retry or a resend awaiting its ack."""
    actor: str
    next_lease: float = 0.0
    """With :func:`finish_and_claim`: the lease of the slot's next claim."""
    clock: Callable[[], float] | None = None
    """With :func:`finish_and_claim`: the wall clock the next claim reads."""
    caps: DestinationCaps | None = None
    """With :func:`finish_and_claim`: the worker's per-destination caps."""

    @property
    def retry_after(self) -> float | None:
        """The destination's own "not before" (capped), if it gave one."""
        after = self.result.retry_after
        return None if after is None else min(after, MAX_RETRY_AFTER_SECONDS)

    @property
    def wait(self) -> float:
        """Seconds until the row is due again: the schedule's delay, or the
        destination's ``Retry-After`` if that is later."""
        after = self.retry_after
        return self.delay if after is None else max(self.delay, after)


def _end_change(
    end: AttemptEnd, status: Status, reason: Reason, summary: str, metadata: Mapping[str, Any]
) -> Change:
    """The transition that ends ``end``'s attempt, out of ``delivering``."""
    return Change(
        end.claim.dispatch_id,
        Status.DELIVERING,
        status,
        reason,
        summary,
        Source.SCHEDULER,
        end.actor,
        end.now,
        metadata,
    )


def plan_end(end: AttemptEnd) -> tuple[Outcome, Status, Reason, str, str | None]:
    """(outcome, new status, reason code, summary, last_error) of one
    attempt's end, per ADR D4/D5."""
    claim, result, delay = end.claim, end.result, end.wait
    attempts_left = claim.attempt < claim.max_attempts
    if result.local and not result.ok:
        error = (result.error or "not sent")[:LAST_ERROR_LIMIT]
        return (
            Outcome.RELEASED,
            Status.PENDING,
            Reason.RELEASED,
            f"attempt {claim.attempt} not made, not counted; due now: {error[:200]}",
            error,
        )
    if result.ok and not claim.ack_required:
        return (
            Outcome.DELIVERED,
            Status.DELIVERED,
            Reason.TRANSPORT_OK,
            f"transport succeeded on attempt {claim.attempt}",
            None,
        )
    if result.ok and attempts_left:
        return (
            Outcome.AWAITING_ACK,
            Status.PENDING,
            Reason.AWAITING_ACK,
            f"sent on attempt {claim.attempt}; awaiting ack, resend in {delay:g}s",
            None,
        )
    if result.ok:
        return (
            Outcome.ACK_TIMEOUT,
            Status.DEAD_LETTER,
            Reason.ACK_TIMEOUT,
            f"sent {claim.attempt} of {claim.max_attempts} times without an ack",
            None,
        )
    error = (result.error or "transport failed")[:LAST_ERROR_LIMIT]
    if result.gone:
        return (
            Outcome.DEAD_LETTER,
            Status.DEAD_LETTER,
            Reason.GONE,
            f"attempt {claim.attempt}: the destination is gone, no further attempt: {error[:200]}",
            error,
        )
    if result.permanent:
        # A failure no retry can fix (the OS refusing the argv as too
        # large): retrying would fail the same way for hours.
        return (
            Outcome.DEAD_LETTER,
            Status.DEAD_LETTER,
            Reason.MAX_ATTEMPTS,
            f"attempt {claim.attempt} failed permanently, no retry can succeed: {error[:200]}",
            error,
        )
    if attempts_left:
        return (
            Outcome.RETRY,
            Status.PENDING,
            Reason.RETRY_BACKOFF,
            f"attempt {claim.attempt} failed; retry in {delay:g}s: {error[:200]}",
            error,
        )
    return (
        Outcome.DEAD_LETTER,
        Status.DEAD_LETTER,
        Reason.MAX_ATTEMPTS,
        f"attempt {claim.attempt} of {claim.max_attempts} failed: {error[:200]}",
        error,
    )


def finish_many(conn: Conn, ends: list[AttemptEnd]) -> list[Outcome]:
    """Record attempt ends -- status, due time, ``last_error`` and transition
    together (SPEC B4) -- each fenced on its claim; an end whose row moved
    on is a CONFLICT and writes nothing. One UPDATE for all of them, one
    INSERT batch."""
    if any(end.result.local and not end.result.ok for end in ends):
        # Attempts never made: released, their attempt taken back.
        outcomes: list[Outcome] = []
        for end in ends:
            local = end.result.local and not end.result.ok
            outcomes += [give_back(conn, end)] if local else finish_many(conn, [end])
        return outcomes
    if len({end.claim.dispatch_id for end in ends}) < len(ends):
        # Two claims of one row (a stale one among them): RETURNING cannot
        # tell which matched, so settle them one at a time.
        return [outcome for end in ends for outcome in finish_many(conn, [end])]
    plans = [plan_end(end) for end in ends]
    changes: list[Change] = []
    params: list[Any] = []
    for end, (_, status, reason, summary, error) in zip(ends, plans, strict=True):
        claim = end.claim
        next_at = end.now + end.wait if status == Status.PENDING else end.now
        metadata: dict[str, Any] = {"attempt": claim.attempt}
        if status == Status.PENDING:
            metadata["next_attempt_at"] = next_at
        if error is not None:
            metadata["error"] = error
        if end.result.permanent:
            metadata["permanent"] = True
        if end.retry_after is not None and not end.result.ok:
            metadata["retry_after_seconds"] = end.retry_after
        changes.append(_end_change(end, status, reason, summary, metadata))
        params += [
            claim.dispatch_id,
            claim.attempt,
            claim.lease_until,
            status,
            next_at,
            end.now,
            error,
        ]
    history = transition_rows(changes)  # every edge checked before the UPDATE runs
    if conn.dialect.arrays:  # PostgreSQL: one array per column, the same text every time
        columns = [params[i::7] for i in range(7)]
        for i in (2, 4, 5):  # float8[]: one type per array, whatever the clock gave
            columns[i] = [float(v) for v in columns[i]]
        finished = conn.query(sql.FINISH_ATTEMPTS_ARRAYS, columns)
    else:
        finished = conn.query(sql.finish_attempts(len(ends)), params)
    applied = {row["id"] for row in finished}
    insert_rows(
        conn,
        [
            row
            for row, change in zip(history, changes, strict=True)
            if change.dispatch_id in applied
        ],
    )
    return [
        plan[0] if end.claim.dispatch_id in applied else Outcome.CONFLICT
        for end, plan in zip(ends, plans, strict=True)
    ]


def give_back(conn: Conn, end: AttemptEnd) -> Outcome:
    """Release an attempt this machine could not make (a local resource
    error at spawn): ``pending``, due at once, ``attempt`` taken back so
    the attempt does not count, the reason in ``last_error`` and history
    (``dispatch.pending.released``); fenced on the claim."""
    claim = end.claim
    outcome, status, reason, summary, error = plan_end(end)
    change = _end_change(
        end,
        status,
        reason,
        summary,
        {"attempt": claim.attempt, "counted": False, "error": error},
    )
    history = transition_rows([change])
    if not conn.execute(
        sql.GIVE_BACK,
        (end.now, end.now, error, claim.dispatch_id, claim.attempt, claim.lease_until),
    ):
        return Outcome.CONFLICT
    insert_rows(conn, history)
    return outcome


def finish_and_claim(
    conn: Conn, ends: list[AttemptEnd]
) -> list[tuple[Outcome, Claim | None, dict[str, int]]]:
    """:func:`finish_many`, and in the same transaction claim the next due
    row for each slot the ends free (one commit per delivery for a busy
    worker). The claims' clock is read as the unit runs: a write that waited
    in the queue (or on another process's lock) must not hand out a lease
    that is already partly spent."""
    outcomes = finish_many(conn, ends)
    nexts: list[Claim | None] = [None] * len(ends)
    counts = [dict.fromkeys(COUNTER_KEYS, 0) for _ in ends]
    Key = tuple[float, str, Callable[[], float] | None, DestinationCaps | None]
    groups: dict[Key, list[int]] = {}
    for index, end in enumerate(ends):
        if end.caps is not None:  # the ended attempts make room first
            end.caps.drop([(end.claim.dispatch_id, end.claim.lease_until)])
        groups.setdefault((end.next_lease, end.actor, end.clock, end.caps), []).append(index)
    for (lease, actor, clock, caps), indexes in groups.items():
        assert clock is not None
        claims, scanned = claim_batch(conn, clock(), len(indexes), lease, actor, caps=caps)
        counts[indexes[0]] = scanned
        for index, claim in zip(indexes, claims, strict=False):
            nexts[index] = claim
    return list(zip(outcomes, nexts, counts, strict=True))


def release(
    conn: Conn, claim: Claim, now: float, actor: str, why: str = "worker shutdown"
) -> Outcome:
    """Give back an attempt that ``why`` (worker shutdown, a
    KeyboardInterrupt) interrupted: pending, due at once; or, if it was the
    last attempt allowed and may have reached the destination,
    dead-lettered (the same end as a claimant that died)."""
    if claim.attempt >= claim.max_attempts:
        status, reason, outcome = Status.DEAD_LETTER, Reason.MAX_ATTEMPTS, Outcome.DEAD_LETTER
        summary = f"{why} interrupted attempt {claim.attempt} of {claim.max_attempts}"
    else:
        status, reason, outcome = Status.PENDING, Reason.RELEASED, Outcome.RELEASED
        summary = f"{why} interrupted attempt {claim.attempt}; due now"
    change = Change(
        claim.dispatch_id,
        Status.DELIVERING,
        status,
        reason,
        summary,
        Source.SCHEDULER,
        actor,
        now,
        {"attempt": claim.attempt},
    )
    history = transition_rows([change])
    if not conn.execute(
        sql.RELEASE, (status, now, now, claim.dispatch_id, claim.attempt, claim.lease_until)
    ):
        return Outcome.CONFLICT
    insert_rows(conn, history)
    return outcome


# -- operators and consumers -----------------------------------------------------


def cas_status(
    conn: Conn,
    row: Row,
    to_status: Status,
    reason: Reason,
    summary: str,
    *,
    source: Source,
    actor: str,
    now: float,
    assignments: str = "",
    params: Sequence[Any] = (),
) -> bool:
    """Move ``row`` to ``to_status`` if it still has the status it was read
    with, and record the transition. False (nothing written) on a conflict."""
    change = Change(row["id"], row["status"], to_status, reason, summary, source, actor, now)
    history = transition_rows([change])
    changed = conn.execute(
        sql.set_status(assignments), (to_status, now, *params, row["id"], row["status"])
    )
    if changed:
        insert_rows(conn, history)
    return bool(changed)


def delete(conn: Conn, row: Row, reason: Reason, summary: str, actor: str, now: float) -> bool:
    """Remove a row (purge or retention) if it still has the status it was
    read with, recording who and when: its history is kept (SPEC B9)."""
    change = Change(
        row["id"],
        row["status"],
        PURGED,
        reason,
        summary,
        Source.OPERATOR,
        actor,
        now,
        {"attempt": row["attempt"], "kind": row["kind"]},
    )
    history = transition_rows([change])
    deleted = conn.execute(sql.DELETE, (row["id"], row["status"]))
    if deleted:
        insert_rows(conn, history)
    return bool(deleted)
