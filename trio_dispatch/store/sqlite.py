"""The SQLite engine: WAL, one writer connection per process, group commit.

Every write unit of work of this process goes through one writer connection
on a worker thread (``anyio.to_thread``), so the same store runs under trio
and asyncio. Units that arrive while a batch is running are queued and the
next batch runs them all in one ``BEGIN IMMEDIATE`` transaction, each inside
its own savepoint: the commit is paid once per batch, and a unit that raises
rolls back its own savepoint only, so one caller's error never fails
another's write. Reads use a second connection (a WAL snapshot), so they never
wait for the writer. Several processes may share one file: ``BEGIN
IMMEDIATE`` plus ``busy_timeout`` serialise their writers.
"""

from __future__ import annotations

import enum
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Final, Literal

import anyio
import sqlite_utils

from .base import ItemT, ResultT, Row, T
from .schema import MIGRATIONS, SCHEMA_VERSION, SCHEMA_VERSION_TABLE

Durability = Literal["full", "normal"]
DURABILITIES: Final = ("full", "normal")
DEFAULT_BUSY_TIMEOUT_SECONDS: Final = 10.0


class SchemaError(RuntimeError):
    """The database's schema cannot be used by this version."""


class SQLiteConn:
    """A :class:`~trio_dispatch.store.base.Conn` over one sqlite3 connection."""

    __slots__ = ("_conn", "_db")

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self._db = sqlite_utils.Database(conn, recursive_triggers=False, execute_plugins=False)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        return self._conn.execute(sql, params).rowcount

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> int:
        return self._conn.executemany(sql, rows).rowcount

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        return list(self._db.query(sql, params))

    def query_one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        for row in self._db.query(sql, params):
            return row
        return None

    @property
    def utils(self) -> sqlite_utils.Database:
        """The sqlite-utils view of this connection (schema introspection)."""
        return self._db


class _State(enum.Enum):
    QUEUED = 1
    RUNNING = 2
    DONE = 3


class _Unit:
    """One caller's write: ``work(conn)``, or -- coalesced -- one ``item`` for
    ``many(conn, items)``, which handles every queued item of the same
    ``many`` in one call and returns their results in order."""

    __slots__ = ("alone", "error", "item", "many", "result", "state", "work")

    def __init__(
        self,
        work: Callable[[SQLiteConn], Any] | None,
        many: Callable[[SQLiteConn, list[Any]], list[Any]] | None = None,
        item: Any = None,
    ) -> None:
        self.work = work
        self.many = many
        self.item = item
        self.alone = False  # set after its group failed: run it by itself
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


def _run_step(conn: SQLiteConn, step: list[_Unit]) -> None:
    first = step[0]
    if first.many is None:
        assert first.work is not None
        first.result = first.work(conn)
        return
    results = first.many(conn, [unit.item for unit in step])
    for unit, result in zip(step, results, strict=True):
        unit.result = result


def _connect(path: str, *, durability: Durability, busy_timeout: float) -> sqlite3.Connection:
    # isolation_level=None: we issue BEGIN/COMMIT ourselves, never implicitly.
    conn = sqlite3.connect(
        path, timeout=busy_timeout, isolation_level=None, check_same_thread=False
    )
    conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
    conn.execute("PRAGMA foreign_keys = ON")
    if path != ":memory:":
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise SchemaError(f"cannot put {path!r} in WAL mode (journal_mode is {mode!r})")
    conn.execute(f"PRAGMA synchronous = {'FULL' if durability == 'full' else 'NORMAL'}")
    return conn


def _migrate(conn: sqlite3.Connection, path: str) -> int:
    """Bring the schema to :data:`SCHEMA_VERSION`, forward only, in one
    IMMEDIATE transaction per step; return the version found before."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {SCHEMA_VERSION_TABLE} "
            "(version INTEGER NOT NULL, applied_at FLOAT NOT NULL)"
        )
        row = conn.execute(f"SELECT MAX(version) FROM {SCHEMA_VERSION_TABLE}").fetchone()
        found = int(row[0] or 0)
        if found > SCHEMA_VERSION:
            raise SchemaError(
                f"{path!r} has schema version {found}, newer than this trio_dispatch "
                f"supports ({SCHEMA_VERSION}); upgrade trio_dispatch instead"
            )
        for version in range(found, SCHEMA_VERSION):
            for statement in MIGRATIONS[version]:
                conn.execute(statement)
            conn.execute(
                f"INSERT INTO {SCHEMA_VERSION_TABLE} (version, applied_at) VALUES (?, ?)",
                (version + 1, time.time()),
            )
    except BaseException:
        _rollback(conn)
        raise
    _commit(conn)
    return found


def _rollback(conn: sqlite3.Connection) -> None:
    # SQLite may already have rolled back by itself (e.g. SQLITE_FULL).
    if conn.in_transaction:
        conn.execute("ROLLBACK")


def _commit(conn: sqlite3.Connection) -> None:
    """COMMIT, or roll back and re-raise if the commit fails."""
    try:
        conn.execute("COMMIT")
    except BaseException:
        _rollback(conn)
        raise


class SQLiteStore:
    """An open SQLite store. Create it with :func:`trio_dispatch.open_store`."""

    def __init__(
        self,
        path: str,
        *,
        durability: Durability = "full",
        busy_timeout: float = DEFAULT_BUSY_TIMEOUT_SECONDS,
    ) -> None:
        if durability not in DURABILITIES:
            raise ValueError(f"durability must be one of {DURABILITIES}, got {durability!r}")
        self.path = path
        self.url = "sqlite:///:memory:" if path == ":memory:" else f"sqlite:///{path}"
        self.durability: Durability = durability
        self.busy_timeout = busy_timeout
        self._writer: sqlite3.Connection | None = None
        self._reader: sqlite3.Connection | None = None
        self._writer_conn: SQLiteConn
        self._reader_conn: SQLiteConn | None = None
        self._write_limiter = anyio.CapacityLimiter(1)
        self._read_limiter = anyio.CapacityLimiter(1)
        self._queue: list[_Unit] = []
        self._busy = False  # a batch or a caller's transaction holds the writer
        self._idle = anyio.Event()
        self._tx_owner: object | None = None
        self._listeners: list[Callable[[], None]] = []
        self._closed = False
        self.stats = {"batches": 0, "units": 0}
        """Write transactions run by group commit, and the units they held."""

    # -- lifecycle ---------------------------------------------------------

    async def _open(self) -> None:
        def open_all() -> None:
            writer = _connect(
                self.path, durability=self.durability, busy_timeout=self.busy_timeout
            )
            try:
                _migrate(writer, self.path)
                if self.path != ":memory:":
                    reader = _connect(
                        self.path, durability=self.durability, busy_timeout=self.busy_timeout
                    )
                    reader.execute("PRAGMA query_only = ON")
                    self._reader = reader
            except BaseException:
                writer.close()
                raise
            self._writer = writer
            self._writer_conn = SQLiteConn(writer)
            self._reader_conn = None if self._reader is None else SQLiteConn(self._reader)

        await anyio.to_thread.run_sync(open_all, limiter=self._write_limiter)

    async def aclose(self) -> None:
        """Wait for the writer to go idle, then close both connections."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            while self._busy:
                await self._idle.wait()
            writer, reader = self._writer, self._reader
            self._writer = self._reader = None

            def close_all() -> None:
                for conn in (reader, writer):
                    if conn is not None:
                        conn.close()

            await anyio.to_thread.run_sync(close_all, limiter=self._write_limiter)

    # -- reads -------------------------------------------------------------

    async def read(self, work: Callable[[SQLiteConn], T]) -> T:
        if self._reader is None:
            # ":memory:" has no second connection that could see the data.
            return await self.write(work)
        reader, conn = self._reader, self._reader_conn
        assert conn is not None

        def run() -> T:
            reader.execute("BEGIN")
            try:
                return work(conn)
            finally:
                reader.execute("COMMIT")

        return await anyio.to_thread.run_sync(run, limiter=self._read_limiter)

    # -- writes: group commit ------------------------------------------------

    async def write(self, work: Callable[[SQLiteConn], T]) -> T:
        result: T = await self._submit(_Unit(work))
        return result

    async def write_many(
        self, many: Callable[[SQLiteConn, list[ItemT]], list[ResultT]], item: ItemT
    ) -> ResultT:
        result: ResultT = await self._submit(_Unit(None, many, item))
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
                await anyio.to_thread.run_sync(
                    self._run_batch, batch, limiter=self._write_limiter
                )
        finally:
            for unit in batch:
                unit.state = _State.DONE
            self._release()

    def _release(self) -> None:
        self._busy = False
        idle, self._idle = self._idle, anyio.Event()
        idle.set()

    def _run_batch(self, batch: list[_Unit]) -> None:
        """Runs in the writer thread: the whole batch in one transaction.

        Units run one after another with no savepoints (they cost two
        statements a unit on the hot path). If a unit raises, the transaction
        is rolled back, that unit keeps its error, and the others run again
        in a new transaction -- so one caller's error never fails or undoes
        another's write, and every result reported was committed.
        """
        writer = self._writer
        if writer is None:
            for unit in batch:
                unit.error = RuntimeError(f"store {self.url} is closed")
            return
        conn = self._writer_conn
        todo = batch
        while todo:
            try:
                writer.execute("BEGIN IMMEDIATE")
            except BaseException as exc:  # e.g. "database is locked" past busy_timeout
                for unit in todo:
                    unit.error = exc
                return
            todo = self._run_units(writer, conn, todo)

    @staticmethod
    def _run_units(
        writer: sqlite3.Connection, conn: SQLiteConn, units: list[_Unit]
    ) -> list[_Unit]:
        """Run ``units`` in the open transaction and commit; return the units
        to run again in a new transaction (empty when this one settled)."""
        try:
            for step in _steps(units):
                try:
                    _run_step(conn, step)
                except BaseException as exc:
                    _rollback(writer)
                    if len(step) > 1:
                        # Which item failed is unknown: each runs alone next time.
                        for unit in step:
                            unit.alone = True
                        rerun = units
                    else:
                        step[0].error = exc
                        rerun = [unit for unit in units if unit is not step[0]]
                    for other in rerun:
                        other.result = None
                    return rerun
            writer.execute("COMMIT")
        except BaseException as exc:  # the transaction itself failed: nothing committed
            for unit in units:
                if unit.error is None:
                    unit.result, unit.error = None, exc
            _rollback(writer)
        return []

    # -- caller-owned transactions (SPEC B1) --------------------------------

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[SQLiteTransaction]:
        self._check_usable()
        while self._busy:
            await self._idle.wait()
        writer = self._writer
        if writer is None:
            raise RuntimeError(f"store {self.url} is closed")
        self._busy = True
        self._tx_owner = anyio.get_current_task().id
        tx = SQLiteTransaction(self, writer)
        try:
            await anyio.to_thread.run_sync(writer.execute, "BEGIN IMMEDIATE",
                                           limiter=self._write_limiter)
            try:
                yield tx
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(
                        _rollback, writer, limiter=self._write_limiter
                    )
                raise
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(tx._commit, limiter=self._write_limiter)
        finally:
            tx._closed = True
            self._tx_owner = None
            self._release()
        if tx._enqueued:
            self.notify_enqueued()

    def _check_usable(self) -> None:
        if self._closed or self._writer is None:
            raise RuntimeError(f"store {self.url} is closed")
        if self._tx_owner is not None and self._tx_owner == anyio.get_current_task().id:
            raise RuntimeError(
                "this task holds an open transaction on the store: pass the transaction "
                "handle (not the store) to calls made inside `async with db.transaction()`"
            )

    # -- wake-ups ------------------------------------------------------------

    def on_enqueue(self, callback: Callable[[], None]) -> Callable[[], None]:
        self._listeners.append(callback)

        def remove() -> None:
            if callback in self._listeners:
                self._listeners.remove(callback)

        return remove

    def notify_enqueued(self) -> None:
        for callback in list(self._listeners):
            callback()


class SQLiteTransaction:
    """A caller-owned write transaction on the store's writer connection."""

    def __init__(self, store: SQLiteStore, conn: sqlite3.Connection) -> None:
        self._store = store
        self._conn = conn
        self._closed = False
        self._enqueued = False
        self._lost: RuntimeError | None = None

    async def _run(self, fn: Callable[[], T]) -> T:
        if self._closed:
            raise RuntimeError("the transaction has ended")
        return await anyio.to_thread.run_sync(
            self._guarded, fn, limiter=self._store._write_limiter
        )

    def _guarded(self, fn: Callable[[], T]) -> T:
        # If SQLite rolled the transaction back by itself (disk full, I/O
        # error), the connection is in autocommit mode: running on would
        # commit statements one by one, outside the caller's transaction.
        if self._lost is not None:
            raise self._lost
        try:
            return fn()
        finally:
            if not self._conn.in_transaction:
                self._lost = RuntimeError(
                    "the transaction was rolled back by SQLite after an error; "
                    "nothing in it was committed"
                )

    def _commit(self) -> None:
        if self._lost is not None:
            raise self._lost
        _commit(self._conn)

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        return await self._run(lambda: self._conn.execute(sql, params).rowcount)

    async def query(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        return await self._run(lambda: SQLiteConn(self._conn).query(sql, params))

    async def read(self, work: Callable[[SQLiteConn], T]) -> T:
        return await self._run(lambda: work(SQLiteConn(self._conn)))

    async def write(self, work: Callable[[SQLiteConn], T]) -> T:
        def in_savepoint() -> T:
            self._conn.execute("SAVEPOINT unit")
            try:
                result = work(SQLiteConn(self._conn))
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK TO unit")
                    self._conn.execute("RELEASE unit")
                raise
            self._conn.execute("RELEASE unit")
            return result

        return await self._run(in_savepoint)

    async def write_many(
        self, many: Callable[[SQLiteConn, list[ItemT]], list[ResultT]], item: ItemT
    ) -> ResultT:
        return await self.write(lambda conn: many(conn, [item])[0])

    def notify_enqueued(self) -> None:
        self._enqueued = True


def sqlite_path_from_target(target: str | Path) -> str:
    """The file path (or ``":memory:"``) that ``target`` names."""
    if isinstance(target, Path):
        return str(target)
    if target.startswith("sqlite://"):
        rest = target[len("sqlite://"):]
        if not rest.startswith("/"):
            raise ValueError(
                f"store URL must look like sqlite:///path/to/file.db, got {target!r}"
            )
        path = rest[1:]  # sqlite:///rel.db -> rel.db, sqlite:////abs.db -> /abs.db
        if not path:
            raise ValueError(f"store URL names no file: {target!r}")
        return path
    if not target:
        raise ValueError("store target must be a path, ':memory:' or a URL, got ''")
    return target
