"""Group commit and caller-owned transactions, for any engine.

Every write unit of work of this process goes through one writer connection
on the store's own thread, so a store runs under trio and asyncio alike.
Units that arrive while a batch is running are queued and the next batch
runs them all in one transaction: the commit is paid once per
batch. If a unit raises, the batch is rolled back, that unit keeps its
error, and the others run again in a new transaction -- one caller's error
never fails or undoes another's write, and every result reported was
committed. An engine supplies the connection and five synchronous
primitives (begin, commit, rollback, in-transaction, close).

A connection that ends under a batch (:class:`~.base.ConnectionLostError`,
raised by an engine that reconnects) fails the units whose statement was
running -- all the items of a coalesced step, since which of them the
server saw is unknown -- and nothing else: the other units of the batch
had not been committed either, and run again in a new transaction (the
engine reconnects when it begins), as after any unit's error. A connection
that ends during the COMMIT fails every unit of the batch with an error
saying the outcome is unknown; none is run again, since running twice
what may have committed is not safe in general (an enqueue without a
``dedup_key`` would be sent twice). A batch of one unit that promised one
statement (``single``) may run as that statement alone, committing by
itself (PostgreSQL: one round trip instead of two); a connection ending
under it leaves the outcome unknown in the same way.

The writer's thread (a :class:`~trio_dispatch._threads.ServiceThread`) is
started on first use and stopped by :meth:`BatchingStore.aclose`. Under trio
and asyncio alike a job handed to it and its result handed back cost about
100 us on a 2-core VM, against 150-170 us for ``to_thread.run_sync`` (which
also names the thread and takes a limiter on every call). A lock serialises
every use of the writer connection; a caller cancelled before its job is
queued runs nothing, and one cancelled later waits for the job to end (the
cancellation is raised afterwards).

A caller-owned transaction (:meth:`BatchingStore.transaction`) costs one hop
to the writer's thread per statement plus one for the commit: ``BEGIN``
rides with the first statement, and a transaction that ran nothing commits
nothing.
"""

from __future__ import annotations

import abc
import enum
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, Final, TypeVar

import anyio

from .._threads import ServiceThread
from ..errors import TransactionMisuse
from ..redact import mask_url
from .base import (
    Conn,
    ConnectionLostError,
    ItemT,
    KeyOrderConflict,
    ResultT,
    StoreError,
    StoreOptions,
    T,
)
from .transaction import BatchingTransaction

CONFLICT_TRIES: Final = 3
"""How many times a unit whose transaction the database aborted to break a
deadlock is run again before the deadlock is reported."""


class _State(enum.Enum):
    QUEUED = 1
    RUNNING = 2
    DONE = 3


class _Unit:
    """One caller's write: ``work(conn)``, or -- coalesced -- one ``item`` for
    ``many(conn, items)``, which handles every queued item of the same
    ``many`` in one call and returns their results in order."""

    __slots__ = (
        "alone",
        "error",
        "first",
        "item",
        "many",
        "result",
        "single",
        "solo",
        "state",
        "tries",
        "work",
    )

    def __init__(
        self,
        work: Callable[[Conn], Any] | None,
        many: Callable[[Conn, list[Any]], list[Any]] | None = None,
        item: Any = None,
        single: bool = False,
    ) -> None:
        self.work = work
        self.many = many
        self.item = item
        self.single = single  # alone in its transaction, it is one statement
        self.alone = False  # set after its group failed: run it by itself
        self.first = False  # set after a key-order conflict: first in its transaction
        self.solo = False  # set after one while first: alone, waiting for keys in its order
        self.tries = 0  # transactions the database aborted under it (deadlocks)
        self.state = _State.QUEUED
        self.result: Any = None
        self.error: BaseException | None = None


def _steps(units: list[_Unit]) -> list[list[_Unit]]:
    """Units in the order to run them: plain ones alone, coalesced ones
    grouped by their ``many`` function (at the place of the first)."""
    steps: list[list[_Unit]] = []
    groups: dict[Any, list[_Unit]] = {}
    for unit in units:
        if unit.many is None or unit.alone:
            steps.append([unit])
        elif unit.many in groups:
            groups[unit.many].append(unit)
        else:
            groups[unit.many] = [unit]
            steps.append(groups[unit.many])
    return steps


def _run_step(conn: Conn, step: list[_Unit]) -> None:
    first = step[0]
    if first.many is None:
        assert first.work is not None
        first.result = first.work(conn)
        return
    results = first.many(conn, [unit.item for unit in step])
    for unit, result in zip(step, results, strict=True):
        unit.result = result


class BatchingStore(abc.ABC):
    """The engine-independent half of a store (see the module docstring)."""

    url: str
    """Where the store is, with any password masked: safe to log."""

    def __init__(self, url: str, options: StoreOptions) -> None:
        self.url = mask_url(url)
        self.options = options
        """How the store was opened."""
        self.read_only = options.read_only
        """Opened for reading only: never writes, creates or migrates."""
        self.migrate = options.migrate and not options.read_only
        """Opening creates or migrates the schema (else it must be current)."""
        self.max_body_bytes = options.max_body_bytes
        """The largest enqueue ``body`` accepted, in bytes of JSON."""
        self.found_schema_version: int | None = None
        """The schema version the database had when this store opened it
        (None: it had no outbox schema and opening created one)."""
        self._writer_conn: Conn | None = None
        self._write_limiter = anyio.CapacityLimiter(1)
        self._writer_lock = threading.Lock()
        self._writer_thread: ServiceThread | None = None
        self._queue: list[_Unit] = []
        self._busy = False  # a batch or a caller's transaction holds the writer
        self._idle = anyio.Event()
        self._tx_owner: object | None = None
        self._listeners: list[Callable[[], None]] = []
        self._early_listeners: list[Callable[[], None]] = []
        self._cancel_listeners: list[Callable[[str], None]] = []
        self._closed = False
        self.stats = {"batches": 0, "units": 0, "hops": 0}
        """Write transactions run by group commit, the units they held, and
        the jobs handed to the writer's thread (each a round trip)."""

    @property
    def queued_writes(self) -> int:
        """Units of work waiting for the writer now, behind the batch or the
        caller's transaction that holds it (the next group commit's size)."""
        return len(self._queue)

    # -- what an engine supplies (all called on the writer's thread) ---------

    @abc.abstractmethod
    def _connect_all(self) -> None:
        """Open the connections; create or migrate the schema (``migrate``),
        or check that it is current. Raise, leaving nothing open, on
        failure."""

    @abc.abstractmethod
    def _begin(self) -> None:
        """Start a write transaction on the writer connection (waiting for
        other processes' writers as the engine allows)."""

    def _begin_single(self) -> None:
        """Start a write transaction that will hold exactly one statement.
        An engine whose statements commit by themselves outside a
        transaction (PostgreSQL) may send that statement alone, one round
        trip with no ``BEGIN`` or ``COMMIT``; then :meth:`_commit` and
        :meth:`_rollback` have nothing left to do. By default: :meth:`_begin`."""
        self._begin()

    @abc.abstractmethod
    def _commit(self) -> None:
        """Commit the writer's transaction."""

    @abc.abstractmethod
    def _rollback(self) -> None:
        """Roll the writer's transaction back; no error if none is open."""

    @abc.abstractmethod
    def _in_transaction(self) -> bool:
        """Whether the writer's transaction is still open (the database may
        abandon one by itself after an error)."""

    @abc.abstractmethod
    def _close_connections(self) -> None:
        """Close every connection (the store is idle)."""

    def _keys_wait(self) -> None:
        """From now to its end, this transaction's ordering-key locks wait
        in the order they are asked for (a caller's own transaction, which
        the group commit does not compose; a unit that runs alone): by
        default nothing changes (an engine whose write lock serializes
        every writer has no key locks)."""
        return

    def _settled_error(self, exc: BaseException) -> BaseException | None:
        """What a unit that raised ``exc`` reports: None if the database
        aborted the transaction to resolve a conflict that running it again
        may not meet (a deadlock), else the error (by default ``exc``
        itself; an engine may turn its driver's errors into
        :class:`StoreError`)."""
        return exc

    # -- lifecycle -----------------------------------------------------------

    async def open(self) -> None:
        """Connect on the writer's thread (see :meth:`_connect_all`). If that
        fails, the thread is stopped again and the error propagates."""
        try:
            await self._in_writer(self._connect_all)
        except BaseException:
            self._stop_writer_thread()
            raise

    async def aclose(self) -> None:
        """Wait for the writer to go idle, then close the connections."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            while self._busy:
                await self._idle.wait()
            self._writer_conn = None
            try:
                await self._in_writer(self._close_connections)
            finally:
                self._stop_writer_thread()

    def _stop_writer_thread(self) -> None:
        """End the writer's own thread, if it was started (its queue is
        empty: nothing else uses the store by now)."""
        if self._writer_thread is not None:
            self._writer_thread.stop()
            self._writer_thread = None

    async def _in_writer(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` with the writer connection to itself, on the
        writer's thread; wait for it to end even if cancelled meanwhile."""
        if self._writer_thread is None:
            # Not the URL in its name: it may hold a password.
            self._writer_thread = ServiceThread(f"trio_dispatch writer {id(self):#x}")
        self.stats["hops"] += 1
        result: T = await self._writer_thread.run(partial(self._locked, fn, *args))
        return result

    def _locked(self, fn: Callable[..., T], *args: Any) -> T:
        with self._writer_lock:
            return fn(*args)

    # -- writes: group commit ------------------------------------------------

    async def write(self, work: Callable[[Conn], T]) -> T:
        result: T = await self._submit(_Unit(work))
        return result

    async def write_many(
        self,
        many: Callable[[Conn, list[ItemT]], list[ResultT]],
        item: ItemT,
        single: bool = False,
    ) -> ResultT:
        result: ResultT = await self._submit(_Unit(None, many, item, single))
        return result

    async def _submit(self, unit: _Unit) -> Any:
        self._check_usable()
        self._queue.append(unit)
        try:
            while unit.state is not _State.DONE:
                if self._busy:
                    await self._idle.wait()
                else:
                    await self._lead_batch()
        except BaseException:
            if unit.state is _State.QUEUED:
                self._queue.remove(unit)
                raise
            # Taken into a running batch: it will commit or fail as a whole;
            # report the cancellation only once it is settled.
            with anyio.CancelScope(shield=True):
                while unit.state is not _State.DONE:
                    await self._idle.wait()
            raise
        if unit.error is not None:
            raise unit.error
        return unit.result

    async def _lead_batch(self) -> None:
        self._busy = True
        try:
            # One scheduling round first: the writers that are ready to run
            # (typically the ones the last batch just woke) queue their units
            # and ride in this batch instead of forming the next one. Cancelled
            # here, this caller's unit is still queued: it is removed, unrun.
            await anyio.lowlevel.checkpoint()
        except BaseException:
            self._release()
            raise
        batch, self._queue = self._queue, []
        for unit in batch:
            unit.state = _State.RUNNING
        self.stats["batches"] += 1
        self.stats["units"] += len(batch)
        try:
            with anyio.CancelScope(shield=True):
                await self._in_writer(self._run_batch, batch)
        finally:
            for unit in batch:
                unit.state = _State.DONE
            self._release()

    def _release(self) -> None:
        self._busy = False
        idle, self._idle = self._idle, anyio.Event()
        idle.set()

    def _run_batch(self, batch: list[_Unit]) -> None:
        """Runs in the writer thread: the whole batch in one transaction."""
        conn = self._writer_conn
        if conn is None:
            for unit in batch:
                unit.error = StoreError(f"store {self.url} is closed")
            return
        todo = batch
        while todo:
            try:
                if len(todo) == 1 and todo[0].single and not todo[0].first:
                    self._begin_single()
                else:
                    self._begin()
            except BaseException as exc:  # e.g. "database is locked" past busy_timeout
                for unit in todo:
                    unit.error = exc
                return
            todo = self._run_units(conn, todo)

    def _commit_before(self, steps: list[list[_Unit]], index: int) -> list[_Unit]:
        """Commit the steps before ``index`` (a failed commit is their
        error) and return the units of the rest, for the next transaction."""
        try:
            self._commit()
        except BaseException as exc:
            for step in steps[:index]:
                for unit in step:
                    unit.result, unit.error = None, exc
            self._rollback()
        return [unit for later in steps[index:] for unit in later]

    def _after_conflict(
        self, units: list[_Unit], step: list[_Unit], *, first: bool, exc: BaseException
    ) -> list[_Unit]:
        """The units to run again after ``step`` met a conflict and the
        transaction was rolled back: all of them, ``step`` first in its own
        transaction (then it takes its key locks in order); a step that was
        first already takes its own keys out of order and runs alone
        (``solo``). A deadlock is tried again :data:`CONFLICT_TRIES` times,
        then reported."""
        order = isinstance(exc, KeyOrderConflict)
        for unit in step:
            unit.first = True
            unit.solo = unit.solo or (order and first)
            unit.tries += 0 if order else 1
        exhausted = [unit for unit in step if unit.tries > CONFLICT_TRIES]
        for unit in exhausted:
            unit.error = StoreError(
                f"store {self.url}: the database aborted this write {CONFLICT_TRIES + 1} "
                "times to resolve a conflict with another transaction (a deadlock); "
                "nothing was committed"
            )
        rerun = sorted((u for u in units if u not in exhausted), key=lambda u: not u.first)
        for unit in rerun:
            unit.result = None
        return rerun

    def _run_units(self, conn: Conn, units: list[_Unit]) -> list[_Unit]:
        """Run ``units`` in the open transaction and commit; return the units
        to run again in a new transaction (empty when this one settled).
        A unit marked ``first`` (after a key-order conflict) that is not
        first here ends this transaction before it: what ran commits, and
        it starts the next. A unit marked ``solo`` (it conflicted even
        first: it takes its own keys out of order) runs alone in its
        transaction, waiting for each key as it asks (a deadlock that may
        close is broken by the server and tried again, a bounded number of
        times)."""
        try:
            steps = _steps(units)
            for index, step in enumerate(steps):
                if index and any(unit.first or unit.solo for unit in step):
                    return self._commit_before(steps, index)
                solo = any(unit.solo for unit in step)
                try:
                    if solo:
                        self._keys_wait()  # its key locks wait, in its own order
                    _run_step(conn, step)
                    if solo and len(steps) > 1:  # commit it alone; the rest go next
                        return self._commit_before(steps, 1)
                except BaseException as exc:
                    self._rollback()
                    settled = (
                        None if isinstance(exc, KeyOrderConflict) else self._settled_error(exc)
                    )
                    if settled is None:
                        return self._after_conflict(units, step, first=index == 0, exc=exc)
                    if isinstance(exc, ConnectionLostError):
                        # The step was on the wire when the connection ended:
                        # its units fail (nothing of them committed). The
                        # others never committed either; they run again, on
                        # a new connection if one can be had.
                        for unit in step:
                            unit.error = exc
                        rerun = [unit for unit in units if unit not in step]
                    elif len(step) > 1:
                        # Which item failed is unknown: each runs alone next time.
                        for unit in step:
                            unit.alone = True
                        rerun = units
                    else:
                        step[0].error = settled
                        rerun = [unit for unit in units if unit is not step[0]]
                    for other in rerun:
                        other.result = None
                    return rerun
            self._commit()
        except BaseException as exc:  # the transaction itself failed: nothing committed
            for unit in units:
                if unit.error is None:
                    unit.result, unit.error = None, exc
            self._rollback()
        return []

    # -- caller-owned transactions (docs/usage.md) -----------------------------

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[BatchingTransaction]:
        self._check_usable()
        while self._busy:
            await self._idle.wait()
        conn = self._writer_conn
        if conn is None:
            raise StoreError(f"store {self.url} is closed")
        self._busy = True
        self._tx_owner = anyio.get_current_task().id
        tx = BatchingTransaction(self, conn)
        try:
            try:
                yield tx
            except BaseException:
                if tx._begun:
                    with anyio.CancelScope(shield=True):
                        await self._in_writer(self._rollback)
                raise
            if tx._begun:
                with anyio.CancelScope(shield=True):
                    await self._in_writer(tx._finish)
        finally:
            tx._closed = True
            self._tx_owner = None
            self._release()
        if tx._enqueued:
            self.notify_enqueued()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}{' read-only' if self.read_only else ''}>"

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"store {self.url} is closed")

    def _check_usable(self) -> None:
        """Raise unless this store may write now (open, not read-only, not
        inside this task's own transaction)."""
        self._check_open()
        if self.read_only:
            raise StoreError(f"store {self.url} is open read-only: it cannot write")
        if self._writer_conn is None:
            raise StoreError(f"store {self.url} is closed")
        if self._tx_owner is not None and self._tx_owner == anyio.get_current_task().id:
            raise TransactionMisuse(
                "this task holds an open transaction on the store: pass the transaction "
                "handle (not the store) to calls made inside `async with db.transaction()`"
            )

    # -- wake-ups --------------------------------------------------------------

    def on_enqueue(self, callback: Callable[[], None]) -> Callable[[], None]:
        return _listen(self._listeners, callback)

    def notify_enqueued(self) -> None:
        for callback in list(self._listeners):
            callback()

    def on_enqueuing(self, callback: Callable[[], None]) -> Callable[[], None]:
        return _listen(self._early_listeners, callback)

    def notify_enqueuing(self) -> None:
        for callback in list(self._early_listeners):
            callback()

    def on_cancel(self, callback: Callable[[str], None]) -> Callable[[], None]:
        return _listen(self._cancel_listeners, callback)

    def notify_cancel(self, dispatch_id: str) -> None:
        for callback in list(self._cancel_listeners):
            callback(dispatch_id)


CallbackT = TypeVar("CallbackT", bound=Callable[..., None])


def _listen(listeners: list[CallbackT], callback: CallbackT) -> Callable[[], None]:
    """Add ``callback`` to ``listeners``; return what removes it."""
    listeners.append(callback)

    def remove() -> None:
        if callback in listeners:
            listeners.remove(callback)

    return remove
