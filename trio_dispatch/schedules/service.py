"""The worker's schedules service: fire each tick once, with no leader.

Every worker with schedules runs this beside its claim loop. It sleeps
until the next tick is due (a heap of fire times: no per-second scan of
every schedule), reads the state of the schedules due, plans their ticks
(:func:`~.spec.planning`, letting other tasks run between its steps, so a
long catch-up never holds the event loop) and fires them in one
transaction per few dozen schedules (:func:`~.runs.fire`); a worker that
loses the race writes nothing. Every :data:`REFRESH_SECONDS` it re-reads
the paused flags, so a schedule resumed elsewhere fires its missed ticks
without a restart, and settles with the store which definition of each
schedule is in force (:func:`~.runs.reconcile`): a schedule whose
definition in force is not this worker's is left to the workers that
hold it, and said once.

Time: whether a tick is due is decided by the store's clock -- the
database server's on PostgreSQL, which every host shares (read with each
look at the schedules, and required again by the write that fires the
tick), the process's clock on SQLite (one machine). The service never
sleeps longer than :data:`CLOCK_CHECK_SECONDS` at once: a wall clock
stepped back and put right delays the next tick by that much at most, not
by the size of the step, and a clock stepped forward fires nothing early
on PostgreSQL.

One schedule that cannot fire (its writes fail: a trigger, a constraint of
the store's) never stops the others: a failed write is done again with
each schedule in a savepoint of its own, the failing one is rolled back
alone and retried after :data:`FAILURE_BACKOFF_SECONDS`, doubling up to
:data:`MAX_FAILURE_BACKOFF_SECONDS`, and it is logged once (a warning
when it starts failing, a line when it fires again), counted in
:attr:`Scheduler.failures` and held in :attr:`Scheduler.failing`.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from typing import Final

import anyio
import anyio.lowlevel

from ..outbox.enqueue import EnqueueCall, body_limit
from ..redact import one_line
from ..store.base import Store
from .runs import Fired, Reconciled, State, fire, iso, reconcile, states_at, store_time
from .spec import MAX_BACKFILL_RUNS, Plan, Schedule, planning

CLOCK_CHECK_SECONDS: Final = 2.0
"""The longest the service sleeps before it reads the clock again."""
REFRESH_SECONDS: Final = 10.0
"""How often the paused flags of every schedule are read again, and the
definitions in force settled (this worker's confirmed)."""
STALE_DEFINITION_SECONDS: Final = 60.0
"""How long a definition in force may go unconfirmed (no worker holding it
refreshed) before a worker holding a definition it replaced takes over.
The workers holding it confirm it every third of that (at their refresh)."""
RETRY_SECONDS: Final = 1.0
"""After a failed read or write, how long before trying again."""
FIRE_CHUNK: Final = 50
"""Schedules fired per transaction when many are due at once."""
FAILURE_BACKOFF_SECONDS: Final = 1.0
"""How long a schedule whose writes failed waits before it tries again; the
wait doubles with each failure in a row."""
MAX_FAILURE_BACKOFF_SECONDS: Final = 300.0
"""The longest a failing schedule waits between two tries."""
CATCH_UP_LINES: Final = 3
"""A schedule's backfilled runs of one write logged a line each up to this
many; more are one line."""
FIRE_RUNS: Final = 200
"""Runs written per transaction at most: a catch-up of many runs (``missed:
all``) is written in several, so no transaction holds the store for long."""

Work = tuple[Schedule, Sequence[tuple[float, bool]], float | None]
"""One schedule's part of a write: its ``(tick, backfilled)`` pairs and the
cursor it ends at (see :func:`~.runs.fire`)."""


def parts(work: Sequence[Work], most: int) -> list[list[Work]]:
    """``work`` cut into writes of at most ``most`` runs each, in order. A
    schedule with more is cut too: its ticks fire oldest first, each moving
    its cursor, so a part written alone leaves the schedule consistent, and
    its last part moves the cursor to where the plan ends it."""
    found: list[list[Work]] = [[]]
    room = most
    for schedule, ticks, handled in work:
        ticks = list(ticks)
        while len(ticks) > room:
            if room:
                found[-1].append((schedule, ticks[:room], None))
                ticks = ticks[room:]
            found.append([])
            room = most
        found[-1].append((schedule, ticks, handled))
        room -= len(ticks)
    return [part for part in found if part]


def failure_backoff(failures: int) -> float:
    """How long a schedule waits after ``failures`` failed writes in a row:
    :data:`FAILURE_BACKOFF_SECONDS` doubling, at most
    :data:`MAX_FAILURE_BACKOFF_SECONDS`."""
    doublings = min(max(0, failures - 1), 64)  # 2**64 s is past any bound
    return min(MAX_FAILURE_BACKOFF_SECONDS, math.ldexp(FAILURE_BACKOFF_SECONDS, doublings))


@dataclasses.dataclass(frozen=True)
class Failing:
    """A schedule whose writes failed, the last time it tried to fire."""

    error: str
    """The last failure, on one line."""
    failures: int
    """Failed writes in a row."""
    since: float
    """When the first of them failed."""
    last_at: float
    """When the last of them failed."""
    retry_at: float
    """When it tries again."""


class Scheduler:
    """Fires the ticks of ``schedules`` into ``db`` (one per tick across
    every worker); :meth:`run` until cancelled. ``fired`` counts this
    process's runs by ``(schedule, origin)``; ``next_fire`` holds each
    schedule's next fire time (None while paused, or while another
    definition than this worker's is in force: ``mismatched`` holds those,
    each with the fingerprint in force); ``failures`` counts
    each schedule's failed writes, and ``failing`` holds the schedules
    failing now. A schedule whose ``body`` is over the store's
    ``max_body_bytes`` is refused here (``ValueError`` naming it): every
    one of its ticks would be.

    ``clock`` is the wall clock (Unix seconds). On SQLite it is the store's
    clock and decides when ticks are due; on PostgreSQL the database
    server's decides, and ``clock`` only paces the sleeps between looks
    (its offset from the server's is measured at each read). The service
    reads the clock again at least every ``clock_check_seconds``."""

    def __init__(
        self,
        db: Store,
        schedules: Sequence[Schedule],
        *,
        clock: Callable[[], float],
        log: logging.Logger,
        clock_check_seconds: float = CLOCK_CHECK_SECONDS,
    ) -> None:
        names = [schedule.name for schedule in schedules]
        duplicate = next((name for name in names if names.count(name) > 1), None)
        if duplicate is not None:
            raise ValueError(f"schedule name {duplicate!r} is used twice")
        self.max_body_bytes = body_limit(db)
        """The store's limit on a body, which each tick's dispatch is held to."""
        for schedule in schedules:
            schedule.check_body_size(self.max_body_bytes)
        self.db = db
        self.schedules = {schedule.name: schedule for schedule in schedules}
        self.clock = clock
        self.clock_check_seconds = clock_check_seconds
        self.log = log
        self.fired: Counter[tuple[str, str]] = Counter()
        self.next_fire: dict[str, float | None] = dict.fromkeys(names)
        self.failures: Counter[str] = Counter()
        self.failing: dict[str, Failing] = {}
        self.fingerprints = {schedule.name: schedule.fingerprint for schedule in schedules}
        self.mismatched: dict[str, str] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._place: dict[str, int] = {}
        """Each schedule's one live place in the heap (a number); an entry
        with another number is stale and skipped (a resume queues a
        schedule anew)."""
        self._places = itertools.count()
        self._idle: set[str] = set()
        """Schedules this worker does not fire now: paused, or another
        definition in force."""
        self._offset = 0.0
        """The store's clock minus :attr:`clock`, as last measured (0 where
        the store has no clock of its own)."""
        self._store_clock: bool | None = None
        """Whether the store has a clock of its own (known after one read)."""

    async def run(self) -> None:
        """Fire ticks until cancelled; a store error is logged and retried."""
        while True:
            try:
                await self._serve()
            except Exception:
                self.log.exception("schedules: reading or firing failed; retrying")
                await anyio.sleep(RETRY_SECONDS)

    async def _serve(self) -> None:
        self._heap, self._place, self._idle = [], {}, set()
        # The first refresh records the schedules (first sight starts their
        # history) and settles their definitions before anything is planned.
        await self._refresh()
        for name in self.schedules:  # plan every schedule now
            if name not in self._idle:
                self._queue(name, 0.0)
        # The refresh is paced by the event loop's monotonic clock: a wall
        # clock stepped back must not hold it off.
        refresh_at = anyio.current_time() + REFRESH_SECONDS
        while True:
            now = await self._now()
            if anyio.current_time() >= refresh_at:
                await self._refresh()
                refresh_at = anyio.current_time() + REFRESH_SECONDS
            due: list[str] = []
            while self._heap and self._heap[0][0] <= now:
                _, place, name = heapq.heappop(self._heap)
                if self._place.get(name) == place:
                    del self._place[name]
                    due.append(name)
            # By name within a chunk: every worker locks the state rows it
            # fires in one order, so two transactions never wait for each
            # other in a ring. Each worker starts at a chunk of its own, so
            # in a burst they fire different chunks instead of queueing on
            # the same rows' locks (PostgreSQL: 1,000 ticks at one instant
            # over 4 workers, p50 lag 1.2-1.8 s -> 0.5-0.8 s).
            due.sort()
            chunks = [due[start : start + FIRE_CHUNK] for start in range(0, len(due), FIRE_CHUNK)]
            first = random.randrange(len(chunks)) if chunks else 0
            for chunk in chunks[first:] + chunks[:first]:
                await self._fire(chunk)
            # Never longer than clock_check_seconds at once: the sleep is on
            # the monotonic clock, the tick's time on the wall clock, and the
            # wall clock may be stepped meanwhile.
            wake = self._heap[0][0] - self._estimate() if self._heap else math.inf
            pause = min(self.clock_check_seconds, refresh_at - anyio.current_time(), wake)
            await anyio.sleep(max(0.0, pause))

    def _estimate(self) -> float:
        """The store's time now, from :attr:`clock` and the last offset."""
        return self.clock() + self._offset

    async def _now(self) -> float:
        """The store's time now: read from the store where it has a clock of
        its own (PostgreSQL), else :attr:`clock`."""
        if self._store_clock is False:
            return self.clock()
        return self._measured(await self.db.read(store_time))

    def _measured(self, stamp: float | None) -> float:
        """The store's time given what a read said (``stamp``, None: the
        store has no clock of its own), the offset taken from it."""
        self._store_clock = stamp is not None
        if stamp is None:
            self._offset = 0.0
            return self.clock()
        self._offset = stamp - self.clock()
        return stamp

    def _queue(self, name: str, at: float) -> None:
        """Look at ``name`` again at ``at`` (its earlier place, if any, lapses)."""
        place = next(self._places)
        self._place[name] = place
        heapq.heappush(self._heap, (at, place, name))
        if len(self._heap) > 2 * len(self.schedules):  # mostly lapsed places: drop them
            self._heap = [entry for entry in self._heap if self._place.get(entry[2]) == entry[1]]
            heapq.heapify(self._heap)

    async def _refresh(self) -> None:
        """Record this worker's schedules and settle which definition of each
        is in force (:func:`~.runs.reconcile`); read every paused flag. A
        schedule resumed, or whose definition came into force, since the
        last look is planned now."""
        settled: Reconciled = await self.db.write(
            partial(
                reconcile,
                definitions=self.fingerprints,
                now=self._estimate(),
                stale_after=STALE_DEFINITION_SECONDS,
                confirm_after=STALE_DEFINITION_SECONDS / 3,
            )
        )
        for name, replaced in settled.took_over.items():
            self.mismatched.pop(name, None)  # said here, not again as "in force again"
            if replaced is not None:
                self.log.warning(
                    "schedule %s: this worker's definition (fingerprint %s) is now the one in "
                    "force, in place of %s; its ticks fire with it from now on",
                    name,
                    self.fingerprints[name],
                    replaced,
                )
        idle = {
            name
            for name, state in settled.states.items()
            if not self._in_force(state) or state.paused
        }
        for name in self._idle - idle:
            self._queue(name, 0.0)
        for name in idle:
            self.next_fire[name] = None
        self._idle = idle

    def _in_force(self, state: State) -> bool:
        """Whether this worker's definition of ``state``'s schedule is the
        one in force (or none is recorded); the first time it is not, one
        line says so."""
        name, other = state.name, state.definition
        if other is None or other == self.fingerprints[name]:
            if self.mismatched.pop(name, None) is not None:
                self.log.info("schedule %s: this worker's definition is in force again", name)
            return True
        if self.mismatched.get(name) != other:
            self.log.warning(
                "schedule %s: the definition in force (fingerprint %s) is not this worker's "
                "(%s), which it replaced: this worker fires nothing for it while a worker "
                "holding %s confirms it (takes over after %gs without)",
                name,
                other,
                self.fingerprints[name],
                other,
                STALE_DEFINITION_SECONDS,
            )
        self.mismatched[name] = other
        return False

    async def _fire(self, names: list[str]) -> None:
        found, stamp = await self.db.read(partial(states_at, names=names))
        now = self._measured(stamp)
        work: list[Work] = []
        capped: list[str] = []
        for name in names:
            state = found.get(name)
            schedule = self.schedules[name]
            if state is None:  # pruned by hand: seen again, from now
                mine = {name: self.fingerprints[name]}
                settled = await self.db.write(
                    partial(
                        reconcile,
                        definitions=mine,
                        now=now,
                        stale_after=STALE_DEFINITION_SECONDS,
                        confirm_after=STALE_DEFINITION_SECONDS / 3,
                    )
                )
                state = settled.states[name]
            if state.paused or not self._in_force(state):
                self._idle.add(name)
                self.next_fire[name] = None
                continue
            failing = self.failing.get(name)
            if failing is not None and now < failing.retry_at:
                self._queue(name, failing.retry_at)
                continue
            decided = await self._plan(schedule, state.cursor, now)
            if decided.fire or decided.handled is not None:
                work.append((schedule, decided.fire, decided.handled))
            if decided.capped:
                capped.append(name)
            self.next_fire[name] = None if math.isinf(decided.wake_at) else decided.wake_at
            self._queue(name, decided.wake_at)
        failed: set[str] = set()
        for part in parts(work, FIRE_RUNS):
            # A schedule that failed in one part waits out its backoff
            # before the rest of its catch-up is tried.
            failed |= await self._write([w for w in part if w[0].name not in failed], now)
        for name in (name for name in capped if name not in failed):
            self.log.warning(
                "schedule %s: more than %d missed ticks inside its catch_up_seconds "
                "(missed: all); the newest %d fired, the older ones were passed over",
                name,
                MAX_BACKFILL_RUNS,
                MAX_BACKFILL_RUNS,
            )

    async def _write(self, work: list[Work], now: float) -> set[str]:
        """Fire ``work`` in one transaction; count and log what it wrote. If
        that fails, it is written again with each schedule on its own (a
        savepoint each): the schedules that fail are rolled back alone and
        wait (:meth:`_failed`); an error of the store itself propagates.
        Returns the names of the schedules that failed."""
        if not work:
            return set()
        try:
            runs = await self._fire_work(work, now, None)
            failed: dict[str, Exception] = {}
        except Exception:
            failed = {}
            runs = await self._fire_work(work, now, failed)
        self._count(runs)
        for schedule, _, _ in work:
            if schedule.name in failed:
                self._failed(schedule.name, failed[schedule.name], now)
            elif schedule.name in self.failing:
                before = self.failing.pop(schedule.name)
                self.log.info(
                    "schedule %s fires again, after %d failed attempts",
                    schedule.name,
                    before.failures,
                )
        return set(failed)

    async def _fire_work(
        self, work: list[Work], now: float, failed: dict[str, Exception] | None
    ) -> list[Fired]:
        # Shielded: runs that committed are counted and logged even when the
        # worker is being cancelled meanwhile (the write is bounded by the
        # store's busy timeout).
        with anyio.CancelScope(shield=True):
            # The outbox's enqueue call: a create span per dispatch written,
            # ended after the commit; root spans: a tick has no caller.
            with EnqueueCall(self.max_body_bytes) as call:
                runs: list[Fired] = await self.db.write(
                    partial(fire, work=work, now=now, call=call, failed=failed)
                )
                call.written([run.dispatch_id for run in runs])
        return runs

    def _failed(self, name: str, error: Exception, now: float) -> None:
        """``name`` failed to fire: it waits, doubling; the first failure in
        a row is logged (one line), the next ones are only counted."""
        before = self.failing.get(name)
        failures = 1 if before is None else before.failures + 1
        wait = failure_backoff(failures)
        text = one_line(f"{type(error).__name__}: {error}")
        since = now if before is None else before.since
        self.failing[name] = Failing(text, failures, since, now, now + wait)
        self.failures[name] += 1
        self._queue(name, now + wait)
        if before is None:
            self.log.warning(
                "schedule %s failed to fire (%s); the other schedules go on, and it tries "
                "again after %gs, the wait doubling up to %gs (later failures are counted, "
                "not logged)",
                name,
                text,
                wait,
                MAX_FAILURE_BACKOFF_SECONDS,
            )

    async def _plan(self, schedule: Schedule, cursor: float, now: float) -> Plan:
        """:func:`~.spec.planning`, letting other tasks run between its steps
        and after it (a search or a walk of a catch-up takes a moment)."""
        steps = planning(schedule, cursor, now)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                decided: Plan = done.value
                break
            await anyio.lowlevel.checkpoint()
        await anyio.lowlevel.checkpoint()
        return decided

    def _count(self, runs: list[Fired]) -> None:
        caught_up: dict[str, list[Fired]] = {}
        for run in runs:
            self.fired[(run.schedule, run.origin)] += 1
            if run.origin == "backfilled":
                caught_up.setdefault(run.schedule, []).append(run)
                continue
            self._said(run)
        # A catch-up of many runs is one line, not one a run (a line each
        # would hold the event loop as long as the write took).
        for name, backfilled in caught_up.items():
            if len(backfilled) <= CATCH_UP_LINES:
                for run in backfilled:
                    self._said(run)
                continue
            self.log.info(
                "schedule %s fired %d missed ticks (origin=backfilled), scheduled_for %s to %s",
                name,
                len(backfilled),
                iso(backfilled[0].scheduled_for),
                iso(backfilled[-1].scheduled_for),
            )
        if runs:
            self.db.notify_enqueued()

    def _said(self, run: Fired) -> None:
        self.log.info(
            "schedule %s fired: scheduled_for=%s origin=%s dispatch %s",
            run.schedule,
            iso(run.scheduled_for),
            run.origin,
            run.dispatch_id,
        )
