"""The PostgreSQL engine: the same store for workers on several hosts.

psycopg 3 connections driven from worker threads through anyio (so it runs
under trio and asyncio alike), with the engine-independent group commit of
:mod:`.batching`. Claims lock the rows they select (``FOR UPDATE SKIP
LOCKED``), so concurrent workers never wait on each other's rows; every
write keeps the outbox's (status, attempt, lease) fencing. An enqueue sends
``NOTIFY trio_dispatch`` in its own transaction, so workers listening on any
host wake at once; the tick remains the fallback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

import anyio

from ..redact import mask_url, register_secrets, scrubbed_logger, url_secrets
from .base import (
    DEFAULT_BUSY_TIMEOUT_SECONDS,
    DEFAULT_MAX_BODY_BYTES,
    Row,
    StoreError,
    T,
    store_schema,
)
from .batching import BatchingStore
from .placeholders import to_paramstyle
from .schema import MIGRATION_LOCK, POSTGRES, migrate, require_current

try:  # an optional dependency: `pip install trio_dispatch[postgres]`
    import psycopg
    from psycopg.pq import TransactionStatus
    from psycopg.rows import dict_row
    from psycopg.types.string import TextLoader
    from psycopg_pool import ConnectionPool
except ImportError:  # pragma: no cover - exercised only without the extra
    psycopg = None  # type: ignore[assignment]

CHANNEL: Final = "trio_dispatch"
READERS: Final = 4
"""Connections in the read pool (and reads running at once)."""

log = scrubbed_logger("trio_dispatch.store")


def _placeholders(sql: str) -> str:
    """The outbox's portable SQL (``?`` placeholders) in psycopg's style."""
    return to_paramstyle(sql, "format")


class PostgresConn:
    """A :class:`~trio_dispatch.store.base.Conn` over one psycopg connection.

    With :attr:`begin_pending` set (the store's writer, see
    :meth:`PostgresStore._begin`) the first statement carries the
    transaction's ``BEGIN`` with it: both go in one pipelined round trip."""

    lock_clause = " FOR UPDATE SKIP LOCKED"
    row_key = "id"
    writes_in_with = True

    __slots__ = ("_conn", "begin_pending")

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn
        self.begin_pending = False

    def _send(self, send: Callable[[], object], pipelined: bool = True) -> None:
        if not self.begin_pending:
            send()
            return
        self.begin_pending = False
        if not pipelined or not psycopg.Pipeline.is_supported():
            # A statement without parameters may hold several commands,
            # which only the simple protocol (never a pipeline) accepts; and
            # libpq before 14 has no pipeline mode.
            self._conn.execute("BEGIN")
            send()
            return
        # BEGIN and the statement in one round trip; the cursor holds the
        # statement's results once the pipeline has synced at its end.
        with self._conn.pipeline():
            self._conn.execute("BEGIN")
            send()

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        with self._conn.cursor() as cursor:
            self._send(lambda: cursor.execute(_placeholders(sql), tuple(params)), bool(params))
            return cursor.rowcount

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> int:
        with self._conn.cursor() as cursor:
            self._send(lambda: cursor.executemany(_placeholders(sql), [tuple(r) for r in rows]))
            return cursor.rowcount

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        with self._conn.cursor(row_factory=dict_row) as cursor:
            self._send(lambda: cursor.execute(_placeholders(sql), tuple(params)), bool(params))
            return list(cursor.fetchall()) if cursor.description else []

    def query_one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        rows = self.query(sql, params)
        return rows[0] if rows else None

    def announce_enqueue(self) -> None:
        # Delivered to listeners when (and only if) this transaction commits.
        self.execute(f"NOTIFY {CHANNEL}")


def _configure(
    conn: psycopg.Connection[Any],
    *,
    durability: str,
    lock_timeout: float,
    read_only: bool = False,
    schema: str | None = None,
) -> None:
    # JSON columns come back as their text, as stored (the payload is sent as is).
    conn.adapters.register_loader("json", TextLoader)
    conn.adapters.register_loader("jsonb", TextLoader)
    conn.execute(f"SET synchronous_commit = {'on' if durability == 'full' else 'off'}")
    conn.execute(f"SET lock_timeout = '{int(lock_timeout * 1000)}ms'")
    if schema is not None:
        # Every outbox statement names its tables unqualified: on every
        # connection of the store they resolve in this schema alone
        # (pg_catalog, always searched first, still serves the built-ins).
        # The name is a checked identifier (store_schema).
        conn.execute(f'SET search_path TO "{schema}"')
    if read_only:
        conn.execute("SET default_transaction_read_only = on")


def _connect(
    url: str,
    *,
    durability: str,
    lock_timeout: float,
    read_only: bool = False,
    schema: str | None = None,
) -> psycopg.Connection[Any]:
    conn = psycopg.connect(url, autocommit=True)
    try:
        _configure(
            conn,
            durability=durability,
            lock_timeout=lock_timeout,
            read_only=read_only,
            schema=schema,
        )
    except BaseException:
        conn.close()
        raise
    return conn


class PostgresStore(BatchingStore):
    """An open PostgreSQL store. Create it with :func:`trio_dispatch.open_store`
    and a ``postgresql://`` URL."""

    def __init__(
        self,
        url: str,
        *,
        durability: str = "full",
        busy_timeout: float = DEFAULT_BUSY_TIMEOUT_SECONDS,
        read_only: bool = False,
        migrate: bool = True,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        schema: str | None = None,
    ) -> None:
        if psycopg is None:
            raise StoreError(
                f"{mask_url(url)} needs psycopg: install trio_dispatch[postgres] "
                "(psycopg[binary,pool] >= 3.2)"
            )
        super().__init__(url, read_only=read_only, migrate=migrate, max_body_bytes=max_body_bytes)
        self._dsn = url  # holds the password: never in a message (self.url is masked)
        register_secrets(url_secrets(url))
        self.durability = durability
        self.busy_timeout = busy_timeout
        self.schema = store_schema(url, schema)
        """The schema that holds the outbox's tables (None: the first of the
        server's ``search_path``)."""
        self._where = self.url if self.schema is None else f"{self.url} schema {self.schema}"
        self._writer: psycopg.Connection[Any] | None = None
        self._lazy: PostgresConn | None = None  # the writer's Conn, typed as itself
        self._readers: ConnectionPool[Any] | None = None
        self._read_limiter = anyio.CapacityLimiter(READERS)

    def _connect(self) -> psycopg.Connection[Any]:
        return _connect(
            self._dsn,
            durability=self.durability,
            lock_timeout=self.busy_timeout,
            read_only=self.read_only,
            schema=self.schema,
        )

    def _read_pool(self) -> ConnectionPool[Any]:
        return ConnectionPool(
            self._dsn,
            min_size=1,
            max_size=READERS,
            kwargs={"autocommit": True},
            configure=lambda conn: _configure(
                conn,
                durability=self.durability,
                lock_timeout=self.busy_timeout,
                read_only=self.read_only,
                schema=self.schema,
            ),
            open=True,
        )

    def _connect_all(self) -> None:
        if self.read_only:
            probe = self._connect()
            try:
                self.found_schema_version = require_current(
                    PostgresConn(probe), POSTGRES, self._where
                )
            finally:
                probe.close()
            self._readers = self._read_pool()
            return
        writer = self._connect()
        try:
            if self.migrate:
                with writer.transaction():  # one migrator at a time, on any host
                    writer.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
                    self.found_schema_version = migrate(
                        PostgresConn(writer), POSTGRES, self._where, self.schema
                    )
            else:
                self.found_schema_version = require_current(
                    PostgresConn(writer), POSTGRES, self._where
                )
            readers = self._read_pool()
        except BaseException:
            writer.close()
            raise
        self._writer, self._readers = writer, readers
        self._writer_conn = self._lazy = PostgresConn(writer)

    # -- the engine primitives ---------------------------------------------------

    def _begin(self) -> None:
        # Lazy: BEGIN goes out with the transaction's first statement, in
        # one round trip (a PostgreSQL BEGIN waits for nothing, unlike
        # SQLite's BEGIN IMMEDIATE, so sending it later changes no outcome).
        assert self._writer is not None and self._lazy is not None
        self._lazy.begin_pending = True

    def _commit(self) -> None:
        assert self._writer is not None and self._lazy is not None
        if self._lazy.begin_pending:  # nothing ran: nothing to commit
            self._lazy.begin_pending = False
            return
        if self._writer.info.transaction_status == TransactionStatus.INERROR:
            # A statement failed and its caller went on: PostgreSQL would
            # answer COMMIT with a silent ROLLBACK. Say so instead.
            self._writer.execute("ROLLBACK")
            raise StoreError(
                "the transaction was aborted by an earlier error in it; nothing was committed"
            )
        self._writer.execute("COMMIT")

    def _rollback(self) -> None:
        if self._lazy is not None and self._lazy.begin_pending:
            self._lazy.begin_pending = False
            return
        if self._in_transaction():
            assert self._writer is not None
            self._writer.execute("ROLLBACK")

    def _in_transaction(self) -> bool:
        if self._lazy is not None and self._lazy.begin_pending:
            return True
        return self._writer is not None and self._writer.info.transaction_status in (
            TransactionStatus.INTRANS,
            TransactionStatus.INERROR,
            TransactionStatus.ACTIVE,
        )

    def _close_connections(self) -> None:
        if self._readers is not None:
            self._readers.close()
        if self._writer is not None:
            self._writer.close()
        self._readers, self._writer, self._lazy = None, None, None

    # -- reads -----------------------------------------------------------------

    async def read(self, work: Callable[[PostgresConn], T]) -> T:
        """Run ``work`` on a snapshot (a read-only repeatable-read
        transaction) from the read pool; reads never wait for the writer."""
        self._check_open()
        readers = self._readers
        if readers is None:
            raise StoreError(f"store {self.url} is closed")

        def run() -> T:
            with readers.connection() as reader:
                reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
                try:
                    return work(PostgresConn(reader))
                finally:
                    reader.execute("ROLLBACK")

        return await anyio.to_thread.run_sync(run, limiter=self._read_limiter)

    # -- cross-process wake-ups --------------------------------------------------

    async def listen(
        self,
        callback: Callable[[], None],
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Call ``callback`` (in the event loop) whenever any process commits
        an enqueue to this database, until cancelled. Raises if notifications
        are unavailable (e.g. behind a transaction-mode pooler); the caller
        then relies on its tick."""
        conn = await anyio.to_thread.run_sync(self._connect)
        try:
            await anyio.to_thread.run_sync(conn.execute, f"LISTEN {CHANNEL}")
            task_status.started()
            fd = conn.fileno()
            while True:
                # The event loop watches the socket: cancellation is at once,
                # and no thread sits in a timed wait.
                await anyio.wait_readable(fd)
                if _drain_notifications(conn):
                    callback()
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(conn.close)


def _drain_notifications(conn: psycopg.Connection[Any]) -> int:
    """Read what the server sent on an idle listening connection; return how
    many notifications came. Raises if the connection failed (the server
    went away): the listener then falls back to its tick and reconnects."""
    pgconn = conn.pgconn
    pgconn.consume_input()
    count = 0
    while pgconn.notifies() is not None:
        count += 1
    return count
