"""Delivery (ADR D3-D5): claim due rows, call the transport outside any
transaction, record each attempt's end.

A delivery is three steps: a claim (one transaction), the transport call
(none), a finish (one transaction). :func:`claim_due` is the one claim path,
for :func:`deliver_due_dispatches` and the worker alike; :func:`attempt_deadline`
is the one place that turns a claim's lease into the deadline its transport
call is cut at, so no second claimant can ever overlap a send.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Final

import anyio

from ..backoff import check_retry_schedule, jittered_backoff
from ..lifecycle import ACTOR_DELIVERY
from ..redact import MASK
from ..settings import (
    CLAIM_LEASE_MARGIN_SECONDS,
    DEFAULT_BATCH_SIZE,
    LEASE_SAFETY_SECONDS,
    MIN_LEASE_MARGIN_SECONDS,
)
from ..store.base import Database
from ..transports import (
    NOTIFY_TIMEOUT_SECONDS,
    CommandTransport,
    Transport,
    TransportResult,
    as_transport,
    describe_exception,
    is_interrupt,
    must_propagate,
    opened,
)
from ..validate import clock_from, require_int, require_number
from ..values import show
from .caps import DestinationCaps
from .machine import (
    COUNTER_KEYS,
    AttemptEnd,
    Claim,
    Outcome,
    claim_batch,
    finish_and_claim,
    finish_many,
    release,
)
from .scan import select_due

INTERRUPT_REASON: Final = "KeyboardInterrupt in the transport"
"""What a released row's history says when a Ctrl-C cut its attempt."""


def require_store(db: object, caller: str) -> None:
    """Refuse a transaction handle where a transport will run: no database
    transaction may span an external call."""
    if not hasattr(db, "transaction"):
        raise TypeError(
            f"{caller} needs the store itself, not a transaction handle: a transport "
            "must never run inside a database transaction"
        )


async def claim_due(
    db: Database,
    *,
    now: float | None = None,
    limit: int = DEFAULT_BATCH_SIZE,
    lease_seconds: float = NOTIFY_TIMEOUT_SECONDS + CLAIM_LEASE_MARGIN_SECONDS,
    actor: str = ACTOR_DELIVERY,
    clock: Callable[[], float] | None = None,
    ids: Sequence[str] | None = None,
    caps: DestinationCaps | None = None,
) -> tuple[list[Claim], dict[str, int]]:
    """Scan up to ``limit`` due rows (ordered by ``next_attempt_at,
    created_at``; or the rows ``ids`` names, those still due) and, in one
    transaction, expire those past ``expires_at`` and claim the rest,
    leased for ``lease_seconds`` from when the transaction runs (``clock``,
    default the wall clock; or the fixed ``now``). Returns the claims won
    and the counters of the scan (``attempted``, ``expired``,
    ``dead_letter``). A row another claimant took first is skipped
    silently. With ``caps``, no destination gets more attempts than its cap
    allows (:class:`~.caps.DestinationCaps`)."""
    read_clock = clock or clock_from(now)
    limit = require_int("limit", limit, minimum=1)

    def scan_and_claim(conn: Any) -> tuple[list[Claim], dict[str, int]]:
        return claim_batch(conn, read_clock(), limit, lease_seconds, actor, ids=ids, caps=caps)

    return await db.write(scan_and_claim)


def due_ids(conn: Any, now: float, limit: int) -> list[str]:
    """The ids of up to ``limit`` rows due at ``now``, oldest due first."""
    return [row["id"] for row in select_due(conn, now, limit, "id, next_attempt_at, created_at")]


async def finish_attempt(
    db: Database,
    claim: Claim,
    result: TransportResult,
    *,
    now: float | None = None,
    retry_jitter: float = 0.0,
    actor: str = ACTOR_DELIVERY,
    clock: Callable[[], float] | None = None,
    retry_schedule: Sequence[float] | None = None,
) -> Outcome:
    """Record the end of ``claim``'s attempt (status, ``last_error``, due time
    and transition) in one transaction, fenced on ``(delivering,
    claim.attempt)``: returns :attr:`Outcome.CONFLICT` and writes nothing if
    the row moved on (acked, purged, or recovered by another claimant). A
    retry waits ``retry_schedule``'s delay (the ADR backoff without one),
    or the destination's ``Retry-After`` if that is later."""
    read_clock = clock or clock_from(now)
    delay = jittered_backoff(claim.attempt, retry_jitter, schedule=retry_schedule)
    end = AttemptEnd(claim, result, read_clock(), delay, actor)
    return await db.write_many(finish_many, end)


async def finish_and_claim_next(
    db: Database,
    claim: Claim,
    result: TransportResult,
    *,
    lease_seconds: float,
    retry_jitter: float = 0.0,
    actor: str = ACTOR_DELIVERY,
    clock: Callable[[], float] = time.time,
    retry_schedule: Sequence[float] | None = None,
    caps: DestinationCaps | None = None,
) -> tuple[Outcome, Claim | None, dict[str, int]]:
    """:func:`finish_attempt`, and in the same transaction claim the next due
    row (if any) for the delivery slot this attempt frees: a busy worker pays
    one commit per delivery, not two, and its slot never waits for a scan.
    Returns the outcome, the next claim or None, and that scan's counters."""
    delay = jittered_backoff(claim.attempt, retry_jitter, schedule=retry_schedule)
    end = AttemptEnd(
        claim, result, clock(), delay, actor, next_lease=lease_seconds, clock=clock, caps=caps
    )
    return await db.write_many(finish_and_claim, end)


async def release_attempt(
    db: Database,
    claim: Claim,
    *,
    now: float | None = None,
    actor: str = ACTOR_DELIVERY,
    clock: Callable[[], float] | None = None,
    why: str = "worker shutdown",
) -> Outcome:
    """Give back an attempt that ``why`` interrupted (worker shutdown, a
    KeyboardInterrupt): the row returns to ``pending``, due at once
    (``dispatch.pending.released``), fenced on ``(delivering,
    claim.attempt)``. If it was the last attempt allowed, the row is
    dead-lettered instead (``max_attempts`` bounds every send). Returns
    :attr:`Outcome.CONFLICT` if the row had moved on."""
    read_clock = clock or clock_from(now)
    return await db.write(lambda conn: release(conn, claim, read_clock(), actor, why))


def attempt_deadline(claim: Claim, clock: Callable[[], float] = time.time) -> float:
    """The event-loop time at which ``claim``'s transport call is cut: its
    own lease end (a wall-clock time, read with ``clock``) less
    :data:`LEASE_SAFETY_SECONDS`, however long the claim took to reach the
    caller -- so no second claimant can ever overlap the send."""
    remaining = claim.lease_until - clock() - LEASE_SAFETY_SECONDS
    return anyio.current_time() + remaining


def lease_timeout_result(lease_seconds: float) -> TransportResult:
    """The failure of a call cut at its :func:`attempt_deadline`."""
    return TransportResult.failure(
        f"timeout: transport still running {lease_seconds - LEASE_SAFETY_SECONDS:g}s "
        f"into a lease of {lease_seconds:g}s"
    )


async def call_transport(transport: Transport, claim: Claim) -> TransportResult:
    """Run ``transport`` for ``claim``; a transport that raises (anything
    but a cancellation or KeyboardInterrupt: ``SystemExit`` too), or returns
    anything but a :class:`TransportResult`, is a failure saying so. The
    claim's ack token never survives into a failure text or the output kept
    for the log. Cancellation
    propagates."""
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
    token = claim.ack_token
    if token and result.error and token in result.error:
        result = dataclasses.replace(result, error=result.error.replace(token, MASK))
    if token and result.output and token in result.output:
        result = dataclasses.replace(result, output=result.output.replace(token, MASK))
    return result


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
    actor: str = ACTOR_DELIVERY,
    lease_margin_seconds: float = CLAIM_LEASE_MARGIN_SECONDS,
    retry_schedule: Sequence[float] | None = None,
) -> dict[str, int]:
    """One due scan: expire, claim, send and finish up to ``batch_size`` due
    rows, one at a time; return ``{attempted, delivered, dead_letter,
    expired, retried}``.

    Each row is claimed (with :func:`claim_due`, as the worker claims) just
    before its own send, so its lease -- ``timeout + lease_margin_seconds``,
    ``timeout + 5`` by default -- starts when its transport does. The
    transport is ``transport`` if given, else the argv ``notify_template``
    (None or an invalid template is a recorded transport failure, never an
    exception). A failed attempt is retried after ``retry_schedule``'s delay
    (seconds before attempt 2, 3, ...; the last repeats) or, without one,
    the ADR backoff. An attempt a local resource error kept from being made
    (:meth:`TransportResult.not_sent`) is released, not counted, and ends
    the pass. No transaction is open while a transport runs. Cancellation
    stops the scan; an attempt interrupted mid-send stays ``delivering`` and
    is recovered when its lease ends. A ``KeyboardInterrupt`` out of the
    transport releases its row (due at once) and then propagates.
    """
    require_store(db, "deliver_due_dispatches")
    schedule = check_retry_schedule("retry_schedule", retry_schedule)
    clock = clock_from(now)
    limit = require_int("batch_size", batch_size, minimum=1)
    timeout = require_number("timeout_seconds", timeout_seconds, minimum=0.0)
    lease = timeout + require_number(
        "lease_margin_seconds", lease_margin_seconds, minimum=MIN_LEASE_MARGIN_SECONDS
    )
    sender: Transport = (
        CommandTransport(notify_template, timeout=timeout)
        if transport is None
        else as_transport(transport, timeout=timeout)
    )
    counts = dict.fromkeys(COUNTER_KEYS, 0)
    # The pass is bounded to the rows due when it starts (a snapshot read: a
    # pass with nothing due takes no write lock); each is then claimed --
    # with the worker's claim, by id -- just before its own send, so a row
    # that falls due again during the pass is left for the next one.
    due = await db.read(partial(due_ids, now=clock(), limit=limit))
    async with opened(sender):  # one HTTP client for the pass, say
        await _deliver_each(db, due, sender, counts, lease, clock, actor, retry_jitter, schedule)
    return counts


async def _deliver_each(
    db: Database,
    due: Sequence[str],
    sender: Transport,
    counts: dict[str, int],
    lease: float,
    clock: Callable[[], float],
    actor: str,
    retry_jitter: float,
    schedule: Sequence[float] | None,
) -> None:
    for dispatch_id in due:
        counts["attempted"] += 1
        claims, scanned = await claim_due(
            db, lease_seconds=lease, actor=actor, clock=clock, ids=[dispatch_id]
        )
        counts["expired"] += scanned["expired"]
        counts["dead_letter"] += scanned["dead_letter"]
        for claim in claims:
            result: TransportResult | None = None
            with anyio.CancelScope(deadline=attempt_deadline(claim, clock)):
                try:
                    result = await call_transport(sender, claim)
                except BaseException as exc:
                    if is_interrupt(exc):  # Ctrl-C: no row may wait for its lease
                        with anyio.CancelScope(shield=True):
                            await release_attempt(
                                db, claim, actor=actor, clock=clock, why=INTERRUPT_REASON
                            )
                    raise
            if result is None:
                result = lease_timeout_result(lease)
            outcome = await finish_attempt(
                db,
                claim,
                result,
                retry_jitter=retry_jitter,
                actor=actor,
                clock=clock,
                retry_schedule=schedule,
            )
            tally(counts, result, outcome)
            if result.local and not result.ok:
                return  # short of a local resource: the rest wait for the next pass
