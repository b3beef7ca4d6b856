"""Enqueue inside the transaction you already have (docs/usage.md#use-your-own-connection).

An outbox is transactional only if its row commits with the caller's own
writes. These functions write through the caller's connection, inside the
caller's current transaction, and never commit, roll back or close it::

    import sqlite3
    from trio_dispatch import sync as outbox

    conn = sqlite3.connect("app.db")
    with conn:                                   # the caller's transaction
        conn.execute("INSERT INTO orders (id) VALUES (?)", ("o-1",))
        outbox.enqueue_dispatch(conn, kind="order.created", deliver_to="billing",
                                body={"order": "o-1"})
    # both rows committed, or neither

``conn`` is a ``sqlite3.Connection``, a ``psycopg.Connection``, an SQLAlchemy
``Connection`` or ``Session`` (asyncio SQLAlchemy: call these from
``await session.run_sync(...)``), or the connection a store hands a unit of
work (``await db.write(lambda conn: ...)``: the whole unit then rides in one
group commit). Anything else is a ``TypeError`` naming its type.

The validation, the envelope, the SQL and the transition row are the async
API's own (:mod:`trio_dispatch.outbox`, through its one entry point
:class:`~trio_dispatch.outbox.enqueue.EnqueueCall`), and so are the
connection adapters: a ``sqlite3`` or ``psycopg`` connection is driven by
the store's own (:class:`~trio_dispatch.store.sqlite.SQLiteConn`,
:class:`~trio_dispatch.store.pg_session.BorrowedPostgresConn`), borrowed:
nothing of the caller's connection is changed (its text and row factories,
isolation level, autocommit, session settings, loaders). SQLAlchemy, which
the store does not use, has a small adapter here. What differs per
connection kind is how an enqueue joins the caller's transaction:

- the dispatch and its ``dispatch.pending.enqueued`` transition are written
  atomically: inside a savepoint on PostgreSQL, every time, so after any
  error (a lock timeout, a table missing from this ``search_path``, a
  cancel) the caller's transaction is still usable with nothing of the
  failed enqueue in it; on SQLite, where a failed statement leaves the
  transaction usable, a failure after the first write deletes what the
  enqueue wrote;
- psycopg: the outbox's tables are found through the connection's
  ``search_path`` (``SET search_path TO outbox, public`` for an outbox in a
  schema of its own, your tables still in reach; ``install_schema`` creates
  them in the first existing schema on it). Inside the caller's
  ``conn.pipeline()`` an enqueue first syncs what the caller queued (an
  error of the caller's is raised then, before anything of the enqueue is
  sent), then reads each of its results as it needs them;
- a connection in autocommit mode (``sqlite3`` with ``isolation_level=None``
  or ``autocommit=True``, psycopg ``autocommit=True``, SQLAlchemy
  ``AUTOCOMMIT``) has no transaction to join: the enqueue is its own
  transaction and **commits at once**;
- on PostgreSQL the enqueue sends ``NOTIFY trio_dispatch`` in the caller's
  transaction: listening workers wake when it commits, never before, and
  never for a rollback. SQLite workers notice any commit within 50 ms
  (``PRAGMA data_version``), not at their tick.

A same-key race between two callers' transactions returns the winner's id
and never aborts either transaction (PostgreSQL waits for the other
transaction, as for any unique key; SQLite waits up to ``busy_timeout`` for
the write lock). On SQLite a transaction that reads before it enqueues
should begin ``IMMEDIATE`` (``isolation_level="IMMEDIATE"``), as any SQLite
transaction that reads then writes should.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, Protocol, Unpack

from .outbox import sql
from .outbox.enqueue import EnqueueArgs, EnqueueCall
from .outbox.inserts import insert_all
from .outbox.transitions import EnqueuedId, EnqueueResult, NewDispatch
from .store.base import Conn, Row, SchemaError, query_in_turn
from .store.dialect import DIALECTS, POSTGRES, Dialect
from .store.placeholders import to_paramstyle
from .store.schema import migrate
from .store.sqlite import SQLiteConn
from .validate import clock_from

__all__ = ["EnqueueResult", "enqueue_dispatch", "enqueue_many", "install_schema"]

SUPPORTED: Final = (
    "a sqlite3.Connection, a psycopg.Connection, or an SQLAlchemy Connection or Session"
)
_SAVEPOINT: Final = "trio_dispatch_enqueue"


class _Adapter(Protocol):
    """A caller's connection as an enqueue uses it: the
    :class:`~trio_dispatch.store.base.Conn` its statements go through (the
    store's own adapter where the store has one for the driver), how
    messages name its database, and how its engine makes an enqueue
    atomic."""

    @property
    def conn(self) -> Conn:
        """Where the outbox's statements go."""

    @property
    def where(self) -> str:
        """The database, for messages."""

    def atomic(
        self, ids: Sequence[str], coalescing: bool = False
    ) -> contextlib.AbstractContextManager[None]:
        """A block whose writes -- rows of the dispatches ``ids``, and with
        ``coalescing`` the rows it supersedes -- all stay or all go, leaving
        the caller's transaction usable."""


# -- sqlite3 ----------------------------------------------------------------------


class _SQLite3:
    """A ``sqlite3.Connection`` of the caller's, through the store's
    :class:`~trio_dispatch.store.sqlite.SQLiteConn`, borrowed: its text and
    row factories, isolation level and autocommit stay the caller's."""

    where = "this SQLite database"

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._raw = conn
        self.conn: Conn = SQLiteConn(conn, borrowed=True)

    def _autocommit(self) -> bool:
        mode = getattr(self._raw, "autocommit", None)  # Python 3.12+
        if mode is True:
            return True
        return mode is not False and self._raw.isolation_level is None

    @contextlib.contextmanager
    def atomic(self, ids: Sequence[str], coalescing: bool = False) -> Iterator[None]:
        conn = self._raw
        own = not conn.in_transaction and self._autocommit()
        if own:  # no transaction to join: this enqueue is its own, and commits
            conn.execute("BEGIN IMMEDIATE")
        elif coalescing:
            # A superseded row cannot be put back by deleting what the
            # enqueue wrote: a savepoint in the caller's transaction (begun
            # here if the module would begin it at the first write).
            if not conn.in_transaction:
                conn.execute(f"BEGIN {conn.isolation_level or ''}")
            with _sqlite_savepoint(conn.execute):
                yield
            return
        try:
            yield
        except BaseException:
            if own:
                conn.execute("ROLLBACK")
            else:
                _undo(self.conn, ids)
            raise
        if own:
            conn.execute("COMMIT")


@contextlib.contextmanager
def _sqlite_savepoint(execute: Any) -> Iterator[None]:
    """A savepoint inside an open SQLite transaction, through ``execute``."""
    execute(f"SAVEPOINT {_SAVEPOINT}")
    try:
        yield
    except BaseException:
        execute(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}")
        execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
        raise
    execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")


# -- psycopg ----------------------------------------------------------------------


class _Psycopg:
    """A ``psycopg.Connection`` of the caller's, through the store's
    PostgreSQL adapter, borrowed
    (:class:`~trio_dispatch.store.pg_session.BorrowedPostgresConn`)."""

    where = "this PostgreSQL database"

    def __init__(self, conn: Any) -> None:
        from .store.pg_session import BorrowedPostgresConn

        self._raw = conn
        self._borrowed = BorrowedPostgresConn(conn, self.where)

    @property
    def conn(self) -> Conn:
        return self._borrowed

    @contextlib.contextmanager
    def atomic(self, ids: Sequence[str], coalescing: bool = False) -> Iterator[None]:
        # PostgreSQL has no statement-level rollback: any failed statement
        # (a missing table on this search_path, a lock_timeout on a dedup
        # key another transaction holds, a cancel) aborts the whole
        # transaction. So every enqueue runs in a savepoint, on a warm
        # connection as on a cold one. Pipelined, the SAVEPOINT, the
        # statements whose results are not read (a plain row, its history
        # and NOTIFY: one statement) and the RELEASE go in one round trip:
        # the pipeline's sync as it closes.
        import psycopg

        conn = self._raw
        if not psycopg.Pipeline.is_supported():  # libpq before 14
            with self._protected():
                yield
            return
        begun = False
        try:
            with conn.pipeline() as pipeline:
                if pipeline.level > 1:
                    # The caller's own pipeline: what it queued runs now, and
                    # any error of its own is raised here, before anything of
                    # this enqueue is sent.
                    pipeline.sync()
                self._borrowed.pipeline = pipeline
                try:
                    if conn.autocommit:  # no transaction to join: its own, committed at once
                        with conn.transaction():
                            yield
                        return
                    conn.execute(f"SAVEPOINT {_SAVEPOINT}")  # begins the caller's transaction
                    begun = True
                    yield
                    conn.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
                finally:
                    self._borrowed.pipeline = None
            # Closed, the pipeline has synced: an error of a statement sent
            # unread (the RELEASE then skipped) was raised there.
        except BaseException:
            if begun:
                with contextlib.suppress(psycopg.Error):  # the first error is the one to see
                    conn.execute(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}")
                    conn.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
            raise

    @contextlib.contextmanager
    def _protected(self) -> Iterator[None]:
        conn = self._raw
        if conn.autocommit:  # no transaction to join: its own, committed at once
            with conn.transaction():
                yield
            return
        conn.execute(f"SAVEPOINT {_SAVEPOINT}")  # psycopg begins the caller's transaction
        try:
            yield
        except BaseException:
            conn.execute(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}")
            conn.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
            raise
        conn.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")


# -- SQLAlchemy -------------------------------------------------------------------


class _SQLAlchemyConn:
    """An SQLAlchemy ``Connection`` seen as a
    :class:`~trio_dispatch.store.base.Conn` (the store has no adapter of its
    own for SQLAlchemy): statements go through ``exec_driver_sql`` in the
    dialect's parameter style, so the Connection's own transaction
    (autobegin included) covers them, with any driver, the asyncio ones
    under ``run_sync`` too."""

    def __init__(self, conn: Any, dialect: Dialect) -> None:
        self._conn = conn
        self.dialect = dialect
        self._style = str(conn.dialect.paramstyle)

    def _sql(self, sql: str) -> str:
        return to_paramstyle(sql, self._style)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        return int(self._conn.exec_driver_sql(self._sql(sql), tuple(params)).rowcount)

    def send(self, sql: str, params: Sequence[Any] = ()) -> None:
        self.execute(sql, params)

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> int:
        result = self._conn.exec_driver_sql(self._sql(sql), [tuple(row) for row in rows])
        return int(result.rowcount)

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        result = self._conn.exec_driver_sql(self._sql(sql), tuple(params))
        return [dict(row) for row in result.mappings()]

    def query_one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        rows = self.query(sql, params)
        return rows[0] if rows else None

    def query_each(
        self,
        sql: str,
        rows: Sequence[Sequence[Any]],
        first: tuple[str, Sequence[Any]] | None = None,
    ) -> list[list[Row]]:
        return query_in_turn(self, sql, rows, first)

    def announce_enqueue(self) -> None:
        if self.dialect.notify:
            self._conn.exec_driver_sql(self.dialect.notify)


class _SQLAlchemy:
    """An SQLAlchemy ``Connection`` (a ``Session`` gives its own) of the
    caller's."""

    def __init__(self, conn: Any) -> None:
        self._raw = conn
        dialect = conn.dialect
        ours = DIALECTS.get("postgres" if dialect.name == "postgresql" else dialect.name)
        if ours is None:
            raise TypeError(
                f"an SQLAlchemy connection to {dialect.name!r}: trio_dispatch supports "
                "SQLite and PostgreSQL"
            )
        self.conn = _SQLAlchemyConn(conn, ours)
        self.where = f"this {dialect.name} database"

    def _autocommit(self) -> bool:
        # get_isolation_level() asks the database, which answers its own
        # level (READ COMMITTED) even on a connection in autocommit.
        probe = getattr(self._raw, "_is_autocommit_isolation", None)
        if probe is not None:
            return bool(probe())
        level = self._raw.get_execution_options().get("isolation_level")
        return str(level).upper() == "AUTOCOMMIT"

    @contextlib.contextmanager
    def atomic(self, ids: Sequence[str], coalescing: bool = False) -> Iterator[None]:
        postgres = self.conn.dialect is POSTGRES
        if postgres and not self._autocommit():
            with self._raw.begin_nested():  # a savepoint in the caller's transaction
                yield
            return
        if postgres:
            # Autocommit: the enqueue is a transaction of its own, so a key's
            # lock is held until its row commits (its place in the key is
            # read under that lock).
            self._raw.exec_driver_sql("BEGIN")
            try:
                yield
            except BaseException:
                self._raw.exec_driver_sql("ROLLBACK")
                raise
            self._raw.exec_driver_sql("COMMIT")
            return
        if coalescing:
            # SQLite, coalescing: a superseded row cannot be put back by
            # deleting what the enqueue wrote, and the supersede and the
            # insert must commit together. The driver's own transaction is
            # begun first (pysqlite begins it only at a first write), so
            # the savepoint sits inside it, or -- autocommit -- the enqueue
            # is its own transaction.
            run = self._raw.exec_driver_sql
            if self._autocommit():
                run("BEGIN IMMEDIATE")
                try:
                    yield
                except BaseException:
                    run("ROLLBACK")
                    raise
                run("COMMIT")
                return
            driver = self._raw.connection.dbapi_connection
            if not getattr(driver, "in_transaction", True):
                run("BEGIN")
            with _sqlite_savepoint(run):
                yield
            return
        # SQLite (where SQLAlchemy's savepoints need a driver workaround) and
        # autocommit: each statement stands alone; a failure after the
        # first write deletes what the enqueue wrote.
        try:
            yield
        except BaseException:
            _undo(self.conn, ids)
            raise


# -- a store's own connection (a unit of work) --------------------------------------


class _Unit:
    """The connection a store hands a unit of work, used as it is: already
    one transaction that commits or rolls back as a whole (and, where the
    store keeps them, the record of its key locks goes with it)."""

    where = "this store"

    def __init__(self, conn: Conn) -> None:
        self.conn = conn

    @contextlib.contextmanager
    def atomic(self, ids: Sequence[str], coalescing: bool = False) -> Iterator[None]:
        yield  # the unit itself is rolled back if it raises


def _undo(conn: Conn, ids: Sequence[str]) -> None:
    """Delete what a failed enqueue wrote; keep the original error if this
    fails too (the transaction is then lost anyway)."""
    if not ids:
        return
    with contextlib.suppress(Exception):
        for statement in sql.undo_enqueue(len(ids)):
            conn.execute(statement, ids)


def _adapt(conn: object) -> _Adapter:
    """The adapter for a caller's connection, or TypeError naming its type."""
    if isinstance(conn, sqlite3.Connection):
        return _SQLite3(conn)
    module = type(conn).__module__
    if module.startswith("psycopg"):
        import psycopg

        if isinstance(conn, psycopg.Connection):
            return _Psycopg(conn)
        if isinstance(conn, psycopg.AsyncConnection):
            raise TypeError(
                "a psycopg.AsyncConnection cannot be used from synchronous code: "
                "use a psycopg.Connection, or the async API on a store"
            )
    if module.startswith("sqlalchemy"):
        from sqlalchemy.engine import Connection
        from sqlalchemy.orm import Session

        if isinstance(conn, Session):
            conn = conn.connection()  # begins the session's transaction
        if isinstance(conn, Connection):
            # On psycopg (not its asyncio driver) the enqueue goes through
            # the driver's connection, as a psycopg caller's does: one round
            # trip. SQLAlchemy's transaction is the driver's, so it commits
            # or rolls back the enqueue with the rest.
            driver = conn.connection.driver_connection
            if type(driver).__module__.startswith("psycopg"):
                import psycopg

                if isinstance(driver, psycopg.Connection):
                    if not conn.in_transaction():
                        conn.begin()  # as SQLAlchemy's autobegin: its commit() commits ours
                    return _Psycopg(driver)
            return _SQLAlchemy(conn)
    if isinstance(conn, SQLiteConn):
        return _Unit(conn)
    if module == "trio_dispatch.store.pg_session":  # loaded, so psycopg is there
        from .store.pg_session import PostgresConn

        if isinstance(conn, PostgresConn):
            return _Unit(conn)
    raise TypeError(
        f"conn must be {SUPPORTED}; got a {type(conn).__module__}.{type(conn).__qualname__}"
    )


def _is_missing_schema(exc: BaseException) -> bool:
    text = str(getattr(exc, "orig", None) or exc)
    return ("dispatch_outbox" in text or "status_transitions" in text) and (
        "no such table" in text or "does not exist" in text
    )


def _write(
    adapter: _Adapter, batch: Sequence[NewDispatch], now: float, name_items: bool
) -> list[EnqueueResult]:
    try:
        coalescing = any(new.coalesce is not None for new in batch)
        with adapter.atomic([new.id for new in batch], coalescing):
            return insert_all(adapter.conn, batch, now, name_items=name_items)
    except Exception as exc:
        if _is_missing_schema(exc):
            raise SchemaError(
                f"{adapter.where} has no trio_dispatch schema: create it with "
                "trio_dispatch.sync.install_schema(conn) or `trio-dispatch migrate`"
            ) from None
        raise


def enqueue_dispatch(conn: object, *, now: float | None = None, **args: Unpack[EnqueueArgs]) -> str:
    """Write one dispatch and its ``dispatch.pending.enqueued`` transition in
    the caller's current transaction on ``conn``; return its id (the first
    row's id on a dedup hit, writing nothing; an ``EnqueuedId``, a ``str``
    whose ``outcome`` says ``inserted``, ``replaced`` or ``kept``,
    docs/controls.md). Never commits, rolls back or closes ``conn`` (in
    autocommit mode the enqueue is its own transaction).

    Raises ``TypeError``/``ValueError`` naming a bad argument before anything
    is written, :class:`~trio_dispatch.store.base.SchemaError` naming
    ``install_schema`` and ``trio-dispatch migrate`` when the database has no
    outbox tables, and ``TypeError`` naming the type of an unsupported
    ``conn``; after any of these the caller's transaction is open and
    usable, with nothing of this enqueue in it.
    """
    adapter = _adapt(conn)  # an unsupported connection is refused before anything else
    with EnqueueCall() as call:  # the create span's parent: the calling thread's current context
        result = _write(adapter, [call.new(args)], clock_from(now)(), name_items=False)[0]
        call.written([result.id])
        return EnqueuedId(result.id, result.outcome)


def enqueue_many(
    conn: object, items: Iterable[Mapping[str, Any]], *, now: float | None = None
) -> list[EnqueueResult]:
    """:func:`enqueue_dispatch` for each item, all or none, in the caller's
    transaction; one :class:`EnqueueResult` per item, in order. An invalid
    item raises, naming its index, before anything is written."""
    adapter = _adapt(conn)
    with EnqueueCall() as call:
        batch = call.batch(items)
        results = _write(adapter, batch, clock_from(now)(), name_items=True) if batch else []
        call.written([result.id for result in results])
        return results


def install_schema(conn: object) -> None:
    """Create the outbox tables in ``conn``'s database, or bring them forward
    to this version -- idempotently, in the caller's current transaction
    (commit it afterwards; in autocommit mode it commits at once). On
    PostgreSQL they go in the first existing schema of the connection's
    ``search_path``. A newer schema, a ``search_path`` naming no existing
    schema, or a ``sessions``/``schedule_runs`` table of the service's own
    where the outbox's foreign keys would point (one that is there before
    ``dispatch_outbox``) raises :class:`~trio_dispatch.store.base.SchemaError`
    (one line, naming the table and the fix) and changes nothing."""
    adapter = _adapt(conn)
    with adapter.atomic(()):
        own = adapter.conn
        if own.dialect.migration_lock:  # one migrator at a time, across hosts
            own.query_one(own.dialect.migration_lock)
        migrate(own, adapter.where, own_connection=True)
