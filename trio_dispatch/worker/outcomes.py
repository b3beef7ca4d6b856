"""How the worker records an attempt's end once its transport has
returned: the finish (or, for an interrupted attempt, the release) written
with retries while the store fails (the finish that claims rows ahead in
the same transaction is :mod:`.finisher`'s), and the pause in claiming that a local
resource error at spawn starts. Each write is one unit of work through the
outbox; no transaction is open while anything waits."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Final

import anyio

from ..destinations.outcomes import DestinationBook, Effects
from ..outbox import (
    Claim,
    Outcome,
    finish_attempt,
    release_attempt,
)
from ..outbox.claim import ClaimRules
from ..settings import WorkerSettings
from ..store.base import ConnectionLostError, Store
from ..transports import TransportResult
from .report import AttemptResult, Interrupted

LOCAL_ERROR_PAUSE_SECONDS: Final = 1.0
"""How long the worker stops claiming after a local resource error at spawn
(no file descriptor, memory or process slot): doubled on each one in a row,
up to :data:`MAX_LOCAL_ERROR_PAUSE_SECONDS`."""
MAX_LOCAL_ERROR_PAUSE_SECONDS: Final = 30.0

FINISH_RETRY_DELAYS: Final = (0.2, 1.0, 3.0)
"""Pauses between tries of a finish write that failed (e.g. database
locked): a lost finish means one more send once the lease ends."""


@dataclasses.dataclass(frozen=True)
class OutcomeWriter:
    """The store writes that end an attempt, with the worker's settings (its
    retry schedule and jitter, its lease, its ordering policy) and whether
    it is stopping when the attempt ends (the worker builds one per end)."""

    db: Store
    actor: str
    clock: Callable[[], float]
    settings: WorkerSettings
    rules: ClaimRules
    """The worker's claim rules: the next claim's."""
    log: logging.Logger
    destinations: DestinationBook | None = None
    """The destinations' policies (throttle cap, breaker)."""
    stopping: bool = False
    """The worker is stopping: a write that lost its connection is not
    tried again (the lease brings the row back), so a worker cut off from
    its store stops within its grace and one store deadline."""

    async def settle(
        self, claim: Claim, result: AttemptResult, effects: Effects | None = None
    ) -> Outcome | None:
        """Finish (or, interrupted, release) the attempt, trying again while
        the store fails (unless :attr:`stopping` and the connection was
        lost); None if every try failed (the lease will bring the row
        back). ``effects`` hears of the breaker's changes the finish made."""
        for pause in (*FINISH_RETRY_DELAYS, None):
            try:
                if isinstance(result, Interrupted):
                    return await release_attempt(
                        self.db, claim, actor=self.actor, clock=self.clock, why=result.reason
                    )
                return await finish_attempt(
                    self.db,
                    claim,
                    result,
                    retry_jitter=self.settings.retry_jitter,
                    actor=self.actor,
                    clock=self.clock,
                    retry_schedule=self.settings.retry_schedule,
                    destinations=self.destinations,
                    effects=effects,
                )
            except Exception as exc:
                self.log.exception(
                    "dispatch %s attempt %d: recording the outcome failed",
                    claim.dispatch_id,
                    claim.attempt,
                )
                if pause is None or self.clock() + pause >= claim.lease_until:
                    return None
                if self.stopping and isinstance(exc, ConnectionLostError):
                    return None
                await anyio.sleep(pause)
        return None


class ClaimPause:
    """Claiming paused after a local resource error at spawn, longer for
    each one in a row; an attempt made resets it. Paused on the event
    loop's clock, so a mock clock drives it as it drives the worker's other
    waits."""

    def __init__(self) -> None:
        self._in_a_row = 0
        """Local resource errors in a row (reset by any attempt made)."""
        self._until = 0.0
        """The event-loop time before which no scan claims."""

    def remaining(self) -> float:
        """Seconds until claiming may resume (zero or less: it may now)."""
        return self._until - anyio.current_time()

    def note(self, result: TransportResult, log: logging.Logger) -> None:
        """After a local resource error at spawn, stop claiming for a while
        (longer for each one in a row, and said in ``log``); an attempt made
        resets it."""
        if not (result.local and not result.ok):
            self._in_a_row = 0
            return
        self._in_a_row += 1
        pause = min(
            MAX_LOCAL_ERROR_PAUSE_SECONDS, LOCAL_ERROR_PAUSE_SECONDS * 2 ** (self._in_a_row - 1)
        )
        self._until = max(self._until, anyio.current_time() + pause)
        log.warning(
            "attempt not made (%s): the row is released, the attempt not counted; "
            "claiming paused for %gs",
            result.error,
            pause,
        )
