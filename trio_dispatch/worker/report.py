"""What the worker says of each attempt: one log line (what was sent
where, how it ended and, for a retry, when the next attempt is due), the
attempt's place in the metrics, and its totals (:class:`Ledger`)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Final

from ..attempt import TransportResult
from ..backoff import jittered_backoff
from ..destinations.outcomes import DEFAULT_BOOK, DestinationBook, Effects, throttle_wait
from ..destinations.policy import MAX_THROTTLES_PER_ROW
from ..outbox import Claim, Outcome, tally
from ..outbox.claim import ClaimRules
from ..outbox.machine import MAX_RETRY_AFTER_SECONDS
from ..redact import visible
from ..settings import WorkerSettings
from .metrics import CancelCounts, DeliveryMetrics, DestinationMetrics

_QUIET_OUTCOMES: Final = frozenset(
    {
        Outcome.DELIVERED,
        Outcome.AWAITING_ACK,
        Outcome.RELEASED,
        Outcome.THROTTLED,
        Outcome.CANCELLED,
    }
)
"""Outcomes logged at INFO (a throttle is the destination asking to wait,
and a cancel an operator's choice, not failures); a retry, a dead letter, a
conflict or an end that could not be recorded is a WARNING."""


@dataclasses.dataclass(frozen=True)
class Interrupted:
    """An attempt that worker shutdown cut short: its row is released (or
    dead-lettered, if it was the last attempt), not finished."""

    reason: str = "worker shutdown"


AttemptResult = TransportResult | Interrupted


def log_outcome(
    log: logging.Logger,
    metrics: DeliveryMetrics,
    claim: Claim,
    outcome: Outcome | None,
    started: float,
    result: AttemptResult,
    settings: WorkerSettings,
    clock: Callable[[], float],
    destinations: DestinationBook | None = None,
) -> None:
    """One line per attempt. Retries, dead letters and unrecorded ends are
    WARNINGs; the rest INFO. A throttled attempt says until when its row
    (and, at least, its destination) waits, and what the destination
    answered, not as an error (``destinations``: the policies that cap
    the wait)."""
    elapsed = time.monotonic() - started
    label = "unrecorded" if outcome is None else outcome.value
    metrics.observe(claim.kind, label, elapsed)
    transported = result if isinstance(result, TransportResult) else None
    local = transported is not None and transported.local
    level = logging.INFO if outcome in _QUIET_OUTCOMES and not local else logging.WARNING
    if not log.isEnabledFor(level):  # nothing would be written: format nothing
        return
    error = result.reason if isinstance(result, Interrupted) else result.error
    # Outside text (kind, route, a destination's output) made visible: it
    # can neither forge a log line nor reach a terminal as escapes.
    detail = ""
    if outcome is Outcome.THROTTLED and transported is not None:
        book = DEFAULT_BOOK if destinations is None else destinations
        detail += f" throttled_until={throttled_text(claim, transported, settings, clock, book)}"
        detail += f" throttles={claim.throttles + 1}/{MAX_THROTTLES_PER_ROW}"
        if error:
            detail += f" answer={visible(repr(error[:200]))}"
    elif outcome in (Outcome.RETRY, Outcome.AWAITING_ACK) and transported is not None:
        book = DEFAULT_BOOK if destinations is None else destinations
        detail += f" next_attempt={next_attempt_text(claim, transported, settings, clock, book)}"
    if error and outcome not in (Outcome.DELIVERED, Outcome.THROTTLED):
        detail += f" error={visible(repr(error[:200]))}"
    if transported is not None and transported.output:
        detail += f" output={visible(repr(transported.output))}"
    log.log(
        level,
        "dispatch %s kind=%s deliver_to=%s attempt=%d/%d result=%s duration=%.0fms%s",
        claim.dispatch_id,
        visible(claim.kind),
        visible(claim.deliver_to),
        claim.counted,
        claim.max_attempts,
        label,
        elapsed * 1000,
        detail,
    )


def _when(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def throttled_text(
    claim: Claim,
    result: TransportResult,
    settings: WorkerSettings,
    clock: Callable[[], float],
    destinations: DestinationBook,
) -> str:
    """Until when a throttled attempt's row waits, as the finish computed
    it: the delay the destination asked for (its row's next backoff step
    when it gave none, "~" when ``retry_jitter`` spreads that), capped by
    its policy's ``throttle_max_seconds``."""
    backoff = jittered_backoff(claim.attempt, 0.0, schedule=settings.retry_schedule)
    wait = throttle_wait(result.retry_after, backoff, destinations.policy(claim.deliver_to))
    approx = "~" if settings.retry_jitter and result.retry_after is None else ""
    return f"{approx}{_when(clock() + wait)} next_in={approx}{wait:g}s"


def next_attempt_text(
    claim: Claim,
    result: TransportResult,
    settings: WorkerSettings,
    clock: Callable[[], float],
    destinations: DestinationBook = DEFAULT_BOOK,
) -> str:
    """When the row is due again, as the finish computed it: the schedule's
    delay or the destination's ``Retry-After`` if later -- capped at 24 h,
    or for a throttle past the row's uncounted ones at the destination's
    ``throttle_max_seconds`` ("~" when ``retry_jitter`` spreads it)."""
    delay = jittered_backoff(claim.attempt, 0.0, schedule=settings.retry_schedule)
    if result.retry_after is not None and not result.ok:
        cap = MAX_RETRY_AFTER_SECONDS
        if result.throttled:
            cap = float(destinations.policy(claim.deliver_to).throttle_max_seconds)
        delay = max(delay, min(result.retry_after, cap))
    approx = "~" if settings.retry_jitter else ""
    return f"{approx}{_when(clock() + delay)} next_in={approx}{delay:g}s"


@dataclasses.dataclass(frozen=True)
class Ledger:
    """What a worker counts and says of each attempt's recorded end: its
    totals, metrics and log line; its claim rules hear of the end, and its
    claim loop is woken when the row's new due time may come sooner."""

    counts: dict[str, int]
    metrics: DeliveryMetrics
    destination_metrics: DestinationMetrics
    cancel_counts: CancelCounts
    rules: ClaimRules
    log: logging.Logger
    settings: WorkerSettings
    clock: Callable[[], float]
    book: DestinationBook
    wake: Callable[[], None]

    def recorded(
        self,
        claim: Claim,
        result: TransportResult,
        effects: Effects,
        started: float,
        outcome: Outcome | None,
    ) -> None:
        """An attempt's end recorded as ``outcome`` (None: every write
        failed; the lease brings the row back)."""
        self.rules.ended([(claim.dispatch_id, claim.lease_until)])
        if outcome is not None:
            tally(self.counts, result, outcome)
            if outcome not in (Outcome.CONFLICT, Outcome.CANCELLED):
                self.destination_metrics.ended(
                    claim.deliver_to, result.throttled, effects.transitions
                )
        self.cancel_counts.ended(outcome is Outcome.CANCELLED, effects.too_late)
        if outcome in (Outcome.RETRY, Outcome.AWAITING_ACK, Outcome.THROTTLED) or result.local:
            # Its new due time may come before the loop's planned wake-up
            # (a short retry schedule, a Retry-After; a released row is
            # due at once, after the pause): re-read it.
            self.wake()
        log_outcome(
            self.log,
            self.metrics,
            claim,
            outcome,
            started,
            result,
            self.settings,
            self.clock,
            self.book,
        )

    def interrupted(
        self, claim: Claim, result: Interrupted, started: float, outcome: Outcome | None
    ) -> None:
        """An interrupted attempt released (or dead-lettered) as ``outcome``."""
        if outcome is Outcome.DEAD_LETTER:
            self.counts["dead_letter"] += 1
        self.cancel_counts.ended(outcome is Outcome.CANCELLED, too_late=False)
        log_outcome(
            self.log, self.metrics, claim, outcome, started, result, self.settings, self.clock
        )
