"""The dispatch state machine over a store: enqueue, claim, finish, ack,
retry, purge and prune.

This module owns every write of ``dispatch_outbox.status`` and every
``status_transitions`` row. Each status change is one unit of work (one
transaction): the row's compare-and-set and its transition row commit
together or not at all. Every change a delivery makes is fenced on the
``(status, attempt)`` it read or claimed, so a stale claimant -- one whose
lease another worker recovered -- can never overwrite a newer attempt.

No transaction here spans the transport or any other await on the outside
world: a delivery is a claim (one transaction), the transport call (none),
then a finish (one transaction).
"""

from __future__ import annotations

import dataclasses
import enum
import hmac
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any, Final, NamedTuple

import anyio

from . import lifecycle as lc
from .backoff import jittered_backoff
from .redact import MASK
from .settings import CLAIM_LEASE_MARGIN_SECONDS, DEFAULT_BATCH_SIZE
from .signal import dispatch_envelope_json, uuid4_bytes
from .store.base import DEFAULT_MAX_BODY_BYTES, Conn, Database, Row
from .store.schema import FINISHED_STATUSES_SQL
from .transport import (
    LAST_ERROR_LIMIT,
    NOTIFY_TIMEOUT_SECONDS,
    CommandTransport,
    Delivery,
    Transport,
    TransportResult,
    as_transport,
    describe_exception,
    must_propagate,
)
from .validate import (
    findable,
    require_body,
    require_bool,
    require_dispatch_id,
    require_int,
    require_non_empty,
    require_number,
    require_optional_id,
    require_route,
    require_text,
)
from .values import show

DEFAULT_MAX_ATTEMPTS: Final = 8
DEFAULT_LIST_LIMIT: Final = 50
PRUNE_CHUNK: Final = 500
DEFAULT_RETENTION_SECONDS: Final[Mapping[str, float]] = {
    lc.DELIVERED: 7 * 86400.0,
    lc.ACKED: 7 * 86400.0,
    lc.DEAD_LETTER: 30 * 86400.0,
    lc.EXPIRED: 30 * 86400.0,
}
COUNTER_KEYS: Final = ("attempted", "delivered", "dead_letter", "expired", "retried")

_COLUMNS: Final = (
    "id, kind, deliver_to, payload, dedup_key, status, attempt, max_attempts, "
    "next_attempt_at, ack_required, ack_token, session_id, schedule_run_id, "
    "last_error, created_at, expires_at, updated_at"
)
_DUE_STATUSES_SQL: Final = "status IN ('pending', 'delivering')"
# Every write that ends an attempt is fenced on the claim: its attempt and
# its lease (`next_attempt_at` as the claim set it). The attempt alone is not
# unique once an operator retry resets it to 0; the lease time is.
_FENCE: Final = (
    "id = ? AND status = 'delivering' AND attempt = ? AND next_attempt_at = ?"
)


class EnqueueResult(NamedTuple):
    """One enqueue's outcome: the row's id, and whether an existing row with
    the same dedup key answered instead of a new one."""

    id: str
    dedup_hit: bool


@dataclasses.dataclass(frozen=True)
class Claim:
    """One attempt of one dispatch, owned by this process until it finishes
    or its lease (``lease_until``) runs out."""

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

    def delivery(self) -> Delivery:
        return Delivery(
            dispatch_id=self.dispatch_id,
            kind=self.kind,
            deliver_to=self.deliver_to,
            attempt=self.attempt,
            payload=self.payload,
        )


class Outcome(enum.Enum):
    """What finishing an attempt did to its row."""

    DELIVERED = "delivered"
    AWAITING_ACK = "awaiting_ack"
    RETRY = "retry"
    DEAD_LETTER = "dead_letter"
    ACK_TIMEOUT = "ack_timeout"
    RELEASED = "released"
    """Worker shutdown interrupted the attempt: back to pending, due now."""
    CONFLICT = "conflict"
    """The row was no longer (delivering, this attempt): nothing written."""


@dataclasses.dataclass(frozen=True)
class _NewDispatch:
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


def _prepare(
    *,
    kind: object,
    deliver_to: object,
    body: object = None,
    dedup_key: object = None,
    ack_required: object = False,
    max_attempts: object = DEFAULT_MAX_ATTEMPTS,
    expires_at: object = None,
    session_id: object = None,
    schedule_run_id: object = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> _NewDispatch:
    """Validate one enqueue's arguments and build its row (id, token and
    serialised envelope), all before any transaction."""
    kind_ = require_non_empty("kind", kind)
    route = require_route(deliver_to)
    body_json = require_body(body, max_body_bytes)
    key = None if dedup_key is None else require_non_empty("dedup_key", dedup_key)
    ack = require_bool("ack_required", ack_required)
    bound = require_int("max_attempts", max_attempts, minimum=1)
    expiry = None if expires_at is None else require_number("expires_at", expires_at)
    session = require_optional_id("session_id", session_id)
    run = require_optional_id("schedule_run_id", schedule_run_id)
    dispatch_id = uuid4_bytes().hex()
    token = uuid4_bytes().hex() if ack else None
    return _NewDispatch(
        id=dispatch_id,
        kind=kind_,
        deliver_to=route,
        payload=dispatch_envelope_json(
            dispatch_id=dispatch_id, kind=kind_, deliver_to=route, ack_token=token,
            body_json=body_json,
        ),
        dedup_key=key,
        max_attempts=bound,
        ack_required=ack,
        ack_token=token,
        session_id=session,
        schedule_run_id=run,
        expires_at=expiry,
    )


# -- units of work (run inside one transaction on the store's thread) ------


_INSERT_TRANSITION: Final = (
    "INSERT INTO status_transitions (entity_type, entity_id, previous_status, status, "
    "reason_code, reason_summary, source, actor, evidence_refs, metadata, created_at) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


def _transition(
    dispatch_id: str,
    previous: str | None,
    status: str,
    reason: str,
    summary: str,
    *,
    source: str,
    actor: str,
    now: float,
    metadata: Mapping[str, Any] | str | None = None,
) -> tuple[Any, ...]:
    """The parameters of one :data:`_INSERT_TRANSITION` row (``metadata`` as
    a mapping, or already JSON text)."""
    if reason not in lc.REASON_CODES:  # a programming error, never user input
        raise AssertionError(f"unknown reason code {reason!r}")
    if not isinstance(metadata, str):
        metadata = json.dumps(dict(metadata or {}))
    return (lc.ENTITY_TYPE, dispatch_id, previous, status, reason, summary, source, actor,
            "[]", metadata, now)


def _record(
    conn: Conn,
    dispatch_id: str,
    previous: str | None,
    status: str,
    reason: str,
    summary: str,
    *,
    source: str,
    actor: str,
    now: float,
    metadata: Mapping[str, Any] | None = None,
) -> None:
    conn.execute(_INSERT_TRANSITION, _transition(
        dispatch_id, previous, status, reason, summary,
        source=source, actor=actor, now=now, metadata=metadata,
    ))


def _insert(conn: Conn, new: _NewDispatch, now: float) -> EnqueueResult:
    for column, value, table in (
        ("session_id", new.session_id, "sessions"),
        ("schedule_run_id", new.schedule_run_id, "schedule_runs"),
    ):
        if value is not None and conn.query_one(
            f"SELECT 1 AS found FROM {table} WHERE id = ?", (value,)
        ) is None:
            raise ValueError(f"{column} {value!r} does not exist in {table}")
    if new.dedup_key is not None:
        hit = conn.query_one(
            "SELECT id FROM dispatch_outbox WHERE dedup_key = ?", (new.dedup_key,)
        )
        if hit is not None:
            return EnqueueResult(str(hit["id"]), True)
    inserted = conn.execute(
        "INSERT INTO dispatch_outbox (id, kind, deliver_to, payload, dedup_key, status, "
        "attempt, max_attempts, next_attempt_at, ack_required, ack_token, session_id, "
        "schedule_run_id, last_error, created_at, expires_at, updated_at) "
        "VALUES (?, ?, ?, ?, ?, 'pending', 0, ?, ?, ?, ?, ?, ?, NULL, ?, ?, ?) "
        "ON CONFLICT (dedup_key) WHERE dedup_key IS NOT NULL DO NOTHING",
        (
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
        ),
    )
    if inserted == 0:
        # Another writer committed the same key after our select (possible
        # across PostgreSQL sessions): the first committed row wins (B3).
        winner = conn.query_one(
            "SELECT id FROM dispatch_outbox WHERE dedup_key = ?", (new.dedup_key,)
        )
        if winner is None:
            raise RuntimeError(f"dedup_key {new.dedup_key!r} conflicted but no row holds it")
        return EnqueueResult(str(winner["id"]), True)
    _record(
        conn,
        new.id,
        None,
        lc.PENDING,
        lc.ENQUEUED,
        f"enqueued kind={new.kind}",
        source=lc.SOURCE_SYSTEM,
        actor=lc.ACTOR_ENQUEUE,
        now=now,
    )
    conn.announce_enqueue()
    return EnqueueResult(new.id, False)


def _insert_all(
    conn: Conn, batch: Sequence[_NewDispatch], now: float, name_items: bool = False
) -> list[EnqueueResult]:
    """Insert a batch: rows with no dedup key and no provenance link need no
    lookup and go in with two bulk statements; the others one by one (a key
    repeated within the batch resolves to its first row, in order). With
    ``name_items``, an error (an unknown session, say) names its item."""

    def one(index: int, new: _NewDispatch) -> EnqueueResult:
        try:
            return _insert(conn, new, now)
        except ValueError as exc:
            if not name_items:
                raise
            raise ValueError(f"item {index}: {exc}") from None

    plain = [new for new in batch if _is_plain(new)]
    if len(plain) < 2:
        return [one(index, new) for index, new in enumerate(batch)]
    done = {result.id: result for result in _insert_plain(conn, [(new, now) for new in plain])}
    return [done[new.id] if new.id in done else one(index, new)
            for index, new in enumerate(batch)]


def _is_plain(new: _NewDispatch) -> bool:
    """No dedup key and no provenance link: nothing to look up first."""
    return new.dedup_key is None and new.session_id is None and new.schedule_run_id is None


def _insert_plain(
    conn: Conn, items: Sequence[tuple[_NewDispatch, float]]
) -> list[EnqueueResult]:
    """Insert plain dispatches (see :func:`_is_plain`), each at its own
    ``now``, with two bulk statements; coalesced, this serves every
    concurrent plain enqueue of a group commit at once."""
    conn.executemany(
        "INSERT INTO dispatch_outbox (id, kind, deliver_to, payload, status, attempt, "
        "max_attempts, next_attempt_at, ack_required, ack_token, created_at, expires_at, "
        "updated_at) VALUES (?, ?, ?, ?, 'pending', 0, ?, ?, ?, ?, ?, ?, ?)",
        [(new.id, new.kind, new.deliver_to, new.payload, new.max_attempts, now,
          int(new.ack_required), new.ack_token, now, new.expires_at, now)
         for new, now in items],
    )
    conn.executemany(
        _INSERT_TRANSITION,
        [_transition(new.id, None, lc.PENDING, lc.ENQUEUED, f"enqueued kind={new.kind}",
                     source=lc.SOURCE_SYSTEM, actor=lc.ACTOR_ENQUEUE, now=now, metadata="{}")
         for new, now in items],
    )
    conn.announce_enqueue()
    return [EnqueueResult(new.id, False) for new, _ in items]


def _select_due(
    conn: Conn, now: float, limit: int, columns: str = _COLUMNS, *, lock: bool = False
) -> list[Row]:
    """Up to ``limit`` due rows, ordered by ``next_attempt_at, created_at``
    (SPEC B5). One ordered range scan of the due index per live status, each
    stopping after ``limit`` rows, merged here: the cost follows ``limit``,
    not the number of due rows, and finished rows are not in the index."""
    rows = [
        row
        for status in lc.DUE_STATUSES
        for row in conn.query(
            # The verbatim partial-index term lets the planner use the index.
            f"SELECT {columns} FROM dispatch_outbox WHERE {_DUE_STATUSES_SQL} "
            f"AND status = '{status}' AND next_attempt_at <= ? "
            f"ORDER BY next_attempt_at, created_at LIMIT ?{conn.lock_clause if lock else ''}",
            (now, limit),
        )
    ]
    rows.sort(key=lambda row: (row["next_attempt_at"], row["created_at"]))
    return rows[:limit]


def _expire(conn: Conn, row: Row, now: float, actor: str) -> bool:
    lc.check_edge(row["id"], row["status"], lc.EXPIRED, source=lc.SOURCE_SCHEDULER)
    changed = conn.execute(
        "UPDATE dispatch_outbox SET status = 'expired', updated_at = ? "
        "WHERE id = ? AND status = ? AND attempt = ? AND next_attempt_at <= ?",
        (now, row["id"], row["status"], row["attempt"], now),
    )
    if changed:
        _record(
            conn,
            row["id"],
            row["status"],
            lc.EXPIRED,
            lc.DEADLINE,
            f"expires_at {row['expires_at']} passed before attempt {row['attempt'] + 1}",
            source=lc.SOURCE_SCHEDULER,
            actor=actor,
            now=now,
            metadata={"expires_at": row["expires_at"], "attempt": row["attempt"]},
        )
    return bool(changed)


class _Spent(NamedTuple):
    """A delivering row whose lease ran out during its last allowed attempt:
    dead-lettered instead of sent again (``max_attempts`` bounds every send)."""

    dispatch_id: str


def _claim(conn: Conn, row: Row, now: float, lease: float, actor: str) -> Claim | _Spent | None:
    dispatch_id, status, attempt = row["id"], row["status"], row["attempt"]
    if status == lc.DELIVERING and attempt >= row["max_attempts"]:
        lc.check_edge(dispatch_id, status, lc.DEAD_LETTER, source=lc.SOURCE_SCHEDULER)
        changed = conn.execute(
            "UPDATE dispatch_outbox SET status = 'dead_letter', updated_at = ?, "
            "last_error = COALESCE(last_error, ?) "
            "WHERE id = ? AND status = 'delivering' AND attempt = ? AND next_attempt_at <= ?",
            (now, "lease expired during the last attempt", dispatch_id, attempt, now),
        )
        if not changed:
            return None
        _record(
            conn,
            dispatch_id,
            status,
            lc.DEAD_LETTER,
            lc.MAX_ATTEMPTS,
            f"lease expired during attempt {attempt} of {row['max_attempts']}",
            source=lc.SOURCE_SCHEDULER,
            actor=actor,
            now=now,
            metadata={"attempt": attempt},
        )
        return _Spent(dispatch_id)
    lc.check_edge(dispatch_id, status, lc.DELIVERING, source=lc.SOURCE_SCHEDULER)
    lease_until = now + lease
    changed = conn.execute(
        "UPDATE dispatch_outbox SET status = 'delivering', attempt = ?, next_attempt_at = ?, "
        "updated_at = ? WHERE id = ? AND status = ? AND attempt = ? AND next_attempt_at <= ?",
        (attempt + 1, lease_until, now, dispatch_id, status, attempt, now),
    )
    if not changed:
        return None
    recovered = "lease expired; " if status == lc.DELIVERING else ""
    _record(
        conn,
        dispatch_id,
        status,
        lc.DELIVERING,
        lc.ATTEMPT,
        f"{recovered}attempt {attempt + 1} of {row['max_attempts']}",
        source=lc.SOURCE_SCHEDULER,
        actor=actor,
        now=now,
        metadata={"attempt": attempt + 1, "lease_until": lease_until},
    )
    return Claim(
        dispatch_id=dispatch_id,
        kind=row["kind"],
        deliver_to=row["deliver_to"],
        payload=row["payload"] if isinstance(row["payload"], str) else json.dumps(row["payload"]),
        attempt=attempt + 1,
        max_attempts=row["max_attempts"],
        ack_required=bool(row["ack_required"]),
        lease_until=lease_until,
        ack_token=row["ack_token"],
    )


@dataclasses.dataclass(frozen=True)
class _AttemptEnd:
    claim: Claim
    result: TransportResult
    now: float
    delay: float
    actor: str
    next_lease: float = 0.0
    """With :func:`finish_and_claim_next`: the lease of the next claim."""


def _plan_end(end: _AttemptEnd) -> tuple[Outcome, str, str, str, str | None]:
    """(outcome, new status, reason code, summary, last_error) of one
    attempt's end, per ADR D4/D5."""
    claim, result, delay = end.claim, end.result, end.delay
    attempts_left = claim.attempt < claim.max_attempts
    if result.ok and not claim.ack_required:
        return (Outcome.DELIVERED, lc.DELIVERED, lc.TRANSPORT_OK,
                f"transport succeeded on attempt {claim.attempt}", None)
    if result.ok and attempts_left:
        return (Outcome.AWAITING_ACK, lc.PENDING, lc.AWAITING_ACK,
                f"sent on attempt {claim.attempt}; awaiting ack, resend in {delay:g}s", None)
    if result.ok:
        return (Outcome.ACK_TIMEOUT, lc.DEAD_LETTER, lc.ACK_TIMEOUT,
                f"sent {claim.attempt} of {claim.max_attempts} times without an ack", None)
    error = (result.error or "transport failed")[:LAST_ERROR_LIMIT]
    if result.permanent:
        # A failure no retry can fix (the OS refusing the argv as too
        # large): retrying would fail the same way for hours.
        return (Outcome.DEAD_LETTER, lc.DEAD_LETTER, lc.MAX_ATTEMPTS,
                f"attempt {claim.attempt} failed permanently, no retry can succeed: "
                f"{error[:200]}", error)
    if attempts_left:
        return (Outcome.RETRY, lc.PENDING, lc.RETRY_BACKOFF,
                f"attempt {claim.attempt} failed; retry in {delay:g}s: {error[:200]}", error)
    return (Outcome.DEAD_LETTER, lc.DEAD_LETTER, lc.MAX_ATTEMPTS,
            f"attempt {claim.attempt} of {claim.max_attempts} failed: {error[:200]}", error)


def _finish_many(conn: Conn, ends: list[_AttemptEnd]) -> list[Outcome]:
    """Record attempt ends -- status, due time, ``last_error`` and transition
    together (SPEC B4) -- each fenced on its claim (``delivering``, its
    attempt and its lease); an end whose row moved on is a CONFLICT and
    writes nothing. One UPDATE for all of them, one INSERT batch."""
    if len({end.claim.dispatch_id for end in ends}) < len(ends):
        # Two claims of one row (a stale one among them): RETURNING cannot
        # tell which matched, so settle them one at a time.
        return [outcome for end in ends for outcome in _finish_many(conn, [end])]
    plans = [_plan_end(end) for end in ends]
    values, params = [], []
    for end, (_, status, _, _, error) in zip(ends, plans, strict=True):
        lc.check_edge(end.claim.dispatch_id, lc.DELIVERING, status, source=lc.SOURCE_SCHEDULER)
        next_at = end.now + end.delay if status == lc.PENDING else end.now
        values.append("(?, ?, ?, ?, ?, ?, ?)")
        params += [end.claim.dispatch_id, end.claim.attempt, end.claim.lease_until, status,
                   next_at, end.now, error]
    applied = {
        row["id"]
        for row in conn.query(
            f"WITH f(id, attempt, lease, status, next_at, now, err) AS "
            f"(VALUES {', '.join(values)}) "
            "UPDATE dispatch_outbox SET status = f.status, next_attempt_at = f.next_at, "
            "updated_at = f.now, last_error = COALESCE(f.err, dispatch_outbox.last_error) "
            "FROM f WHERE dispatch_outbox.id = f.id AND dispatch_outbox.status = 'delivering' "
            "AND dispatch_outbox.attempt = f.attempt "
            "AND dispatch_outbox.next_attempt_at = f.lease "
            "RETURNING dispatch_outbox.id AS id",
            params,
        )
    }
    history = []
    outcomes = []
    for end, (outcome, status, reason, summary, error) in zip(ends, plans, strict=True):
        claim = end.claim
        if claim.dispatch_id not in applied:
            outcomes.append(Outcome.CONFLICT)
            continue
        outcomes.append(outcome)
        metadata: dict[str, Any] = {"attempt": claim.attempt}
        if status == lc.PENDING:
            metadata["next_attempt_at"] = end.now + end.delay
        if error is not None:
            metadata["error"] = error
        if end.result.permanent:
            metadata["permanent"] = True
        history.append(_transition(claim.dispatch_id, lc.DELIVERING, status, reason, summary,
                                   source=lc.SOURCE_SCHEDULER, actor=end.actor, now=end.now,
                                   metadata=metadata))
    if history:
        conn.executemany(_INSERT_TRANSITION, history)
    return outcomes


# -- the public API --------------------------------------------------------


def _clock(now: float | None) -> Callable[[], float]:
    if now is None:
        return time.time
    fixed = require_number("now", now)
    return lambda: fixed


async def enqueue_dispatch(
    db: Database,
    *,
    kind: str,
    deliver_to: str,
    body: dict[str, Any] | None = None,
    dedup_key: str | None = None,
    ack_required: bool = False,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    expires_at: float | None = None,
    session_id: str | None = None,
    schedule_run_id: str | None = None,
    now: float | None = None,
) -> str:
    """Commit one dispatch and its ``dispatch.pending.enqueued`` transition;
    return its id.

    With ``dedup_key``, a key already committed returns that row's id and
    writes nothing -- including when a concurrent writer commits the same key
    first. Raises ``TypeError``/``ValueError`` naming the bad argument (or an
    unknown ``session_id``/``schedule_run_id``) before anything is written;
    a database failure (locked past ``busy_timeout``, disk full, read-only)
    propagates as the driver's error, with nothing written.
    Passed a transaction handle, the row commits or rolls back with it.
    """
    new = _prepare(
        kind=kind,
        deliver_to=deliver_to,
        body=body,
        dedup_key=dedup_key,
        ack_required=ack_required,
        max_attempts=max_attempts,
        expires_at=expires_at,
        session_id=session_id,
        schedule_run_id=schedule_run_id,
        max_body_bytes=_body_limit(db),
    )
    if _is_plain(new):
        # Coalesced with the other plain enqueues of the same group commit.
        result: EnqueueResult = await db.write_many(_insert_plain, (new, _clock(now)()))
        db.notify_enqueued()
        return result.id
    return (await _commit_new(db, [new], _clock(now)))[0].id


def _body_limit(db: Database) -> int:
    limit = getattr(db, "max_body_bytes", DEFAULT_MAX_BODY_BYTES)
    return limit if isinstance(limit, int) else DEFAULT_MAX_BODY_BYTES


async def _commit_new(
    db: Database, batch: Sequence[_NewDispatch], clock: Callable[[], float],
    name_items: bool = False,
) -> list[EnqueueResult]:
    results = await db.write(
        partial(_insert_all, batch=batch, now=clock(), name_items=name_items)
    )
    if any(not result.dedup_hit for result in results):
        db.notify_enqueued()
    return results


_ENQUEUE_KEYS: Final = frozenset(
    {
        "kind",
        "deliver_to",
        "body",
        "dedup_key",
        "ack_required",
        "max_attempts",
        "expires_at",
        "session_id",
        "schedule_run_id",
    }
)


async def enqueue_many(
    db: Database, items: Iterable[Mapping[str, Any]], *, now: float | None = None
) -> list[EnqueueResult]:
    """Enqueue many dispatches in one transaction; each item holds the keyword
    arguments of :func:`enqueue_dispatch`. Returns one :class:`EnqueueResult`
    per item, in order. A repeated key within the batch resolves to the first
    item's row. Any invalid item raises (naming its index and argument) before
    anything is written; then no item is written.
    """
    clock = _clock(now)
    if isinstance(items, Mapping | str | bytes):
        raise TypeError(f"items must be an iterable of mappings, got {show(items)}")
    limit = _body_limit(db)
    batch: list[_NewDispatch] = []
    for index, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise TypeError(f"item {index} must be a mapping of enqueue arguments, got "
                            f"{show(item)}")
        unknown = set(item) - _ENQUEUE_KEYS
        if unknown:
            raise TypeError(
                f"item {index}: unknown enqueue argument {show(sorted(map(str, unknown))[0])}"
            )
        for required in ("kind", "deliver_to"):
            if required not in item:
                raise TypeError(f"item {index}: missing required argument {required!r}")
        try:
            batch.append(_prepare(**item, max_body_bytes=limit))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"item {index}: {exc}") from None
    return await _commit_new(db, batch, clock, name_items=True) if batch else []


def _claim_batch(
    conn: Conn, at: float, limit: int, lease: float, actor: str
) -> tuple[list[Claim], dict[str, int]]:
    """The set-based scan of :func:`claim_due`: one indexed select of the due
    rows, then one statement per kind of change (not per row)."""
    counts = dict.fromkeys(COUNTER_KEYS, 0)
    rows = _select_due(
        conn, at, limit,
        f"id, {conn.row_key} AS row_key, status, attempt, max_attempts, expires_at, "
        "next_attempt_at, created_at",
        lock=True,
    )
    counts["attempted"] = len(rows)
    fresh: dict[str, list[Row]] = {lc.PENDING: [], lc.DELIVERING: []}
    for row in rows:
        if row["expires_at"] is not None and row["expires_at"] <= at:
            counts["expired"] += _expire(conn, row, at, actor)
        elif row["status"] == lc.DELIVERING and row["attempt"] >= row["max_attempts"]:
            counts["dead_letter"] += isinstance(_claim(conn, row, at, lease, actor), _Spent)
        else:
            fresh[row["status"]].append(row)
    order = {row["id"]: index for index, row in enumerate(rows)}
    lease_until = at + lease
    claims: list[Claim] = []
    history: list[tuple[Any, ...]] = []
    for previous, group in fresh.items():
        if not group:
            continue
        lc.check_edge(group[0]["id"], previous, lc.DELIVERING, source=lc.SOURCE_SCHEDULER)
        marks = ", ".join("?" * len(group))
        # Selected in this same write transaction, so (status, attempt) are
        # still what was read, and the row key still names the same row; the
        # status guard restates it for the record.
        won = conn.query(
            "UPDATE dispatch_outbox SET status = 'delivering', attempt = attempt + 1, "
            f"next_attempt_at = ?, updated_at = ? WHERE {conn.row_key} IN ({marks}) "
            "AND status = ? "
            "RETURNING id, kind, deliver_to, payload, attempt, max_attempts, ack_required, "
            "ack_token",
            (lease_until, at, *(row["row_key"] for row in group), previous),
        )
        recovered = "lease expired; " if previous == lc.DELIVERING else ""
        for row in won:
            claims.append(Claim(
                dispatch_id=row["id"],
                kind=row["kind"],
                deliver_to=row["deliver_to"],
                payload=row["payload"] if isinstance(row["payload"], str)
                else json.dumps(row["payload"]),
                attempt=row["attempt"],
                max_attempts=row["max_attempts"],
                ack_required=bool(row["ack_required"]),
                lease_until=lease_until,
                ack_token=row["ack_token"],
            ))
            history.append(_transition(
                row["id"], previous, lc.DELIVERING, lc.ATTEMPT,
                f"{recovered}attempt {row['attempt']} of {row['max_attempts']}",
                source=lc.SOURCE_SCHEDULER, actor=actor, now=at,
                metadata=f'{{"attempt": {row["attempt"]}, "lease_until": {lease_until!r}}}',
            ))
    if history:
        conn.executemany(_INSERT_TRANSITION, history)
    claims.sort(key=lambda claim: order[claim.dispatch_id])
    return claims, counts


async def claim_due(
    db: Database,
    *,
    now: float | None = None,
    limit: int = DEFAULT_BATCH_SIZE,
    lease_seconds: float = NOTIFY_TIMEOUT_SECONDS + CLAIM_LEASE_MARGIN_SECONDS,
    actor: str = lc.ACTOR_DELIVERY,
) -> tuple[list[Claim], dict[str, int]]:
    """Scan up to ``limit`` due rows (ordered by ``next_attempt_at,
    created_at``) and, in one transaction, expire those past ``expires_at``
    and claim the rest. Returns the claims won and the counters of the scan
    (``attempted``, ``expired``, ``dead_letter``). A row another claimant
    took first is skipped silently."""
    clock = _clock(now)
    limit = require_int("limit", limit, minimum=1)

    def scan_and_claim(conn: Conn) -> tuple[list[Claim], dict[str, int]]:
        return _claim_batch(conn, clock(), limit, lease_seconds, actor)

    return await db.write(scan_and_claim)


def _finish_and_claim_many(
    conn: Conn, ends: list[_AttemptEnd]
) -> list[tuple[Outcome, Claim | None, dict[str, int]]]:
    outcomes = _finish_many(conn, ends)
    nexts: list[Claim | None] = [None] * len(ends)
    counts = [dict.fromkeys(COUNTER_KEYS, 0) for _ in ends]
    groups: dict[tuple[float, str], list[int]] = {}
    for index, end in enumerate(ends):
        groups.setdefault((end.next_lease, end.actor), []).append(index)
    # The claims' clock is read now, as the unit runs: a write that waited in
    # the queue (or on another process's lock) must not hand out a lease that
    # is already partly spent.
    at = time.time()
    for (lease, actor), indexes in groups.items():
        claims, scanned = _claim_batch(conn, at, len(indexes), lease, actor)
        counts[indexes[0]] = scanned
        for index, claim in zip(indexes, claims, strict=False):
            nexts[index] = claim
    return list(zip(outcomes, nexts, counts, strict=True))


async def finish_and_claim_next(
    db: Database,
    claim: Claim,
    result: TransportResult,
    *,
    lease_seconds: float,
    retry_jitter: float = 0.0,
    actor: str = lc.ACTOR_DELIVERY,
) -> tuple[Outcome, Claim | None, dict[str, int]]:
    """:func:`finish_attempt`, and in the same transaction claim the next due
    row (if any) for the delivery slot this attempt frees: a busy worker pays
    one commit per delivery, not two, and its slot never waits for a scan.
    Returns the outcome, the next claim or None, and that scan's counters."""
    delay = jittered_backoff(claim.attempt, retry_jitter)
    end = _AttemptEnd(claim, result, time.time(), delay, actor, next_lease=lease_seconds)
    return await db.write_many(_finish_and_claim_many, end)


async def finish_attempt(
    db: Database,
    claim: Claim,
    result: TransportResult,
    *,
    now: float | None = None,
    retry_jitter: float = 0.0,
    actor: str = lc.ACTOR_DELIVERY,
) -> Outcome:
    """Record the end of ``claim``'s attempt (status, ``last_error``, due time
    and transition) in one transaction, fenced on ``(delivering,
    claim.attempt)``: returns :attr:`Outcome.CONFLICT` and writes nothing if
    the row moved on (acked, purged, or recovered by another claimant)."""
    clock = _clock(now)
    delay = jittered_backoff(claim.attempt, retry_jitter)
    return await db.write_many(_finish_many, _AttemptEnd(claim, result, clock(), delay, actor))


def _release(conn: Conn, claim: Claim, now: float, actor: str) -> Outcome:
    if claim.attempt >= claim.max_attempts:
        # The interrupted attempt was the last one allowed and may have
        # reached the destination: the same end as a claimant that died.
        status, reason, outcome = lc.DEAD_LETTER, lc.MAX_ATTEMPTS, Outcome.DEAD_LETTER
        summary = f"worker shutdown interrupted attempt {claim.attempt} of {claim.max_attempts}"
    else:
        status, reason, outcome = lc.PENDING, lc.RELEASED, Outcome.RELEASED
        summary = f"worker shutdown interrupted attempt {claim.attempt}; due now"
    lc.check_edge(claim.dispatch_id, lc.DELIVERING, status, source=lc.SOURCE_SCHEDULER)
    changed = conn.execute(
        "UPDATE dispatch_outbox SET status = ?, next_attempt_at = ?, updated_at = ? "
        f"WHERE {_FENCE}",
        (status, now, now, claim.dispatch_id, claim.attempt, claim.lease_until),
    )
    if not changed:
        return Outcome.CONFLICT
    _record(conn, claim.dispatch_id, lc.DELIVERING, status, reason, summary,
            source=lc.SOURCE_SCHEDULER, actor=actor, now=now,
            metadata={"attempt": claim.attempt})
    return outcome


async def release_attempt(
    db: Database, claim: Claim, *, now: float | None = None, actor: str = lc.ACTOR_DELIVERY
) -> Outcome:
    """Give back an attempt that worker shutdown interrupted: the row returns
    to ``pending``, due at once (``dispatch.pending.released``), fenced on
    ``(delivering, claim.attempt)``. If it was the last attempt allowed, the
    row is dead-lettered instead (``max_attempts`` bounds every send).
    Returns :attr:`Outcome.CONFLICT` if the row had moved on."""
    clock = _clock(now)
    return await db.write(lambda conn: _release(conn, claim, clock(), actor))


async def next_due_at(db: Database) -> float | None:
    """When the earliest pending or delivering row falls due, or None."""
    row = await db.read(
        lambda conn: conn.query_one(
            f"SELECT next_attempt_at AS due FROM dispatch_outbox WHERE {_DUE_STATUSES_SQL} "
            "ORDER BY next_attempt_at LIMIT 1"
        )
    )
    return None if row is None else float(row["due"])


def require_store(db: object, caller: str) -> None:
    """Refuse a transaction handle where a transport will run: no database
    transaction may span an external call."""
    if not hasattr(db, "transaction"):
        raise TypeError(
            f"{caller} needs the store itself, not a transaction handle: a transport "
            "must never run inside a database transaction"
        )


LEASE_SAFETY_SECONDS: Final = 1.0
"""A transport still running this close to its claim's lease end is
cancelled, so no second claimant can ever overlap it."""


async def call_transport(transport: Transport, claim: Claim) -> TransportResult:
    """Run ``transport`` for ``claim``; a transport that raises (anything
    but a cancellation or KeyboardInterrupt: ``SystemExit`` too), or returns
    anything but a :class:`TransportResult`, is a failure saying so.
    Cancellation propagates."""
    try:
        result = await transport(claim.delivery())
    except BaseException as exc:
        if must_propagate(exc):
            raise
        result = TransportResult.failure(describe_exception(exc))
    if not isinstance(result, TransportResult):
        result = TransportResult.failure(
            f"transport returned {show(result)}, not a TransportResult"
        )
    if result.error and claim.ack_token and claim.ack_token in result.error:
        result = dataclasses.replace(result, error=result.error.replace(claim.ack_token, MASK))
    return result


def lease_timeout_result(lease_seconds: float) -> TransportResult:
    return TransportResult.failure(
        f"timeout: transport still running {lease_seconds - LEASE_SAFETY_SECONDS:g}s "
        f"into a lease of {lease_seconds:g}s"
    )


async def send_within_lease(
    transport: Transport, claim: Claim, lease_seconds: float
) -> TransportResult:
    """:func:`call_transport` for a claim just taken with ``lease_seconds``;
    a transport still running :data:`LEASE_SAFETY_SECONDS` before the lease
    ends is cancelled and reported as a timeout, so no second claimant can
    overlap it. Cancellation from outside propagates."""
    with anyio.move_on_after(max(0.0, lease_seconds - LEASE_SAFETY_SECONDS)):
        return await call_transport(transport, claim)
    return lease_timeout_result(lease_seconds)


def tally(counts: dict[str, int], result: TransportResult, outcome: Outcome) -> None:
    """Add one finished attempt to a counter mapping (ADR D4/D5 meanings:
    ``delivered`` counts successful transport calls whose finish applied)."""
    if outcome is Outcome.CONFLICT:
        return
    if result.ok:
        counts["delivered"] += 1
    if outcome in (Outcome.DEAD_LETTER, Outcome.ACK_TIMEOUT):
        counts["dead_letter"] += 1
    elif outcome is Outcome.RETRY:
        counts["retried"] += 1


async def deliver_due_dispatches(
    db: Database,
    *,
    now: float | None = None,
    notify_template: list[str] | None = None,
    transport: Transport | Callable[..., Any] | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    timeout_seconds: float = NOTIFY_TIMEOUT_SECONDS,
    retry_jitter: float = 0.0,
    actor: str = lc.ACTOR_DELIVERY,
) -> dict[str, int]:
    """One due scan: expire, claim, send and finish up to ``batch_size`` due
    rows, one at a time; return ``{attempted, delivered, dead_letter,
    expired, retried}``.

    Each row is claimed just before its own send (so its lease starts when
    its transport does) with a lease of ``timeout + 5`` seconds. The transport
    is ``transport`` if given, else the argv ``notify_template`` (None or an
    invalid template is a recorded transport failure, never an exception).
    No transaction is open while a transport runs. Cancellation stops the
    scan; an attempt interrupted mid-send stays ``delivering`` and is
    recovered when its lease ends.
    """
    require_store(db, "deliver_due_dispatches")
    clock = _clock(now)
    limit = require_int("batch_size", batch_size, minimum=1)
    timeout = require_number("timeout_seconds", timeout_seconds, minimum=0.0)
    lease = timeout + CLAIM_LEASE_MARGIN_SECONDS
    sender: Transport = (
        CommandTransport(notify_template, timeout=timeout)
        if transport is None
        else as_transport(transport, timeout=timeout)
    )
    counts = dict.fromkeys(COUNTER_KEYS, 0)
    rows = await db.read(partial(_select_due, now=clock(), limit=limit))
    for row in rows:
        counts["attempted"] += 1
        at = clock()
        if row["expires_at"] is not None and row["expires_at"] <= at:
            counts["expired"] += await db.write(partial(_expire, row=row, now=at, actor=actor))
            continue
        claimed = await db.write(partial(_claim, row=row, now=at, lease=lease, actor=actor))
        if isinstance(claimed, _Spent):
            counts["dead_letter"] += 1
        if not isinstance(claimed, Claim):
            continue
        result = await send_within_lease(sender, claimed, lease)
        outcome = await finish_attempt(
            db, claimed, result, now=now, retry_jitter=retry_jitter, actor=actor
        )
        tally(counts, result, outcome)
    return counts


def _decode(row: Row | None) -> dict[str, Any] | None:
    if row is None:
        return None
    out = dict(row)
    for key in ("payload", "evidence_refs", "metadata"):
        if isinstance(out.get(key), str):
            out[key] = json.loads(out[key])
    return out


def _get_row(conn: Conn, dispatch_id: str) -> Row | None:
    return conn.query_one(f"SELECT {_COLUMNS} FROM dispatch_outbox WHERE id = ?", (dispatch_id,))


async def get_dispatch(db: Database, dispatch_id: str) -> dict[str, Any] | None:
    """The dispatch's row (payload decoded), or None."""
    dispatch_id = require_dispatch_id(dispatch_id)
    if not findable(dispatch_id):
        return None
    return _decode(await db.read(partial(_get_row, dispatch_id=dispatch_id)))


async def list_dispatches(
    db: Database,
    *,
    status: str | None = None,
    limit: int = DEFAULT_LIST_LIMIT,
    kind: str | None = None,
) -> list[dict[str, Any]]:
    """Rows newest first, optionally of one ``status`` (one of the six) and
    ``kind``, at most ``limit``."""
    if status is not None and status not in lc.STATUSES:
        raise ValueError(
            f"status must be one of {', '.join(sorted(lc.STATUSES))}, got {show(status)}"
        )
    limit = require_int("limit", limit, minimum=1)
    if kind is not None:
        require_text("kind", kind)
        if not findable(kind):  # no row holds a NUL: the same answer on every engine
            return []
    clauses, params = [], []
    if status is not None:
        clauses.append("status = ?")
        params.append(status)
    if kind is not None:
        clauses.append("kind = ?")
        params.append(kind)
    where = f"WHERE {' AND '.join(clauses)} " if clauses else ""
    sql = (
        f"SELECT {_COLUMNS} FROM dispatch_outbox {where}"
        "ORDER BY created_at DESC, id DESC LIMIT ?"
    )
    rows = await db.read(lambda conn: conn.query(sql, (*params, limit)))
    return [row for row in map(_decode, rows) if row is not None]


async def list_transitions(db: Database, dispatch_id: str) -> list[dict[str, Any]]:
    """The dispatch's ``status_transitions`` rows, oldest first (kept after
    the dispatch itself is purged)."""
    dispatch_id = require_dispatch_id(dispatch_id)
    if not findable(dispatch_id):
        return []
    rows = await db.read(
        lambda conn: conn.query(
            "SELECT * FROM status_transitions WHERE entity_type = ? AND entity_id = ? "
            "ORDER BY id",
            (lc.ENTITY_TYPE, dispatch_id),
        )
    )
    return [row for row in map(_decode, rows) if row is not None]


def _cas_status(
    conn: Conn,
    row: Row,
    to_status: str,
    reason: str,
    summary: str,
    *,
    source: str,
    actor: str,
    now: float,
    assignments: str = "",
    params: Sequence[Any] = (),
) -> bool:
    """Move ``row`` to ``to_status`` if it still has the status it was read
    with; record the transition. False (nothing written) on a conflict."""
    changed = conn.execute(
        f"UPDATE dispatch_outbox SET status = ?, updated_at = ?{assignments} "
        "WHERE id = ? AND status = ?",
        (to_status, now, *params, row["id"], row["status"]),
    )
    if changed:
        _record(conn, row["id"], row["status"], to_status, reason, summary,
                source=source, actor=actor, now=now)
    return bool(changed)


async def ack_dispatch(
    db: Database,
    dispatch_id: str,
    ack_token: str,
    *,
    now: float | None = None,
    actor: str = "ack_dispatch",
) -> bool:
    """Acknowledge a dispatch with its token; True if it moved to ``acked``.

    Raises ``LookupError`` if the row does not exist, ``ValueError`` if it
    did not ask for acknowledgement or the token does not match (compared in
    constant time), and :class:`InvalidTransition` if its status has no edge
    to ``acked`` (delivered, acked, dead_letter, expired). Returns False if
    the row's status changed between the read and the write.
    """
    dispatch_id = require_dispatch_id(dispatch_id)
    if not findable(dispatch_id):
        raise LookupError(f"dispatch {dispatch_id!r} not found")
    clock = _clock(now)
    row = await db.read(partial(_get_row, dispatch_id=dispatch_id))
    if row is None:
        raise LookupError(f"dispatch {dispatch_id!r} not found")
    if not row["ack_required"]:
        raise ValueError(f"dispatch {dispatch_id!r} did not request acknowledgement")
    if not isinstance(ack_token, str):
        raise TypeError(f"ack_token must be a str, got {show(ack_token)}")
    stored = row["ack_token"]
    if not isinstance(stored, str) or not stored:
        # Never compare against a stand-in ("None"): no token, no ack.
        raise ValueError(f"dispatch {dispatch_id!r} has no ack token: it cannot be acknowledged")
    given = ack_token.encode("utf-8", "surrogatepass")
    if not hmac.compare_digest(given, stored.encode("utf-8")):
        raise ValueError(f"ack token does not match dispatch {dispatch_id!r}")
    lc.check_edge(dispatch_id, row["status"], lc.ACKED, source=lc.SOURCE_CONSUMER)
    return await db.write(
        lambda conn: _cas_status(
            conn,
            row,
            lc.ACKED,
            lc.CONSUMER_ACK,
            f"acknowledged after attempt {row['attempt']}",
            source=lc.SOURCE_CONSUMER,
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
) -> bool:
    """Operator retry of a ``dead_letter`` or ``expired`` dispatch: back to
    ``pending`` with ``attempt = 0``, due now, ``last_error`` cleared.

    Returns False if the row does not exist or its status changed
    concurrently; raises :class:`InvalidTransition` for any other status.
    ``expires_at`` (a time, or None for no expiry) replaces the row's expiry;
    by default it is kept, so retrying an expired row whose deadline is
    still past sends it nowhere: the next scan expires it again.
    """
    dispatch_id = require_dispatch_id(dispatch_id)
    if not findable(dispatch_id):
        return False
    clock = _clock(now)
    assignments = ", attempt = 0, next_attempt_at = ?, last_error = NULL"
    if expires_at is not _Keep.KEEP and expires_at is not None:
        require_number("expires_at", expires_at)
    row = await db.read(partial(_get_row, dispatch_id=dispatch_id))
    if row is None:
        return False
    if row["status"] not in (lc.DEAD_LETTER, lc.EXPIRED):
        raise lc.InvalidTransition(
            dispatch_id, row["status"], lc.PENDING,
            "operator retry is only for dead_letter or expired dispatches",
        )
    lc.check_edge(dispatch_id, row["status"], lc.PENDING, source=lc.SOURCE_OPERATOR)

    def retry(conn: Conn) -> bool:
        at = clock()
        extra, params = assignments, list[Any]([at])
        if expires_at is not _Keep.KEEP:
            extra += ", expires_at = ?"
            params.append(expires_at)
        return _cas_status(
            conn,
            row,
            lc.PENDING,
            lc.OPERATOR_RETRY,
            f"operator retry from {row['status']} after attempt {row['attempt']}",
            source=lc.SOURCE_OPERATOR,
            actor=actor,
            now=at,
            assignments=extra,
            params=params,
        )

    return await db.write(retry)


def _delete(conn: Conn, row: Row, reason: str, summary: str, actor: str, now: float) -> bool:
    deleted = conn.execute(
        "DELETE FROM dispatch_outbox WHERE id = ? AND status = ?", (row["id"], row["status"])
    )
    if deleted:
        _record(conn, row["id"], row["status"], lc.PURGED, reason, summary,
                source=lc.SOURCE_OPERATOR, actor=actor, now=now,
                metadata={"attempt": row["attempt"], "kind": row["kind"]})
    return bool(deleted)


async def purge_dispatch(
    db: Database, dispatch_id: str, *, now: float | None = None, actor: str = "purge_dispatch"
) -> bool:
    """Delete one dispatch in any status and record a
    ``dispatch.purged.operator`` transition in the same transaction. Returns
    whether a row was deleted. Its transition history is kept."""
    dispatch_id = require_dispatch_id(dispatch_id)
    if not findable(dispatch_id):
        return False
    clock = _clock(now)

    def purge(conn: Conn) -> bool:
        row = conn.query_one(
            "SELECT id, status, attempt, kind FROM dispatch_outbox WHERE id = ?", (dispatch_id,)
        )
        if row is None:
            return False
        return _delete(conn, row, lc.PURGED_OPERATOR, f"purged from {row['status']}",
                       actor, clock())

    return await db.write(purge)


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
    """
    clock = _clock(now)
    if older_than is not None:
        older_than = require_number("older_than", older_than, minimum=0.0)
    if statuses is None:
        chosen = sorted(lc.TERMINAL_STATUSES)
    else:
        if isinstance(statuses, str):
            raise TypeError(f"statuses must be a list of statuses, got {show(statuses)}")
        chosen = sorted(set(statuses))
        for status in chosen:
            if status not in lc.TERMINAL_STATUSES:
                raise ValueError(
                    f"prune can only remove finished dispatches "
                    f"({', '.join(sorted(lc.TERMINAL_STATUSES))}), got {show(status)}"
                )
    require_bool("dry_run", dry_run)
    at = clock()
    cutoffs = {
        status: at - (DEFAULT_RETENTION_SECONDS[status] if older_than is None else older_than)
        for status in chosen
    }
    # Statuses are inlined (from the closed set, validated above) so the
    # planner can use the finished-age index.
    age = "COALESCE(updated_at, created_at)"
    if dry_run:
        def count(conn: Conn) -> int:
            total = 0
            for status, cutoff in cutoffs.items():
                row = conn.query_one(
                    f"SELECT COUNT(*) AS n FROM dispatch_outbox WHERE {FINISHED_STATUSES_SQL} "
                    f"AND status = '{status}' AND {age} <= ?", (cutoff,)
                )
                total += int(row["n"]) if row else 0
            return total

        return await db.read(count)

    def prune_chunk(conn: Conn) -> int:
        removed = 0
        for status, cutoff in cutoffs.items():
            rows = conn.query(
                f"SELECT id, status, attempt, kind FROM dispatch_outbox "
                f"WHERE {FINISHED_STATUSES_SQL} AND status = '{status}' AND {age} <= ? LIMIT ?",
                (cutoff, PRUNE_CHUNK - removed),
            )
            for row in rows:
                removed += _delete(conn, row, lc.PURGED_RETENTION,
                                   f"retention: {status} older than cutoff", actor, at)
            if removed >= PRUNE_CHUNK:
                break
        return removed

    total = 0
    while True:
        removed = await db.write(prune_chunk)
        total += removed
        if removed < PRUNE_CHUNK:
            return total


async def dispatch_stats(db: Database, *, now: float | None = None) -> dict[str, Any]:
    """A health summary: ``counts`` per status (all six), ``total``,
    ``oldest_due_pending_age_seconds`` (how long the longest-waiting due
    pending row has been due; None when none is due) and
    ``dead_letters_last_24h`` (rows now in ``dead_letter`` that got there in
    the last 24 hours; both queries use the status indexes, never a scan of
    finished rows or history)."""
    at = _clock(now)()

    def collect(conn: Conn) -> dict[str, Any]:
        counts = dict.fromkeys(sorted(lc.STATUSES), 0)
        for row in conn.query(
            "SELECT status, COUNT(*) AS n FROM dispatch_outbox GROUP BY status"
        ):
            counts[str(row["status"])] = int(row["n"])
        oldest = conn.query_one(
            "SELECT MIN(next_attempt_at) AS due FROM dispatch_outbox "
            f"WHERE {_DUE_STATUSES_SQL} AND status = 'pending' AND next_attempt_at <= ?",
            (at,),
        )
        dead = conn.query_one(
            f"SELECT COUNT(*) AS n FROM dispatch_outbox WHERE {FINISHED_STATUSES_SQL} "
            "AND status = 'dead_letter' AND COALESCE(updated_at, created_at) >= ?",
            (at - 86400.0,),
        )
        due = None if oldest is None or oldest["due"] is None else float(oldest["due"])
        return {
            "counts": counts,
            "total": sum(counts.values()),
            "oldest_due_pending_age_seconds": None if due is None else max(0.0, at - due),
            "dead_letters_last_24h": int(dead["n"]) if dead else 0,
        }

    return await db.read(collect)
