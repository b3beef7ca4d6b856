"""The state machine's claims, the finish that claims a slot's next row,
and the operators' and consumers' compare-and-set writes.

Every function here is a unit of work (or part of one): it runs inside one
transaction on the store's thread, never awaits, and writes a status change
together with its ``status_transitions`` row, so both commit or neither
does. The vocabulary and the one edge check are in :mod:`.transitions`, the
inserts of enqueue in :mod:`.inserts`, the ends of attempts in :mod:`.ends`;
together these four are the only modules that write
``dispatch_outbox.status``.

Every change that ends an attempt is fenced on the claim it ends: status
``delivering``, its attempt and its lease end. A claimant whose lease another
worker recovered can never overwrite the newer attempt (docs/guarantees.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, NamedTuple

from ..attempt import TransportResult
from ..lifecycle import (
    DUE_STATUSES,
    ENTITY_TYPE,
    PURGED,
    Reason,
    Source,
    Status,
    check_edge,
)
from ..redact import scrubbed_logger, visible
from ..store.base import Conn, Row, undecodable_columns
from ..store.schema import EXPIRY_INDEX
from . import sql
from .claim import ClaimRules, claim_rules
from .claim.rules import Claiming
from .claim.scan import select_due
from .claim.statements import select_if_due
from .ends import AttemptEnd as AttemptEnd
from .ends import cancel_attempt as cancel_attempt
from .ends import finish_many as finish_many
from .ends import give_back as give_back
from .ends import plan_end as plan_end
from .ends import release as release
from .ordering import lock_keys, promote, try_lock_keys
from .transitions import COUNTER_KEYS as COUNTER_KEYS
from .transitions import MAX_RETRY_AFTER_SECONDS as MAX_RETRY_AFTER_SECONDS
from .transitions import Change as Change
from .transitions import Claim as Claim
from .transitions import EnqueueResult as EnqueueResult
from .transitions import NewDispatch as NewDispatch
from .transitions import Outcome as Outcome
from .transitions import insert_rows as insert_rows
from .transitions import record as record
from .transitions import transition_rows as transition_rows

log = scrubbed_logger("trio_dispatch.outbox")

# -- claims ----------------------------------------------------------------------


def _deadline(row: Row, previous: str, now: float, actor: str) -> Change:
    """The change that expires ``row`` (read with status ``previous``): the
    one transition row of every expiry, the claim's and the sweep's."""
    return Change(
        row["id"],
        previous,
        Status.EXPIRED,
        Reason.DEADLINE,
        f"expires_at {row['expires_at']} passed before attempt {row['attempt'] + 1}",
        Source.DELIVERY,
        actor,
        now,
        {"expires_at": row["expires_at"], "attempt": row["attempt"]},
    )


def expire(conn: Conn, row: Row, now: float, actor: str) -> bool:
    """A due row past ``expires_at`` becomes ``expired`` (guarded on the
    status and attempt it was read with)."""
    history = transition_rows([_deadline(row, row["status"], now, actor)])
    changed = conn.execute(sql.EXPIRE, (now, row["id"], row["status"], row["attempt"], now))
    if changed:
        insert_rows(conn, history)
    return bool(changed)


def spent(row: Row) -> bool:
    """Whether ``row``'s current attempt was its last allowed one: its
    number less its throttled attempts (which do not count:
    docs/destinations.md#throttling) has reached ``max_attempts``."""
    return bool(row["attempt"] - row["throttles"] >= row["max_attempts"])


def spend(conn: Conn, row: Row, now: float, actor: str) -> bool:
    """A delivering row whose lease ran out during its last allowed attempt
    (:func:`spent`) is dead-lettered instead of sent again (``max_attempts``
    bounds every send)."""
    attempt = row["attempt"]
    change = Change(
        row["id"],
        Status.DELIVERING,
        Status.DEAD_LETTER,
        Reason.MAX_ATTEMPTS,
        f"lease expired during attempt {attempt - row['throttles']} of {row['max_attempts']}",
        Source.DELIVERY,
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


class Swept(NamedTuple):
    """What one batch of the expiry sweep did."""

    read: int
    """Rows past their deadline it read (at most its limit: fewer says none
    is left that another transaction did not hold)."""
    expired: int
    """Rows it expired."""


def expire_overdue(conn: Conn, at: float, limit: int, actor: str) -> Swept:
    """One batch of the expiry sweep: up to ``limit`` rows past their
    ``expires_at`` at ``at``, earliest deadline first, become ``expired``
    with the claim's transition (``dispatch.expired.deadline``), whatever
    keeps them from a claim (a paused, throttled, open or full destination,
    a worker's cap, a key's head ahead of them). Pending rows expire
    whenever their deadline has passed; a delivering row only once its
    lease has ended (as a claim would find it); one whose lease runs is
    left to its attempt's end. Read and written in this one transaction:
    rows are locked as they are read where rows lock, a row or an ordering
    key another transaction holds is passed over (a later batch takes it),
    and each write restates the guard, so two sweeps of the same rows
    expire each once. A keyed row that leaves the live set makes the next
    row of its key due, as at a claim (under ``block`` an expired head then
    holds its key)."""
    at = float(at)  # one type for every time a statement compares
    dialect = conn.dialect
    statement = sql.overdue(dialect.row_key, dialect.use_index(EXPIRY_INDEX), dialect.lock_clause)
    rows = conn.query(statement, (at, at, limit))
    taken = try_lock_keys(conn, [row["ordering_key"] for row in rows])
    changes: list[Change] = []
    keys: list[str | None] = []
    for previous in DUE_STATUSES:
        group = [
            row
            for row in rows
            if row["status"] == previous
            and (row["ordering_key"] is None or row["ordering_key"] in taken)
        ]
        if not group:
            continue
        for row in group:  # every edge checked before the UPDATE runs
            check_edge(row["id"], previous, Status.EXPIRED, source=Source.DELIVERY)
        row_keys = [row["row_key"] for row in group]
        won = (
            conn.query(sql.expire_rows_many(dialect.arrays), (at, row_keys, previous, at, at))
            if dialect.arrays is not None
            else conn.query(
                sql.expire_rows(dialect.row_key, len(group)), (at, *row_keys, previous, at, at)
            )
        )
        # The rows as read (SQLite's RETURNING gives a REAL column's
        # whole numbers as integers): the transitions say what a claim's do.
        changed = {row["id"] for row in won}
        for row in group:
            if row["id"] in changed:
                changes.append(_deadline(row, previous, at, actor))
                keys.append(row["ordering_key"])
    promote(conn, keys, at)
    record(conn, changes)
    return Swept(len(rows), len(changes))


_DEFAULT_RULES: Final = claim_rules()

_SCAN_COLUMNS: Final = (
    "id, {row_key} AS row_key, status, attempt, max_attempts, expires_at, next_attempt_at, "
    "created_at, deliver_to, ordering_key, throttles, cancel_requested_at"
)


def claim_batch(
    conn: Conn,
    at: float,
    limit: int,
    lease: float,
    actor: str,
    *,
    ids: Sequence[str] | None = None,
    rules: ClaimRules | None = None,
) -> tuple[list[Claim], dict[str, int]]:
    """The claim: one indexed select of up to ``limit`` due rows (locked
    where rows lock) -- or, given ``ids``, those rows if they are still due
    -- then in the same transaction expire those past their deadline,
    dead-letter spent ones, and claim the rest with one statement per
    previous status, each leased until ``at + lease``. Returns the claims
    in scan order and the scan's counters (``attempted``, ``expired``,
    ``dead_letter``; the others 0). A delivering row whose lease ran out
    with a cancel asked for (its worker died, or never heard it) is
    recorded ``cancelled`` instead of attempted again (docs/controls.md). ``rules`` (default
    :func:`~.claim.claim_rules`: the ordering keys' rule, ``block``) decide
    what the claim may take, at their five points (:mod:`.claim.rules`):
    only rows their term allows are read, their left-out destinations are
    never read, the candidates they do not take are left alone, the rows
    they do not admit are not claimed, and they hear of the claims made. A
    keyed row that leaves the live set here makes the next row of its key
    due."""
    rules = _DEFAULT_RULES if rules is None else rules
    counts = dict.fromkeys(COUNTER_KEYS, 0)
    columns = _SCAN_COLUMNS.format(row_key=conn.dialect.row_key)
    rules.sync(conn, at)
    bounds = rules.bounds(conn, at)
    if ids is None:
        # Bounded whatever the left-out destinations hold (see .claim.scan).
        rows = select_due(conn, at, limit, columns, lock=True, rules=rules, bounds=bounds)
    else:
        statement = select_if_due(columns, conn.dialect.lock_clause, rules.term)
        rows = [
            row
            for dispatch_id in ids[:limit]
            for row in conn.query(statement, (dispatch_id, at))
            if row["deliver_to"] not in bounds.skip
        ]
    claiming = Claiming(at, at + lease, actor, bounds, rules.term)
    # The starts' stamps: the time the rules decided at, where they read
    # the store's clock (a rate is exact in it); the leases stay on ``at``.
    stamp = at if bounds.clock is None else bounds.clock
    rows = rules.take(conn, rows, claiming)
    counts["attempted"] = len(rows)
    starting: list[Row] = []
    for row in rows:
        if row["status"] == Status.DELIVERING and row["cancel_requested_at"] is not None:
            cancel_attempt(
                conn,
                row["id"],
                row["attempt"],
                row["next_attempt_at"],
                row["ordering_key"],
                now=at,
                actor=actor,
                source=Source.DELIVERY,
                summary=f"lease of attempt {row['attempt']} expired after an operator's cancel; "
                "cancelled instead of attempted again",
            )
        elif row["expires_at"] is not None and row["expires_at"] <= at:
            counts["expired"] += expire(conn, row, at, actor)
        elif row["status"] == Status.DELIVERING and spent(row):
            counts["dead_letter"] += spend(conn, row, at, actor)
        else:
            starting.append(row)
    if len(starting) < len(rows):
        kept = {row["id"] for row in starting}
        promote(conn, [row["ordering_key"] for row in rows if row["id"] not in kept], at)
    fresh: dict[Status, list[Row]] = {Status.PENDING: [], Status.DELIVERING: []}
    for row in rules.admit(conn, starting, claiming):
        fresh[Status(row["status"])].append(row)
    order = {row["id"]: index for index, row in enumerate(rows)}
    lease_until = claiming.lease_until
    claims: list[Claim] = []
    spoiled: list[tuple[Claim, list[str]]] = []
    changes: list[Change] = []
    for previous, group in fresh.items():
        if not group:
            continue
        for row in group:  # every edge checked before the UPDATE runs
            check_edge(row["id"], previous, Status.DELIVERING, source=Source.DELIVERY)
        # Selected in this same write transaction, so (status, attempt) are
        # still what was read, and the row key still names the same row; the
        # status guard restates it for the record.
        keys = [row["row_key"] for row in group]
        recovered = previous == Status.DELIVERING
        # Where the engine can: the transition rows written by the same
        # statement, from the rows it updated (the edge was checked above).
        arrays = conn.dialect.arrays
        recorded = arrays is not None
        won = (
            conn.query(
                sql.claim_rows_recorded(arrays),
                (
                    lease_until,
                    stamp,
                    keys,
                    previous,
                    ENTITY_TYPE,
                    previous,
                    Reason.ATTEMPT,
                    "lease expired; " if recovered else "",
                    Source.DELIVERY,
                    actor,
                    repr(lease_until),
                    stamp,
                ),
            )
            if arrays is not None
            else conn.query(
                sql.claim_rows(conn.dialect.row_key, len(group)),
                (lease_until, stamp, *keys, previous),
            )
        )
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
                ordering_key=row["ordering_key"],
                throttles=row["throttles"],
            )
            if unreadable := undecodable_columns(row):
                spoiled.append((claim, unreadable))
            else:
                claims.append(claim)
            if recorded:
                continue
            changes.append(
                Change(
                    row["id"],
                    previous,
                    Status.DELIVERING,
                    Reason.ATTEMPT,
                    f"{'lease expired; ' if recovered else ''}attempt {row['attempt']} of "
                    f"{row['max_attempts']}",
                    Source.DELIVERY,
                    actor,
                    stamp,
                    f'{{"attempt": {row["attempt"]}, "lease_until": {lease_until!r}}}',
                )
            )
    record(conn, changes)
    if spoiled:
        counts["dead_letter"] += _dead_letter_unreadable(conn, spoiled, at, actor)
    claims.sort(key=lambda claim: order[claim.dispatch_id])
    rules.claimed(conn, claims, claiming)
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


# -- the finish that claims the next row ------------------------------------------


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
    Key = tuple[float, str, Callable[[], float] | None, ClaimRules]
    groups: dict[Key, list[int]] = {}
    for index, end in enumerate(ends):
        # The ended attempts make room first.
        end.rules.ended([(end.claim.dispatch_id, end.claim.lease_until)])
        key = (end.next_lease, end.actor, end.clock, end.rules)
        groups.setdefault(key, []).append(index)
    for (lease, actor, clock, rules), indexes in groups.items():
        assert clock is not None
        claims, scanned = claim_batch(conn, clock(), len(indexes), lease, actor, rules=rules)
        counts[indexes[0]] = scanned
        for index, claim in zip(indexes, claims, strict=False):
            nexts[index] = claim
    return list(zip(outcomes, nexts, counts, strict=True))


def finish_and_claim_ahead(
    conn: Conn, ends: list[AttemptEnd], want: int
) -> tuple[list[Outcome], list[Claim], dict[str, int]]:
    """:func:`finish_many`, and in the same transaction claim up to
    ``want`` due rows for the worker to hold ahead of its slots (the ends'
    first gives the lease, actor, clock and rules; the rules hear of every
    end first). Returns the outcomes in order, the claims and the scan's
    counters."""
    outcomes = finish_many(conn, ends)
    first = ends[0]
    first.rules.ended([(end.claim.dispatch_id, end.claim.lease_until) for end in ends])
    assert first.clock is not None
    if want <= 0:
        first.rules.sync(conn, first.clock())
        return outcomes, [], dict.fromkeys(COUNTER_KEYS, 0)
    claims, scanned = claim_batch(
        conn, first.clock(), want, first.next_lease, first.actor, rules=first.rules
    )
    return outcomes, claims, scanned


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
    metadata: Mapping[str, Any] | None = None,
) -> bool:
    """Move ``row`` to ``to_status`` if it still has the status it was read
    with, and record the transition (with ``metadata``, e.g. the client
    address of a dashboard action). False (nothing written) on a conflict.
    A keyed row that leaves the live set makes the next row of its key due."""
    change = Change(
        row["id"], row["status"], to_status, reason, summary, source, actor, now, metadata
    )
    history = transition_rows([change])
    key = row.get("ordering_key")
    lock_keys(conn, [key])
    changed = conn.execute(
        sql.set_status(assignments), (to_status, now, *params, row["id"], row["status"])
    )
    if changed:
        if to_status not in DUE_STATUSES:
            promote(conn, [key], now)
        insert_rows(conn, history)
    return bool(changed)


def delete(
    conn: Conn,
    row: Row,
    reason: Reason,
    summary: str,
    actor: str,
    now: float,
    metadata: Mapping[str, Any] | None = None,
) -> bool:
    """Remove a row (purge or retention) if it still has the status it was
    read with, recording who and when (and ``metadata``): its history is
    kept (docs/lifecycle.md)."""
    change = Change(
        row["id"],
        row["status"],
        PURGED,
        reason,
        summary,
        Source.OPERATOR,
        actor,
        now,
        {"attempt": row["attempt"], "kind": row["kind"], **(metadata or {})},
    )
    history = transition_rows([change])
    key = row.get("ordering_key")
    lock_keys(conn, [key])
    deleted = conn.execute(sql.DELETE, (row["id"], row["status"], row["attempt"], now))
    if deleted:
        promote(conn, [key], now)
        insert_rows(conn, history)
    return bool(deleted)
