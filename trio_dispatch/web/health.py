"""The store's side of ``/healthz``: one bounded read of the outbox, run
so that a read stuck on a lock never makes the check wait past
:data:`STORE_CHECK_SECONDS` nor piles up behind itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import anyio
from anyio.abc import TaskGroup

from ..outbox import next_due_at
from ..redact import known_secrets, one_line
from ..store.base import Database

if TYPE_CHECKING:
    from ..worker import DispatchWorker

STORE_CHECK_SECONDS: Final = 2.0
"""How long ``/healthz`` waits for the store to answer."""


class _Probe:
    """One bounded read of the store, and how it went."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.done = anyio.Event()
        self.error: str | None = None

    async def run(self, db: Database) -> None:
        try:
            await next_due_at(db)  # one bounded, indexed read
        except Exception as exc:
            self.error = one_line(exc, known_secrets())[:200] or type(exc).__name__
        finally:
            self.done.set()

    def outcome(self, now: float) -> str | None:
        if not self.done.is_set():
            return f"no answer within {STORE_CHECK_SECONDS:g}s"
        return self.error


class StoreProbes:
    """The health checks' reads of ``db``, at most one running at a time."""

    def __init__(self, db: Database, clock: Callable[[], float]) -> None:
        self.db = db
        self.clock = clock
        self._group: TaskGroup | None = None
        self._probe: _Probe | None = None

    def attach(self, task_group: TaskGroup) -> None:
        """Run probes in ``task_group``: a probe stuck on a lock then
        outlives the request that started it."""
        self._group = task_group

    async def check(self) -> str | None:
        """None if the store answers a bounded read of the outbox (the due
        index) within :data:`STORE_CHECK_SECONDS`, else why not. A read
        blocked in its thread cannot be cancelled, so it runs as a probe of
        its own; while one is still waiting, later checks wait on it rather
        than pile up."""
        if self._group is None:  # not attached: wait in the request
            probe = _Probe(self.clock())
            with anyio.move_on_after(STORE_CHECK_SECONDS):
                await probe.run(self.db)
            return probe.outcome(self.clock())
        if self._probe is None or self._probe.done.is_set():
            self._probe = _Probe(self.clock())
            self._group.start_soon(self._probe.run, self.db)
        probe = self._probe
        remaining = probe.started + STORE_CHECK_SECONDS - self.clock()
        with anyio.move_on_after(max(0.0, remaining)):
            await probe.done.wait()
        return probe.outcome(self.clock())


def health_document(
    failure: str | None, worker: DispatchWorker | None, started_at: float, now: float
) -> tuple[int, dict[str, Any]]:
    """200 and ``{"status": "ok", ...}``, or 503 and the reason: the store's
    probe ``failure`` (None: it answered), or the ``worker``'s claim loop
    has not completed a scan within two ticks (its age counted from
    ``started_at`` until its first scan)."""
    reasons: list[str] = []
    store = "ok"
    if failure is not None:
        store = failure if failure.startswith("no answer") else "error"
        reasons.append(f"store: {failure}")
    document: dict[str, Any] = {"status": "ok"}
    if worker is not None:
        statistics = worker.statistics()
        last = statistics.last_scan_at
        scan_age = now - (last if last is not None else started_at)
        if statistics.in_flight >= statistics.concurrency:
            scan_age = 0.0  # every slot busy: nothing to scan for, the loop is alive
        document["last_scan_age_seconds"] = round(max(0.0, scan_age), 3)
        limit = 2 * worker.settings.tick_seconds
        if not statistics.running:
            reasons.append("worker: not running")
        elif scan_age > limit:
            reasons.append(
                f"worker: no completed scan for {scan_age:.1f}s (more than two ticks, {limit:g}s)"
            )
    document["store"] = store
    if reasons:
        document["status"] = "unhealthy"
        document["reason"] = "; ".join(reasons)
        return 503, document
    return 200, document
