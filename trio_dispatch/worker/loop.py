"""DispatchWorker: the long-running delivery loop (docs/usage.md).

The worker owns one task group. Its claim loop wakes on a tick, on
:meth:`DispatchWorker.wake` (every in-process enqueue calls it through the
store; a :class:`~trio_dispatch.store.base.Listener` store reaches it on
another process's commit: PostgreSQL ``LISTEN``/``NOTIFY`` from any host,
SQLite ``PRAGMA data_version`` polled on an idle connection), or when the
earliest retry falls due. ``concurrency`` slots (:class:`.SlotTable`)
bound the transports running at once, and ``per_destination_concurrency``
(optional) those to one ``deliver_to``
(:class:`~trio_dispatch.outbox.claim.caps.DestinationCaps`, one of the
worker's claim rules: :mod:`trio_dispatch.outbox.claim`). While attempts
are short beside the lease's margin, it claims rows beyond its free slots,
held ahead of them: a slot whose attempt ends hands the end to the
:class:`.finisher.Finisher` and starts the next row held ahead at once,
while the finisher writes the ends that came in, and in the same
transaction claims the rows that refill the room -- no slot waits on a
commit while rows are due (:mod:`.finisher`). Each attempt is cut at its
own lease end (less a safety margin) whatever the transport does. A
delivery task lives as long as its slot keeps finding rows held ahead.

Shutdown (the worker's scope is cancelled): claiming stops at once; running
deliveries get ``grace_seconds`` to finish; any still running are then
cancelled -- a command transport's whole process group is killed -- and
their rows released to ``pending``, due at once. Delivery tasks are shielded
from the outer cancellation so that grace and release can happen. A worker
killed outright loses nothing either: its rows are recovered by any worker
once their lease ends. An operator's cancel of a running attempt is heard
and carried out by :class:`.watch.CancelWatch`, a shutdown's grace included.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from functools import partial
from typing import Any, Final

import anyio
import sniffio
from anyio.abc import TaskGroup, TaskStatus

from .. import tracing
from ..destinations.outcomes import DestinationBook, Effects
from ..destinations.policy import ANY_DESTINATION, Destination, parse_destinations
from ..errors import WorkerError
from ..lifecycle import ACTOR_DELIVERY
from ..outbox import (
    COUNTER_KEYS,
    Claim,
    claim_due,
    next_due_at,
    require_store,
)
from ..outbox.claim import DestinationCaps, claim_rules
from ..outbox.claim.pins import held_starts
from ..redact import scrubbed_logger
from ..schedules import Schedule, Scheduler
from ..settings import ConfiguredWorker, WorkerSettings
from ..store.base import Listener, Store
from ..transports import (
    ChildEnvironment,
    CommandTransport,
    Transport,
    TransportResult,
    as_transport,
    is_interrupt,
    keyboard_interrupt,
    needs_asyncio_loop,
    opened,
)
from .attempts import (
    INTERRUPT_REASON,
    Cut,
    attempt_deadline,
    call_transport,
    late_claim,
    share_deadline,
)
from .expiry import ExpirySweeper
from .finisher import End, Finisher, Pace, most_ahead
from .metrics import CancelCounts, DeliveryMetrics, DestinationMetrics
from .outcomes import ClaimPause, OutcomeWriter
from .prepare import prepare_store
from .report import AttemptResult, Interrupted, Ledger
from .services import Service, Services
from .slots import SlotTable
from .statistics import ScanTally, WorkerStatistics
from .watch import CancelWatch, listen_to_others

log = scrubbed_logger("trio_dispatch.worker")

YIELD_EVERY: Final = 16
"""A slot yields to the scheduler after this many attempts in a row (a
transport that never suspends would otherwise run every row held ahead
before the finisher could write one end). Measured on PostgreSQL at
concurrency 16, no-op drains: a yield after every attempt cost 157-167 us
of client CPU a delivery against 110-117 us without (smaller batches)."""


class DispatchWorker:
    """Deliver due dispatches from ``db`` until cancelled.

    ``transport`` is an async callable or :class:`Transport`; without one,
    the argv ``notify_template`` is run (None: every attempt fails, each
    failure recorded). ``settings`` (a
    :class:`~trio_dispatch.settings.WorkerSettings`, e.g.
    ``WorkerSettings.from_config(config)``) says how it runs; any setting
    may also be given by name as a keyword (``concurrency=4``), which wins:
    ``concurrency`` bounds transports running at once, ``batch_size`` rows
    claimed per scan, ``tick_seconds`` is the idle poll interval (in-process
    enqueues and due retries wake the worker sooner). Settings are checked
    here: a bad one raises ``ValueError`` or ``TypeError`` naming it. ``clock`` is the wall
    clock leases are written in (``time.time``; a test may tie it to a mock
    event-loop clock), ``lease_margin_seconds`` what a lease adds to the
    timeout. ``command_cwd`` is the directory ``notify_template`` runs in
    (None: the worker's own; :meth:`from_config` passes the configuration
    file's folder). ``schedules`` (:class:`~trio_dispatch.schedules.Schedule`)
    fire their ticks from a service beside the claim loop, one dispatch per
    tick however many workers run them (docs/schedules.md). ``destinations``
    maps a ``deliver_to`` value (or ``"*"``) to its
    :class:`~trio_dispatch.destinations.Destination` policy: limits, throttle
    cap and breaker shared by every worker on the store (docs/destinations.md).

    Trio::

        async with trio.open_nursery() as nursery:
            worker = DispatchWorker(db, notify_template=[...])
            await nursery.start(worker.run)

    The same object runs under asyncio through anyio.
    """

    def __init__(
        self,
        db: Store,
        transport: Transport | Callable[..., Any] | None = None,
        settings: WorkerSettings | None = None,
        *,
        notify_template: list[str] | None = None,
        child_env: ChildEnvironment | None = None,
        command_cwd: str | None = None,
        actor: str = ACTOR_DELIVERY,
        logger: logging.Logger | None = None,
        clock: Callable[[], float] = time.time,
        schedules: Sequence[Schedule] = (),
        destinations: Mapping[str, Destination | Mapping[str, Any]] | None = None,
        **setting_values: Any,
    ) -> None:
        require_store(db, "DispatchWorker")
        self.db = db
        self.destinations: dict[str, Destination] = parse_destinations(destinations)
        """Each destination's policy (docs/destinations.md), checked."""
        self._pins = held_starts(self.destinations)
        """Its rated rows' held starts (None: no rate), :mod:`trio_dispatch.outbox.claim.pins`."""
        self._book = DestinationBook(self.destinations)
        self.settings = settings = (settings or WorkerSettings()).updated(setting_values)
        """Every setting, checked, and the one place the worker reads them
        (see :class:`~trio_dispatch.settings.WorkerSettings`)."""
        self.transport: Transport = (
            CommandTransport(
                notify_template,
                timeout=settings.timeout_seconds,
                kill_grace=settings.kill_grace_seconds,
                child_env=child_env,
                cwd=command_cwd,
            )
            if transport is None
            else as_transport(transport, timeout=settings.timeout_seconds)
        )
        self.actor = actor
        self.log = logger or log
        self.clock = clock
        self.counts: dict[str, int] = dict.fromkeys(COUNTER_KEYS, 0)
        """Running totals, with the meanings of ``deliver_due_dispatches``."""
        self.metrics = DeliveryMetrics()
        """Attempts by outcome and kind, and their durations (``/metrics``)."""
        self.destination_metrics = DestinationMetrics(
            preferred=sorted(name for name in self.destinations if name != ANY_DESTINATION)
        )
        """Throttled attempts and breaker changes by destination (``/metrics``)."""
        self._slots = SlotTable(settings.concurrency, ahead=most_ahead(settings.concurrency))
        self._pace = Pace(settings.lease_margin_seconds)
        """How many rows attempts are short enough to hold ahead (:mod:`.finisher`)."""
        self._deliveries: TaskGroup | None = None
        self._cancels = CancelWatch(db, self._slots, self.log)
        """Cuts the attempts an operator cancels (docs/controls.md)."""
        self.cancel_counts = CancelCounts()
        """Cancels of running attempts this worker settled (``/metrics``)."""
        self._caps = (
            None
            if settings.per_destination_concurrency is None
            else DestinationCaps(settings.per_destination_concurrency)
        )
        self._rules = claim_rules(
            ordering=settings.ordering_on_dead_letter,
            caps=self._caps,
            destinations=self.destinations,
            pins=self._pins,
        )
        """What the worker's claims may take (:mod:`trio_dispatch.outbox.claim`)."""
        self._ledger = Ledger(
            self.counts,
            self.metrics,
            self.destination_metrics,
            self.cancel_counts,
            self._rules,
            self.log,
            settings,
            clock,
            self._book,
            self.wake,
        )
        self._finisher = Finisher(
            self._outcome_writer, self._ledger, self._room, self._claimed, self._pins
        )
        self._closing = False  # shutdown began: claim nothing more
        self._interrupt: BaseException | None = None
        """A KeyboardInterrupt a transport raised: :meth:`run` re-raises it
        once the worker has stopped."""
        self._stop: anyio.CancelScope | None = None
        self._pause = ClaimPause()
        self._services = Services()
        self._wake: anyio.Event | None = None
        self._backlog = False
        self._running = False
        self._tally = ScanTally()
        self.expiry = ExpirySweeper(db, self.counts, clock, actor, self.log, settings.tick_seconds)
        """Expires the rows no claim reads at their deadline (:mod:`.expiry`)."""
        self.add_service("expiry", self.expiry.run)
        self.scheduler = Scheduler(db, schedules, clock=clock, log=self.log) if schedules else None
        """Fires the ``schedules``' ticks (docs/schedules.md); None without any."""
        if self.scheduler is not None:
            self.add_service("schedules", self.scheduler.run)

    @classmethod
    def from_config(cls, db: Store, config: ConfiguredWorker, **overrides: Any) -> DispatchWorker:
        """A worker with the settings and transport of a loaded configuration
        file (``Config.worker_options()``); keyword ``overrides`` (settings
        or other arguments) win."""
        options = config.worker_options()
        settings: WorkerSettings = options.pop("settings")
        return cls(db, settings=settings, **{**options, **overrides})

    @property
    def in_flight(self) -> int:
        """Deliveries running now."""
        return len(self._slots)

    def statistics(self) -> WorkerStatistics:
        """A frozen snapshot of the worker's totals and state."""
        return WorkerStatistics(
            **self.counts,
            in_flight=len(self._slots),
            concurrency=self.settings.concurrency,
            **dataclasses.asdict(self._tally),
            running=self._running,
            held_ahead=self._slots.waiting,
            held_starts=0 if self._pins is None else len(self._pins),
        )

    def wake(self) -> None:
        """Scan now instead of at the next tick (safe to call any time)."""
        if self._wake is not None:
            self._wake.set()

    def _enqueued(self) -> None:
        """An enqueue notice: scan now, and let the claims' fair-share turns
        look for a destination that was not there before."""
        self._news()
        self.wake()

    def _news(self) -> None:
        """Rows may have become live: the next claim looks at every head."""
        if self._rules.turns is not None:
            self._rules.turns.news()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Deliver until cancelled; signals ``task_status`` once it listens
        for enqueues. On cancellation it stops claiming, gives running
        deliveries ``grace_seconds``, then kills and releases the rest, and
        only then returns (re-raising the cancellation). A transport that
        raises ``KeyboardInterrupt`` has its row released (due at once),
        stops the worker the same way, and the interrupt is re-raised."""
        if self._running:
            raise WorkerError("this DispatchWorker is already running")
        self._running = True
        self._closing = False
        self._interrupt = None
        self._wake = anyio.Event()
        remove = self.db.on_enqueue(self._enqueued)
        # Before the write too: a claim of the same group commit, after the
        # enqueue, then looks for the new row's destination.
        remove_early = self.db.on_enqueuing(self._news)
        try:
            await self._run(task_status)
        except BaseExceptionGroup as group:
            # A Ctrl-C from elsewhere stops the caller as a KeyboardInterrupt,
            # not as a task group's exception group around one.
            interrupt = keyboard_interrupt(group)
            if interrupt is None:
                raise
            raise interrupt from None
        finally:
            remove()
            remove_early()
            self._wake = None
            self._stop = None
            self._running = False
        if self._interrupt is not None:
            # A transport's Ctrl-C: its row was released and the worker has
            # stopped as on a cancellation; now the interrupt goes on.
            interrupt, self._interrupt = self._interrupt, None
            raise interrupt

    async def _run(self, task_status: TaskStatus[None]) -> None:
        """The run itself: the transport opened, the listener and the claim
        loop started, and on the way out the deliveries stopped."""
        tracing.warm()
        one_writer = await prepare_store(self.db, self.settings, self.log)
        self._slots.ahead_capacity = most_ahead(self.settings.concurrency, one_writer)
        async with AsyncExitStack() as stack:
            if needs_asyncio_loop(self.transport) and sniffio.current_async_library() == "trio":
                import trio_asyncio  # imported only when needed (~0.1 s)

                await stack.enter_async_context(trio_asyncio.open_loop())
            await stack.enter_async_context(opened(self.transport))  # e.g. an HTTP client
            async with anyio.create_task_group() as deliveries:
                self._stop = deliveries.cancel_scope
                self._deliveries = deliveries
                # The listener and the cancel watch hear cancels until the
                # deliveries have stopped (a shutdown's grace included).
                self._services.start(deliveries, self._cancels.run, self.services())
                task_status.started()
                try:
                    await self._claim_loop()
                finally:
                    self._services.stop_unshielded()  # before deliveries get their grace
                    self._closing = True  # no more claims, chained or scanned
                    with anyio.CancelScope(shield=True):
                        await self._stop_deliveries()
                    self._services.stop_all()

    def add_service(self, name: str, service: Service) -> None:
        """Run ``service`` beside the claim loop for as long as the worker
        runs (from its next :meth:`run`); it is cancelled when the worker
        stops, before running deliveries get their grace. An exception out
        of it stops the worker, as one out of the claim loop does."""
        self._services.add(name, service)

    def services(self) -> list[tuple[str, Service]]:
        """What runs beside the claim loop, by name: the cross-process
        listener where the store can tell (and ``listen`` is on), then what
        :meth:`add_service` added."""
        listener = None
        if self.settings.listen and isinstance(self.db, Listener):
            heard = (self.db, self._enqueued, self._cancels, self.settings.tick_seconds, self.log)
            listener = partial(listen_to_others, *heard)
        return self._services.listed(listener)

    async def _claim_loop(self) -> None:
        while True:
            assert self._wake is not None
            self._wake = anyio.Event()  # a wake during the scan triggers another
            delay = await self._scan()
            if delay > 0:
                with anyio.move_on_after(delay):
                    await self._wake.wait()

    async def _scan(self) -> float:
        """Claim what fits in the free slots and start those deliveries;
        return how long to wait before the next scan."""
        room = self._room()
        if self._closing:  # stopping (a transport's Ctrl-C): claim nothing more
            return self.settings.tick_seconds
        paused = self._pause.remaining()
        if paused > 0:  # short of a local resource: let it recover first
            return paused
        if room <= 0:
            self._backlog = True  # a finishing delivery wakes us
            return self.settings.tick_seconds
        limit = min(self.settings.batch_size, room)
        since = anyio.current_time()
        self._finisher.reserved += limit
        try:
            # Shielded: once claims commit they must reach a delivery task
            # (which finishes or releases them), even if the worker is being
            # cancelled meanwhile. Bounded by the store's busy_timeout.
            with anyio.CancelScope(shield=True):
                claims, counts = await claim_due(
                    self.db,
                    limit=limit,
                    lease_seconds=self.settings.lease_seconds,
                    actor=self.actor,
                    clock=self.clock,
                    rules=self._rules,
                )
        except Exception:
            self._finisher.failed()
            self._tally.scan_errors += 1
            self.log.exception("scan failed; retrying in %ss", self.settings.tick_seconds)
            return self.settings.tick_seconds
        finally:
            self._finisher.reserved -= limit
        self._claimed(claims, counts, since)
        if counts["attempted"]:
            self.log.info(
                "scan: claimed=%d expired=%d dead_letter=%d in_flight=%d",
                len(claims),
                counts["expired"],
                counts["dead_letter"],
                len(self._slots),
            )
        self._backlog = counts["attempted"] >= limit
        if self._backlog:
            return 0.0
        # Rows of a destination the rules leave out (at its cap) wait for one
        # of its attempts to end (which wakes the loop), not for their due time.
        return await self._idle_delay()

    async def _idle_delay(self) -> float:
        try:
            due = await next_due_at(self.db, rules=self._rules, now=self.clock())
        except Exception:
            self.log.exception("reading the next due time failed")
            return self.settings.tick_seconds
        if due is None:
            return self.settings.tick_seconds
        return max(0.0, min(self.settings.tick_seconds, due - self.clock()))

    async def _deliver(self, first: Claim) -> None:
        """Deliver ``first``; while rows are claimed ahead, keep the slot and
        deliver the next of them (:mod:`.finisher`)."""
        # Shielded: the worker's own cancellation must not cut a delivery
        # short; shutdown cancels the attempt's scope after the grace instead.
        with anyio.CancelScope(shield=True):
            claim: Claim | None = first
            runs = 0
            while claim is not None:
                current = claim
                runs += 1
                try:
                    with tracing.processing(current) as trace:
                        claim = await self._attempt(current, trace)
                    if claim is not None and runs % YIELD_EVERY == 0:
                        # A transport that never suspends must not keep the
                        # finisher (and every other task) waiting while the
                        # slot runs through the rows held ahead.
                        await anyio.lowlevel.cancel_shielded_checkpoint()
                except Exception:
                    self.log.exception(
                        "dispatch %s attempt %d: delivery task failed",
                        current.dispatch_id,
                        current.attempt,
                    )
                    self._free_slot(current)
                    return

    async def _attempt(self, claim: Claim, trace: tracing.Attempt) -> Claim | None:
        """One attempt, from its start until its end is handed to the
        finisher (or, stopping or interrupted, recorded); returns the next
        claim held ahead that now takes the slot, or None (the slot is then
        free)."""
        started = time.monotonic()
        result: AttemptResult = Interrupted()
        interrupt: BaseException | None = None
        late = None if self._closing else late_claim(claim, self.clock)
        if self._pins is not None:
            self._pins.starting(claim, sent=late is None)
        with self._slots.scope(claim) as scope:
            shared = None if late is not None else share_deadline(self.transport, scope)
            try:
                if late is not None:  # its lease ran out before it came back: never sent
                    result = late
                elif self._slots.cancelled(claim):  # cancelled while held ahead: never sent
                    result = TransportResult.cut_by_cancel()
                else:
                    result = await call_transport(self.transport, claim, shared is not None)
            except BaseException as exc:
                if not is_interrupt(exc):
                    raise
                # A Ctrl-C out of the transport: give the row back at once
                # (no waiting for the lease), then stop the worker as a
                # cancellation would and let run() re-raise it. It must not
                # escape this task: asyncio would raise it straight out of
                # the event loop, with no shutdown at all.
                interrupt = exc
                self._closing = True  # no more claims
                result = Interrupted(INTERRUPT_REASON)
        if scope.cancelled_caught and interrupt is None:
            cut = Cut(self._slots.cut_at(claim), self._slots.cancelled(claim), self._closing)
            result = cut.result(result, shared, self.settings.lease_seconds)
        trace.record(result)
        if isinstance(result, Interrupted) or self._closing or result.local:
            # Given back or recorded now, and no next claim for this slot.
            writer = self._outcome_writer()
            if isinstance(result, Interrupted):
                outcome = await writer.settle(claim, result)
                self._ledger.interrupted(claim, result, started, outcome)
            else:
                effects = Effects()
                self._pause.note(result, self.log)  # logged once the release is recorded
                outcome = await writer.settle(claim, result, effects)
                self._ledger.recorded(claim, result, effects, started, outcome)
            self._free_slot(claim)
            if interrupt is not None:
                self._stopped_by(interrupt)
            return None
        self._pause.note(result, self.log)
        self._pace.note(time.monotonic() - started)
        # The end is written behind the slot, which takes the next row held
        # ahead at once: it never waits for that commit.
        self._slots.release(claim)
        if self._finisher.hand(End(claim, result, started)):
            assert self._deliveries is not None
            self._deliveries.start_soon(self._finisher.run)
        return self._slots.start_ahead()

    def _room(self) -> int:
        """How many rows the worker may claim now: its free slots, and while
        attempts are short, the rows to hold ahead of them."""
        if self._closing or self._pause.remaining() > 0:
            return 0
        slots = self._slots
        ahead = self._pace.ahead_rows(slots.capacity, slots.ahead_capacity)
        return slots.free + ahead - slots.waiting - self._finisher.reserved

    def _claimed(self, claims: list[Claim], counts: dict[str, int], since: float) -> None:
        """Hold ``claims`` (a scan's or a finish's, made by a write that
        began at ``since``) ahead of the slots and start what fits; claimed
        as the worker began to stop, they are given back at once."""
        self._tally.scanned(self.counts, counts, sum(c.recovered for c in claims), self.clock())
        for claim in claims:
            self._slots.hold(claim, self._attempt_scope(claim))
        if self._pins is not None:
            self._pins.claimed(claims)
        self._cancels.claimed(claims, since)
        if self._closing:
            if claims and self._deliveries is not None:
                self._deliveries.start_soon(self._finisher.give_back, self._slots.drop_ahead())
            return
        assert self._deliveries is not None
        while (started := self._slots.start_ahead()) is not None:
            self._deliveries.start_soon(self._deliver, started)
        # A destination's room may have been what held rows back: look again.
        limited = self._caps is not None or bool(self.destinations)
        if not claims and len(self._slots) < self._slots.capacity and (self._backlog or limited):
            self.wake()

    def _stopped_by(self, interrupt: BaseException) -> None:
        """Stop the worker (grace for the other deliveries, then release)
        and have :meth:`run` re-raise ``interrupt`` when it is done."""
        found = keyboard_interrupt(interrupt)
        if self._interrupt is None:
            self._interrupt = found if found is not None else interrupt
        if self._stop is not None:
            self._stop.cancel()

    def _attempt_scope(self, claim: Claim) -> anyio.CancelScope:
        """The attempt's cancel scope, cut at its own lease end."""
        return anyio.CancelScope(deadline=attempt_deadline(claim, self.clock))

    def _free_slot(self, claim: Claim) -> None:
        self._rules.ended([(claim.dispatch_id, claim.lease_until)])
        # A destination's room may have been what held rows back: look again.
        limited = self._caps is not None or bool(self.destinations)
        if self._slots.release(claim) and (self._backlog or limited):
            self.wake()

    def _outcome_writer(self) -> OutcomeWriter:
        """The writes that end an attempt, as the worker is now (stopping or not)."""
        return OutcomeWriter(
            self.db,
            self.actor,
            self.clock,
            self.settings,
            self._rules,
            self.log,
            destinations=self._book,
            stopping=self._closing,
        )

    async def _stop_deliveries(self) -> None:
        """Give back the rows held ahead at once; then grace, then cancel
        what is still running (the tasks release their rows themselves,
        inside their shields)."""
        await self._finisher.give_back(self._slots.drop_ahead())
        if not len(self._slots):
            return
        self.log.info(
            "stopping: waiting up to %gs for %d running deliveries",
            self.settings.grace_seconds,
            len(self._slots),
        )
        await self._slots.wait_drained(self.settings.grace_seconds)
        self._slots.cancel_all()
