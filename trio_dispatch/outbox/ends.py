"""How an attempt ends: the plan for each result (delivered, awaiting ack,
retry with backoff, throttled, dead letter, released), the fenced finish of
many attempts in one statement, and the finish that claims the slot's next
row in the same transaction. Every change goes through the state machine's
edge check (:func:`.machine.transition_rows`).

An attempt an operator cancelled while it ran (docs/controls.md: its row marked,
``cancel_requested_at``) ends here too. Every end is fenced on no mark, so
one that finds it writes nothing, and in the same transaction
:func:`settle_cancels` decides: an attempt that succeeded keeps its success
(the cancel came too late: the mark is taken back and the transition says
so); any other end -- a failure, a throttle, an attempt cut by the cancel
itself, one the worker's shutdown interrupted, one never made -- records
``cancelled`` (:func:`cancel_attempt`). A keyed row's next row then goes.

What the ends that applied do to their destinations -- a throttle, the
breaker's bookkeeping -- is written in the same transaction by
:func:`trio_dispatch.destinations.outcomes.record_ends`: an end fenced out
changes neither its row nor its destination.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..attempt import LAST_ERROR_LIMIT, TransportResult
from ..destinations.outcomes import (
    DEFAULT_BOOK,
    DestinationBook,
    Effects,
    Ended,
    record_ends,
    signal_of,
    throttle_wait,
)
from ..destinations.policy import MAX_THROTTLES_PER_ROW, Destination
from ..lifecycle import (
    ENTITY_TYPE,
    Reason,
    Source,
    Status,
)
from ..store.base import Conn, Row
from . import sql
from .claim import ClaimRules, claim_rules
from .ordering import lock_keys, promote
from .transitions import (
    MAX_RETRY_AFTER_SECONDS,
    Change,
    Claim,
    Outcome,
    insert_rows,
    transition_rows,
)


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
    rules: ClaimRules = dataclasses.field(default_factory=claim_rules)
    """With :func:`finish_and_claim`: the worker's claim rules (told of the
    end, and asked by the next claim)."""
    destinations: DestinationBook | None = None
    """The worker's destination policies (throttle cap, breaker); None:
    none, every destination with the defaults."""
    effects: Effects | None = dataclasses.field(default=None, compare=False)
    """Filled with what the end did to its destination's breaker."""
    too_late: Mapping[str, Any] | None = None
    """Set by :func:`settle_cancels` on a success that a cancel reached too
    late: the cancel's request, for the transition's metadata."""

    @property
    def book(self) -> DestinationBook:
        return DEFAULT_BOOK if self.destinations is None else self.destinations

    @property
    def policy(self) -> Destination:
        """The policy of the attempt's destination."""
        return self.book.policy(self.claim.deliver_to)

    @property
    def throttled(self) -> bool:
        """The destination asked to wait and the row has uncounted throttles
        left (:data:`MAX_THROTTLES_PER_ROW`): the attempt does not count.
        Past them, a throttle counts as an ordinary failure."""
        return self.result.throttled and self.claim.throttles < MAX_THROTTLES_PER_ROW

    @property
    def retry_after(self) -> float | None:
        """The destination's own "not before", if it gave one: capped at
        its policy's ``throttle_max_seconds`` for a throttle, at
        :data:`MAX_RETRY_AFTER_SECONDS` for a failure (502, 504)."""
        after = self.result.retry_after
        if after is None:
            return None
        if self.result.throttled:
            return min(after, float(self.policy.throttle_max_seconds))
        return min(after, MAX_RETRY_AFTER_SECONDS)

    @property
    def throttle_wait(self) -> float:
        """Seconds a throttle holds the destination (and a throttled row):
        the delay asked for, or the row's next backoff step, capped."""
        return throttle_wait(self.result.retry_after, self.delay, self.policy)

    @property
    def wait(self) -> float:
        """Seconds until the row is due again: a throttled attempt's
        :attr:`throttle_wait`; else the schedule's delay, or the
        destination's ``Retry-After`` if that is later."""
        if self.throttled:
            return self.throttle_wait
        after = self.retry_after
        return self.delay if after is None else max(self.delay, after)

    def ended(self) -> Ended:
        """The end as its destination sees it (once it applied)."""
        result, claim = self.result, self.claim
        return Ended(
            claim.deliver_to,
            claim.dispatch_id,
            claim.lease_until,
            signal_of(result),
            self.now,
            self.actor,
            DEFAULT_BOOK if self.destinations is None else self.destinations,
            self.now + self.throttle_wait if result.throttled else None,
            result.error,
            self.effects,
        )


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
        Source.DELIVERY,
        end.actor,
        end.now,
        metadata,
    )


def plan_end(end: AttemptEnd) -> tuple[Outcome, Status, Reason, str, str | None]:
    """(outcome, new status, reason code, summary, last_error) of one
    attempt's end (docs/lifecycle.md)."""
    claim, result, delay = end.claim, end.result, end.wait
    attempts_left = claim.attempts_left
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
            f"sent {claim.counted} of {claim.max_attempts} times without an ack",
            None,
        )
    error = (result.error or "transport failed")[:LAST_ERROR_LIMIT]
    if end.throttled:
        return (
            Outcome.THROTTLED,
            Status.PENDING,
            Reason.THROTTLED,
            f"attempt {claim.attempt} throttled by the destination, not counted "
            f"({claim.throttles + 1} of {MAX_THROTTLES_PER_ROW}); due in {delay:g}s: "
            f"{error[:200]}",
            error,
        )
    failed = (
        f"throttled past its {MAX_THROTTLES_PER_ROW} uncounted throttles"
        if result.throttled
        else "failed"
    )
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
            f"attempt {claim.counted} {failed}; retry in {delay:g}s: {error[:200]}",
            error,
        )
    return (
        Outcome.DEAD_LETTER,
        Status.DEAD_LETTER,
        Reason.MAX_ATTEMPTS,
        f"attempt {claim.counted} of {claim.max_attempts} {failed}: {error[:200]}",
        error,
    )


def finish_many(conn: Conn, ends: list[AttemptEnd]) -> list[Outcome]:
    """Record attempt ends -- status, due time, ``last_error`` and transition
    together (docs/guarantees.md) -- each fenced on its claim; an end whose row moved
    on is a CONFLICT and writes nothing. One UPDATE for all of them, one
    INSERT batch. A keyed row that leaves the live set makes the next row
    of its key due (:mod:`.ordering`). A throttled end adds one to its
    row's ``throttles``. Then, for the ends that applied, what they do to
    their destinations (a throttle, the breaker's bookkeeping), in the same
    transaction (:func:`~trio_dispatch.destinations.outcomes.record_ends`)."""
    for end in ends:
        if end.effects is not None:  # this run's, not a rolled-back one's
            end.effects.clear()
    outcomes = _finish_rows(conn, ends)
    conflicted = [index for index, outcome in enumerate(outcomes) if outcome is Outcome.CONFLICT]
    if conflicted:  # fenced out: moved on, or an operator's cancel marks it
        settled = settle_cancels(conn, [ends[index] for index in conflicted])
        for index, outcome in zip(conflicted, settled, strict=True):
            outcomes[index] = outcome
    # A cancelled attempt is neither a success nor a failure of its
    # destination: its breaker and throttle hear nothing of it.
    applied = [
        end.ended()
        for end, outcome in zip(ends, outcomes, strict=True)
        if outcome not in (Outcome.CONFLICT, Outcome.CANCELLED)
    ]
    if applied:
        record_ends(conn, applied)
    return outcomes


def _finish_rows(conn: Conn, ends: list[AttemptEnd]) -> list[Outcome]:
    """:func:`finish_many`'s rows: the finish itself, without the
    destinations."""
    lock_keys(conn, [end.claim.ordering_key for end in ends])
    if any(end.result.local and not end.result.ok for end in ends):
        # Attempts never made: released, their attempt taken back.
        outcomes: list[Outcome] = []
        for end in ends:
            local = end.result.local and not end.result.ok
            outcomes += [give_back(conn, end)] if local else _finish_rows(conn, [end])
        return outcomes
    if len({end.claim.dispatch_id for end in ends}) < len(ends):
        # Two claims of one row (a stale one among them): RETURNING cannot
        # tell which matched, so settle them one at a time.
        return [outcome for end in ends for outcome in _finish_rows(conn, [end])]
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
        if end.too_late is not None:
            metadata["cancel"] = {"too_late": True, **end.too_late}
        if reason is Reason.THROTTLED:
            metadata["throttle"] = {
                "delay_seconds": end.wait,
                "until": next_at,
                "throttles": claim.throttles + 1,
            }
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
    # PostgreSQL: the transition rows are written by the finish's own
    # statement, for the ends that applied (one actor per worker's batch).
    arrays = conn.dialect.arrays
    recorded = arrays is not None and len({end.actor for end in ends}) == 1
    if arrays is not None:  # one array per column, the same text every time
        columns = [params[i::7] for i in range(7)]
        for i in (2, 4, 5):  # float8[]: one type per array, whatever the clock gave
            columns[i] = [float(v) for v in columns[i]]
        if recorded:
            columns += [[row[i] for row in history] for i in (4, 5, 9)]
            finished = conn.query(
                sql.finish_attempts_recorded(arrays),
                [*columns, ENTITY_TYPE, Source.DELIVERY, ends[0].actor],
            )
        else:
            finished = conn.query(sql.finish_attempts_arrays(arrays), columns)
    else:
        finished = conn.query(sql.finish_attempts(len(ends)), params)
    applied = {row["id"] for row in finished}
    throttled = [
        end.claim.dispatch_id
        for end, plan in zip(ends, plans, strict=True)
        if plan[0] is Outcome.THROTTLED and end.claim.dispatch_id in applied
    ]
    if throttled:  # the attempts keep their numbers; the budget leaves them out
        if arrays is not None:
            conn.execute(sql.count_throttles_many(arrays), [throttled])
        else:
            conn.execute(sql.count_throttles(len(throttled)), throttled)
    promote(
        conn,
        [
            end.claim.ordering_key
            for end, plan in zip(ends, plans, strict=True)
            if end.claim.dispatch_id in applied and plan[1] != Status.PENDING
        ],
        max(end.now for end in ends),
    )
    if not recorded:
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


def release(
    conn: Conn, claim: Claim, now: float, actor: str, why: str = "worker shutdown"
) -> Outcome:
    """Give back an attempt that ``why`` (worker shutdown, a
    KeyboardInterrupt) interrupted: pending, due at once; or, if it was the
    last attempt allowed and may have reached the destination,
    dead-lettered (the same end as a claimant that died)."""
    if not claim.attempts_left:
        status, reason, outcome = Status.DEAD_LETTER, Reason.MAX_ATTEMPTS, Outcome.DEAD_LETTER
        summary = f"{why} interrupted attempt {claim.counted} of {claim.max_attempts}"
    else:
        status, reason, outcome = Status.PENDING, Reason.RELEASED, Outcome.RELEASED
        summary = f"{why} interrupted attempt {claim.attempt}; due now"
    change = Change(
        claim.dispatch_id,
        Status.DELIVERING,
        status,
        reason,
        summary,
        Source.DELIVERY,
        actor,
        now,
        {"attempt": claim.attempt},
    )
    history = transition_rows([change])
    lock_keys(conn, [claim.ordering_key])
    if not conn.execute(
        sql.RELEASE, (status, now, now, claim.dispatch_id, claim.attempt, claim.lease_until)
    ):
        # An operator's cancel reached it: the interrupted attempt is cancelled.
        summary = f"{why} interrupted attempt {claim.attempt}, which an operator had cancelled"
        cancelled = cancel_attempt(
            conn,
            claim.dispatch_id,
            claim.attempt,
            claim.lease_until,
            claim.ordering_key,
            now=now,
            actor=actor,
            source=Source.DELIVERY,
            summary=summary,
        )
        return Outcome.CANCELLED if cancelled else Outcome.CONFLICT
    if status != Status.PENDING:
        promote(conn, [claim.ordering_key], now)
    insert_rows(conn, history)
    return outcome


# -- cancels (docs/controls.md) ------------------------------------------------


def cancel_request(text: object) -> dict[str, Any]:
    """A cancel's request as stored (JSON text: who asked, why, from where),
    as a mapping; anything unreadable is kept as text, never an error."""
    if not isinstance(text, str) or not text:
        return {}
    try:
        found = json.loads(text)
    except ValueError:
        return {"request": text}
    return dict(found) if isinstance(found, dict) else {"request": found}


def cancel_attempt(
    conn: Conn,
    dispatch_id: str,
    attempt: int,
    lease_until: float,
    ordering_key: str | None,
    *,
    now: float,
    actor: str,
    source: Source,
    summary: str,
    metadata: Mapping[str, Any] | None = None,
) -> bool:
    """End the attempt ``(attempt, lease_until)`` of a delivering row as
    ``cancelled`` (``dispatch.cancelled.operator``), fenced on that claim,
    with the cancel's request (who asked, when, why) and ``metadata`` in
    the transition; a keyed row's next row goes. False (nothing written)
    if the row moved on. The caller holds the key's lock."""
    found = conn.query_one(sql.CANCEL_REQUEST, (dispatch_id, attempt, lease_until))
    if found is None:
        return False
    note: dict[str, Any] = {"attempt": attempt}
    if found["cancel_requested_at"] is not None:
        note["requested_at"] = found["cancel_requested_at"]
        note.update(cancel_request(found["cancel_request"]))
    note.update(metadata or {})
    change = Change(
        dispatch_id,
        Status.DELIVERING,
        Status.CANCELLED,
        Reason.CANCELLED_OPERATOR,
        summary,
        source,
        actor,
        now,
        note,
    )
    history = transition_rows([change])
    if not conn.execute(sql.CANCEL_ATTEMPT, (now, dispatch_id, attempt, lease_until)):
        return False
    promote(conn, [ordering_key], now)
    insert_rows(conn, history)
    return True


def marked(conn: Conn, ids: Sequence[str]) -> dict[str, Row]:
    """The rows among ``ids`` that are delivering with a cancel asked for,
    by id (each with its ``attempt`` and lease, ``next_attempt_at``)."""
    if not ids:
        return {}
    arrays = conn.dialect.arrays
    if arrays is not None:
        rows = conn.query(sql.marked_attempts_many(arrays), [list(ids)])
    else:
        rows = conn.query(sql.marked_attempts(len(ids)), list(ids))
    return {str(row["id"]): row for row in rows}


def is_attempt(row: Row | None, claim: Claim) -> bool:
    """Whether ``row`` (a marked row as :func:`marked` read it) is still at
    ``claim``'s attempt, under its lease."""
    return (
        row is not None
        and int(row["attempt"]) == claim.attempt
        and float(row["next_attempt_at"]) == claim.lease_until
    )


def settle_cancels(conn: Conn, ends: list[AttemptEnd]) -> list[Outcome]:
    """The ends the fenced finish left out: each whose row is still at its
    attempt with a cancel asked for is settled now, in the finish's
    transaction (the row stays locked to it): a success is recorded as it
    would have been, the cancel taken back and named in the transition
    (too late); any other end records ``cancelled``. An end whose row
    moved on for another reason stays a CONFLICT."""
    found = marked(conn, [end.claim.dispatch_id for end in ends])
    outcomes: list[Outcome] = []
    for end in ends:
        claim = end.claim
        row = found.get(claim.dispatch_id)
        if not is_attempt(row, claim):
            outcomes.append(Outcome.CONFLICT)
            continue
        fence = (claim.dispatch_id, claim.attempt, claim.lease_until)
        if end.result.ok:  # it succeeded before the cancel reached it
            request = conn.query_one(sql.CANCEL_REQUEST, fence)
            conn.execute(sql.UNMARK, fence)
            note = {} if request is None else cancel_request(request["cancel_request"])
            if request is not None:
                note["requested_at"] = request["cancel_requested_at"]
            if end.effects is not None:
                end.effects.too_late = True
            [outcome] = _finish_rows(conn, [dataclasses.replace(end, too_late=note)])
            outcomes.append(outcome)
            continue
        what = "cut by" if end.result.cancelled else "failed after"
        cancelled = cancel_attempt(
            conn,
            claim.dispatch_id,
            claim.attempt,
            claim.lease_until,
            claim.ordering_key,
            now=end.now,
            actor=end.actor,
            source=Source.DELIVERY,
            summary=f"attempt {claim.attempt} {what} an operator's cancel; cancelled",
            # An attempt that failed by itself first says how.
            metadata=None if end.result.cancelled else {"error": (end.result.error or "")[:200]},
        )
        outcomes.append(Outcome.CANCELLED if cancelled else Outcome.CONFLICT)
    return outcomes
