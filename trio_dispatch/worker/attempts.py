"""One delivery attempt's transport call, and the single pass
(:func:`deliver_due_dispatches`) that claims, sends and finishes due rows
without a worker.

The outbox (:mod:`trio_dispatch.outbox`) owns the claims and the finishes,
each one transaction; this module calls the transport between them, with no
transaction open, cut at the claim's lease so no second claimant can ever
overlap a send.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Final

import anyio

from .. import tracing
from ..backoff import check_retry_schedule
from ..lifecycle import ACTOR_DELIVERY
from ..outbox.delivery import (
    claim_due,
    due_ids,
    finish_attempt,
    release_attempt,
    require_store,
    tally,
)
from ..outbox.machine import COUNTER_KEYS, Claim
from ..redact import MASK
from ..settings import (
    CLAIM_LEASE_MARGIN_SECONDS,
    DEFAULT_BATCH_SIZE,
    LEASE_SAFETY_SECONDS,
    MIN_LEASE_MARGIN_SECONDS,
)
from ..store.base import Database
from ..transports import (
    TRANSPORT_TIMEOUT_SECONDS,
    CallableTransport,
    CommandTransport,
    Transport,
    TransportResult,
    as_transport,
    is_interrupt,
    must_propagate,
    opened,
    raised_result,
)
from ..transports.base import timeout_message
from ..validate import clock_from, require_int, require_number
from ..values import show
from .report import AttemptResult

INTERRUPT_REASON: Final = "KeyboardInterrupt in the transport"
"""What a released row's history says when a Ctrl-C cut its attempt."""


def attempt_deadline(claim: Claim, clock: Callable[[], float] = time.time) -> float:
    """The event-loop time at which ``claim``'s transport call is cut: its
    own lease end (a wall-clock time, read with ``clock``) less
    :data:`LEASE_SAFETY_SECONDS`, however long the claim took to reach the
    caller -- so no second claimant can ever overlap the send."""
    remaining = claim.lease_until - clock() - LEASE_SAFETY_SECONDS
    return anyio.current_time() + remaining


def late_claim(claim: Claim, clock: Callable[[], float] = time.time) -> TransportResult | None:
    """None if ``claim``'s attempt may start now; else (its lease, less
    :data:`LEASE_SAFETY_SECONDS`, has already run out: the store answered
    the claim that late) the result that gives the row back unsent and
    uncounted -- a send now could overlap a second claimant's."""
    late = clock() - (claim.lease_until - LEASE_SAFETY_SECONDS)
    if late < 0:
        return None
    return TransportResult.not_sent(
        f"the claim reached the worker {late:.1f}s after its lease allowed a send to "
        "start (the store answered late); not sent"
    )


def lease_timeout_result(lease_seconds: float) -> TransportResult:
    """The failure of a call cut at its :func:`attempt_deadline`."""
    return TransportResult.failure(
        f"timeout: transport still running {lease_seconds - LEASE_SAFETY_SECONDS:g}s "
        f"into a lease of {lease_seconds:g}s"
    )


def transport_timeout_result(timeout: float) -> TransportResult:
    """The failure of a call cut at its transport's own timeout."""
    return TransportResult.failure(timeout_message(timeout))


@dataclasses.dataclass(frozen=True)
class SharedDeadline:
    """An in-process transport's timeout carried by the attempt's scope."""

    timeout: float
    cut: float
    """The event-loop time the scope now ends at: the timeout's, unless a
    shutdown cut the attempt before it."""


@dataclasses.dataclass(frozen=True)
class Cut:
    """How an attempt whose scope was cancelled was cut."""

    stopped_at: float | None
    """When the worker cut it (event-loop time), or None: its own deadline."""
    cancelled: bool
    """An operator's cancel cut it (docs/controls.md)."""
    closing: bool
    """The worker is shutting down."""

    def result(
        self, result: AttemptResult, shared: SharedDeadline | None, lease_seconds: float
    ) -> AttemptResult:
        """The attempt's result: the transport's own timeout if its cut came
        first (even inside a shutdown's grace, as its own scope would have
        said); else the operator's cancel; else the lease's end, or, in a
        shutdown, ``result`` (interrupted) however late the transport let
        the attempt end."""
        if shared is not None and (self.stopped_at is None or shared.cut <= self.stopped_at):
            return transport_timeout_result(shared.timeout)
        if self.cancelled:
            return TransportResult.cut_by_cancel()
        if not self.closing:
            return lease_timeout_result(lease_seconds)
        return result


def share_deadline(transport: Transport, scope: anyio.CancelScope) -> SharedDeadline | None:
    """Let the attempt's ``scope`` (entered, cut at the lease) also stand
    for an in-process transport's own timeout, when that comes first: the
    scope is moved forward to it (the caller then runs the transport with
    ``scoped``). None: the transport keeps its own scope, if it has one --
    always for a subclass with its own ``__call__``, which must run."""
    if (
        not isinstance(transport, CallableTransport)
        or type(transport).__call__ is not CallableTransport.__call__
    ):
        return None
    cut = anyio.current_time() + transport.timeout
    if cut >= scope.deadline:
        return None
    scope.deadline = cut
    return SharedDeadline(transport.timeout, cut)


async def call_transport(
    transport: Transport, claim: Claim, scoped: bool = False
) -> TransportResult:
    """Run ``transport`` for ``claim``; a transport that raises (anything
    but a cancellation or KeyboardInterrupt: ``SystemExit`` too), or returns
    anything but a :class:`TransportResult`, is a failure saying so -- or,
    raising :class:`~trio_dispatch.errors.Throttled`, a throttle. The
    claim's ack token never survives into a failure text or the output kept
    for the log. Cancellation propagates. With ``scoped`` (see
    :func:`share_deadline`), a callable transport runs without its own
    timeout scope."""
    try:
        if scoped:
            assert isinstance(transport, CallableTransport)
            result = await transport.call_in_scope(claim.delivery())
        else:
            result = await transport(claim.delivery())
    except BaseException as exc:
        if must_propagate(exc):
            raise
        if tracing.ACTIVE:
            tracing.transport_raised(exc)
        result = raised_result(exc)
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


async def deliver_due_dispatches(
    db: Database,
    *,
    now: float | None = None,
    notify_template: list[str] | None = None,
    transport: Transport | Callable[..., Any] | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    timeout_seconds: float = TRANSPORT_TIMEOUT_SECONDS,
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
    ``backoff_seconds``. An attempt a local resource error kept from being made
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
        claims, scanned = await claim_due(
            db, lease_seconds=lease, actor=actor, clock=clock, ids=[dispatch_id]
        )
        counts["attempted"] += scanned["attempted"]  # 0: taken or changed meanwhile
        counts["expired"] += scanned["expired"]
        counts["dead_letter"] += scanned["dead_letter"]
        for claim in claims:
            result: TransportResult | None = late_claim(claim, clock)
            with tracing.processing(claim) as trace:
                with anyio.CancelScope(deadline=attempt_deadline(claim, clock)):
                    try:
                        if result is None:
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
                trace.record(result)
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
