"""Delivery (docs/guarantees.md), the outbox's side: claim due rows and record each
attempt's end, each one transaction.

A delivery is three steps: a claim (one transaction), the transport call
(none: :mod:`trio_dispatch.worker.attempts` makes it), a finish (one
transaction). :func:`claim_due` is the one claim path, for the single pass
and the worker alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from ..attempt import TransportResult
from ..backoff import jittered_backoff
from ..destinations.outcomes import DestinationBook, Effects
from ..destinations.policy import Destination
from ..lifecycle import ACTOR_DELIVERY
from ..store.base import Database
from ..validate import clock_from, require_int
from .claim import ClaimRules, DestinationCaps, claim_rules
from .claim.scan import select_due
from .machine import (
    AttemptEnd,
    Claim,
    Outcome,
    claim_batch,
    finish_and_claim,
    finish_and_claim_ahead,
    finish_many,
    release,
)
from .ordering import DEFAULT_ORDERING_POLICY, OrderingPolicy

DEFAULT_BATCH_SIZE: Final = 100
"""Most rows one scan claims (the worker's ``batch_size`` default)."""
DEFAULT_LEASE_SECONDS: Final = 15.0
"""A claim's lease unless told: the worker's default, a 10 s transport
timeout plus a 5 s margin."""


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
    lease_seconds: float = DEFAULT_LEASE_SECONDS,
    actor: str = ACTOR_DELIVERY,
    clock: Callable[[], float] | None = None,
    ids: Sequence[str] | None = None,
    caps: DestinationCaps | None = None,
    ordering: OrderingPolicy = DEFAULT_ORDERING_POLICY,
    rules: ClaimRules | None = None,
    destinations: DestinationBook | Mapping[str, Destination] | None = None,
) -> tuple[list[Claim], dict[str, int]]:
    """Scan up to ``limit`` due rows (in claim order; or the rows ``ids``
    names, those still due) and, in one transaction, expire those past
    ``expires_at`` and claim the rest, leased for ``lease_seconds`` from
    when the transaction runs (``clock``, default the wall clock; or the
    fixed ``now``). Returns the claims won and the counters of the scan
    (``attempted``, ``expired``, ``dead_letter``). A row another claimant
    took first is skipped silently. ``rules`` decide what the claim may
    take (:mod:`.claim`); without them, the rules of ``ordering`` (the
    ordering keys' policy for a head that ended ``dead_letter`` or
    ``expired``), ``caps`` (no destination gets more attempts than its
    cap allows: :class:`~.claim.caps.DestinationCaps`) and ``destinations``
    (each destination's policy, docs/destinations.md, as a mapping or a worker's
    :class:`~trio_dispatch.destinations.outcomes.DestinationBook`; paused,
    throttled and open destinations are kept out without one)."""
    read_clock = clock or clock_from(now)
    limit = require_int("limit", limit, minimum=1)
    chosen = _rules(ordering, caps, destinations) if rules is None else rules

    def scan_and_claim(conn: Any) -> tuple[list[Claim], dict[str, int]]:
        return claim_batch(conn, read_clock(), limit, lease_seconds, actor, ids=ids, rules=chosen)

    return await db.write(scan_and_claim)


def _rules(
    ordering: OrderingPolicy,
    caps: DestinationCaps | None,
    destinations: DestinationBook | Mapping[str, Destination] | None,
) -> ClaimRules:
    policies = destinations.policies if isinstance(destinations, DestinationBook) else destinations
    return claim_rules(ordering=ordering, caps=caps, destinations=policies)


def due_ids(conn: Any, now: float, limit: int, rules: ClaimRules | None = None) -> list[str]:
    """The ids of up to ``limit`` rows due at ``now`` that ``rules``
    (default: the ordering keys' rule, ``block``) allow, oldest due first: a
    row behind a blocked head never takes the place of one that can go."""
    columns = "id, status, deliver_to, next_attempt_at, created_at"
    chosen = claim_rules() if rules is None else rules
    return [row["id"] for row in select_due(conn, now, limit, columns, rules=chosen)]


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
    destinations: DestinationBook | None = None,
    effects: Effects | None = None,
) -> Outcome:
    """Record the end of ``claim``'s attempt (status, ``last_error``, due time
    and transition) in one transaction, fenced on ``(delivering,
    claim.attempt)``: returns :attr:`Outcome.CONFLICT` and writes nothing if
    the row moved on (acked, purged, or recovered by another claimant). A
    retry waits ``retry_schedule``'s delay (``backoff_seconds`` without one),
    or the destination's ``Retry-After`` if that is later. A throttle
    (:attr:`TransportResult.throttled`) returns the row to ``pending``,
    due when the destination allows (capped by its policy in
    ``destinations``), and throttles the destination in the same
    transaction; with a breaker in its policy, the end counts for it
    (``effects`` is told of a change of the breaker's state)."""
    read_clock = clock or clock_from(now)
    delay = jittered_backoff(claim.attempt, retry_jitter, schedule=retry_schedule)
    end = AttemptEnd(
        claim, result, read_clock(), delay, actor, destinations=destinations, effects=effects
    )
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
    ordering: OrderingPolicy = DEFAULT_ORDERING_POLICY,
    rules: ClaimRules | None = None,
    destinations: DestinationBook | None = None,
    effects: Effects | None = None,
) -> tuple[Outcome, Claim | None, dict[str, int]]:
    """:func:`finish_attempt`, and in the same transaction claim the next due
    row (if any) for the delivery slot this attempt frees: a busy worker pays
    one commit per delivery, not two, and its slot never waits for a scan.
    The rules (as :func:`claim_due` takes them) hear of the end first, then
    decide the next claim. Returns the outcome, the next claim or None, and
    that scan's counters."""
    delay = jittered_backoff(claim.attempt, retry_jitter, schedule=retry_schedule)
    end = AttemptEnd(
        claim,
        result,
        clock(),
        delay,
        actor,
        next_lease=lease_seconds,
        clock=clock,
        rules=_rules(ordering, caps, destinations) if rules is None else rules,
        destinations=destinations,
        effects=effects,
    )
    return await db.write_many(finish_and_claim, end)


async def finish_and_claim_many(
    db: Database,
    ends: Sequence[tuple[Claim, TransportResult, Effects | None]],
    *,
    want: int,
    lease_seconds: float,
    rules: ClaimRules,
    retry_jitter: float = 0.0,
    actor: str = ACTOR_DELIVERY,
    clock: Callable[[], float] = time.time,
    retry_schedule: Sequence[float] | None = None,
    destinations: DestinationBook | None = None,
) -> tuple[list[Outcome], list[Claim], dict[str, int]]:
    """Record the ends of several attempts (each as :func:`finish_attempt`
    would, with its ``effects``) and, in the same transaction, claim up to
    ``want`` due rows under ``rules`` (which hear of the ends first): one
    unit of work, one commit. Returns the outcomes in the order of
    ``ends``, the claims and that scan's counters."""
    now = clock()
    planned = [
        AttemptEnd(
            claim,
            result,
            now,
            jittered_backoff(claim.attempt, retry_jitter, schedule=retry_schedule),
            actor,
            next_lease=lease_seconds,
            clock=clock,
            rules=rules,
            destinations=destinations,
            effects=effects,
        )
        for claim, result, effects in ends
    ]
    return await db.write(lambda conn: finish_and_claim_ahead(conn, planned, want))


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


def tally(counts: dict[str, int], result: TransportResult, outcome: Outcome) -> None:
    """Add one finished attempt to a counter mapping (docs/usage.md:
    ``delivered`` counts successful transport calls whose finish applied)."""
    if outcome is Outcome.CONFLICT:
        return
    if result.ok:
        counts["delivered"] += 1
    if outcome in (Outcome.DEAD_LETTER, Outcome.ACK_TIMEOUT):
        counts["dead_letter"] += 1
    elif outcome is Outcome.RETRY:
        counts["retried"] += 1
