"""The PostgreSQL engine: the same store for workers on several hosts.

psycopg 3 connections driven from worker threads through anyio (so it runs
under trio and asyncio alike), with the engine-independent group commit of
:mod:`.batching`. Claims lock the rows they select (``FOR UPDATE SKIP
LOCKED``), so concurrent workers never wait on each other's rows; every
write keeps the outbox's (status, attempt, lease) fencing. An enqueue sends
``NOTIFY trio_dispatch`` in its own transaction, so workers listening on any
host wake at once; the tick remains the fallback.

A connection that ends (a server restart, a failover, an idle-session
timeout, ``pg_terminate_backend``) is replaced, never reused: the writer
checks its connection before each transaction begins -- an idle
connection the server closed has already said so on its socket, so no
caller's work is spent finding out -- and reconnects, waiting
:data:`RECONNECT_FIRST_DELAY` doubling to :data:`RECONNECT_MAX_DELAY`
between tries while the server does not answer (each write that comes
meanwhile makes at most one try, and fails with
:class:`~.base.ConnectionLostError` if it fails). The listener reconnects
the same way, listens again and calls back once (notifications sent while
it was away are lost). The read pool drops a dead connection before a read
uses it. Work that was running when its connection ended fails with
:class:`~.base.ConnectionLostError`: nothing of it was committed, except
when the COMMIT itself went unanswered, which the error says
(``outcome_unknown``).
"""

from __future__ import annotations

import select
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, NoReturn

import anyio

from ..redact import (
    known_secrets,
    mask_url,
    one_line,
    register_secrets,
    scrubbed_logger,
    url_secrets,
)
from .base import (
    ConnectionLostError,
    Row,
    StoreError,
    StoreOptions,
    T,
    store_schema,
)
from .batching import BatchingStore
from .dialect import POSTGRES, Typed
from .placeholders import to_paramstyle
from .schema import migrate, require_current

try:  # an optional dependency: `pip install trio_dispatch[postgres]`
    import psycopg
    from psycopg.pq import ConnStatus, TransactionStatus
    from psycopg.rows import dict_row
    from psycopg.types.string import TextLoader
    from psycopg_pool import ConnectionPool
except ImportError:  # pragma: no cover - exercised only without the extra
    psycopg = None  # type: ignore[assignment]

READERS: Final = 4
"""Connections in the read pool (and reads running at once)."""
RECONNECT_FIRST_DELAY: Final = 0.05
"""Seconds between the first failed reconnect and the next try (the first
try is at once); each failure doubles it up to :data:`RECONNECT_MAX_DELAY`."""
RECONNECT_MAX_DELAY: Final = 2.0
"""The longest wait between two tries to reconnect, in seconds."""

log = scrubbed_logger("trio_dispatch.store")


def _placeholders(sql: str) -> str:
    """The outbox's portable SQL (``?`` placeholders) in psycopg's style;
    a :class:`~.dialect.Typed` statement's parameters go in binary."""
    return to_paramstyle(sql, "format", isinstance(sql, Typed))


def _lost(conn: psycopg.Connection[Any]) -> bool:
    """Whether ``conn``'s session has ended (libpq knows it is dead)."""
    return conn.closed or conn.broken


def _alive(conn: psycopg.Connection[Any]) -> bool:
    """Whether an idle connection still has its session, without a round
    trip: a server that ended the session (terminated, shutting down) sent
    its last words and closed the socket, so an idle connection with
    something to read is read, and libpq sees the end. A session that is
    cut without a word (a network partition) looks alive until used."""
    if _lost(conn):
        return False
    try:
        fd = conn.fileno()
        for _ in range(4):  # the farewell, then the end of the stream
            if not _readable(fd):
                return True
            conn.pgconn.consume_input()
            if conn.pgconn.status != ConnStatus.OK:
                return False
    except (psycopg.Error, OSError, ValueError):
        return False
    return not _lost(conn)


def _readable(fd: int) -> bool:
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(0))  # POLLHUP and POLLERR count too
    return bool(select.select([fd], [], [], 0)[0])  # pragma: no cover - no poll()


def _reason(exc: BaseException) -> str:
    """A driver error as one password-free line."""
    return one_line(exc, known_secrets())


def _next_delay(delay: float) -> float:
    return min(RECONNECT_MAX_DELAY, max(RECONNECT_FIRST_DELAY, delay * 2))


class PostgresConn:
    """A :class:`~trio_dispatch.store.base.Conn` over one psycopg connection.

    With :attr:`begin_pending` set (the store's writer, see
    :meth:`PostgresStore._begin`) the first statement carries the
    transaction's ``BEGIN`` with it: both go in one pipelined round trip.
    With :attr:`single` set (:meth:`PostgresStore._begin_single`) the one
    statement goes alone and commits by itself; a second one is refused."""

    dialect = POSTGRES

    __slots__ = ("_conn", "begin_pending", "single", "where")

    def __init__(self, conn: psycopg.Connection[Any], where: str = "the server") -> None:
        self._conn = conn
        self.begin_pending = False
        self.single: bool | None = None  # None: not a single; False: its statement went
        self.where = where  # the masked URL, for messages

    def _send(self, send: Callable[[], object], pipelined: bool = True) -> None:
        single = self.single
        if single is False:
            # The first statement has committed: a second would not be
            # atomic with it. A caller's promise broken is a bug, said loudly.
            raise StoreError("a single-statement write ran a second statement")
        if single:
            self.single = False
        try:
            self._send_once(send, pipelined)
        except psycopg.OperationalError as exc:
            if not _lost(self._conn):
                raise
            if single:
                raise ConnectionLostError(
                    f"the connection to {self.where} ended while its statement ran "
                    f"({_reason(exc)}); the outcome is unknown: it may or may not have "
                    "been committed",
                    outcome_unknown=True,
                ) from None
            _raise_lost(exc, self.where)

    def _send_once(self, send: Callable[[], object], pipelined: bool) -> None:
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
        self.execute(POSTGRES.notify)


def _raise_lost(exc: BaseException, where: str) -> NoReturn:
    raise ConnectionLostError(
        f"the connection to {where} ended during this transaction ({_reason(exc)}): "
        "nothing in it was committed"
    ) from None


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
    if conn.info.server_version >= 110000:  # JIT compiled a 0.1 ms claim scan in 11 ms
        conn.execute("SET jit = off")
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

    def __init__(self, url: str, options: StoreOptions | None = None) -> None:
        options = options or StoreOptions()
        if psycopg is None:
            raise StoreError(
                f"{mask_url(url)} needs psycopg: install trio_dispatch[postgres] "
                "(psycopg[binary,pool] >= 3.2)"
            )
        super().__init__(url, options)
        self._dsn = url  # holds the password: never in a message (self.url is masked)
        register_secrets(url_secrets(url))
        self.durability = options.durability
        self.busy_timeout = options.busy_timeout
        self.schema = store_schema(url, options.schema)
        """The schema that holds the outbox's tables (None: the first of the
        server's ``search_path``)."""
        self._where = self.url if self.schema is None else f"{self.url} schema {self.schema}"
        self._writer: psycopg.Connection[Any] | None = None
        self._lazy: PostgresConn | None = None  # the writer's Conn, typed as itself
        self._readers: ConnectionPool[Any] | None = None
        self._read_limiter = anyio.CapacityLimiter(READERS)
        # The writer's reconnection (its thread only): when the loss was
        # found, tries since, and when the next try may start.
        self._lost_at: float | None = None
        self._tries = 0
        self._delay = 0.0
        self._next_try_at = 0.0
        self.reconnects = {"writer": 0, "listener": 0}
        """Connections replaced after their session ended, by role."""

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
                self.found_schema_version = require_current(PostgresConn(probe), self._where)
            finally:
                probe.close()
            self._readers = self._read_pool()
            return
        writer = self._connect()
        try:
            if self.migrate:
                with writer.transaction():  # one migrator at a time, on any host
                    conn = PostgresConn(writer)
                    conn.execute(POSTGRES.migration_lock)
                    self.found_schema_version = migrate(conn, self._where, self.schema)
            else:
                self.found_schema_version = require_current(PostgresConn(writer), self._where)
            readers = self._read_pool()
        except BaseException:
            writer.close()
            raise
        self._writer, self._readers = writer, readers
        self._writer_conn = self._lazy = PostgresConn(writer, self.url)

    def _ensure_writer(self) -> None:
        """Replace the writer connection if its session has ended; on
        failure raise :class:`ConnectionLostError` (the next try waits out
        the backoff first, at most :data:`RECONNECT_MAX_DELAY`)."""
        assert self._lazy is not None
        writer = self._writer
        if writer is not None and _alive(writer):
            return
        now = time.monotonic()
        if self._lost_at is None:
            self._lost_at, self._tries, self._delay, self._next_try_at = now, 0, 0.0, now
            if writer is not None:
                writer.close()
        if self._next_try_at > now:
            time.sleep(self._next_try_at - now)
        self._tries += 1
        try:
            writer = self._connect()
        except psycopg.Error as exc:
            self._delay = _next_delay(self._delay)
            self._next_try_at = time.monotonic() + self._delay
            raise ConnectionLostError(
                f"the connection to {self.url} ended and reconnecting failed "
                f"({_reason(exc)}); the next try waits {self._delay:g}s"
            ) from None
        self._writer = self._lazy._conn = writer
        self.reconnects["writer"] += 1
        log.warning(
            "store %s: the writer's connection had ended; reconnected (%d tries, %.2fs)",
            self.url,
            self._tries,
            time.monotonic() - self._lost_at,
        )
        self._lost_at = None

    # -- the engine primitives ---------------------------------------------------

    def _begin(self) -> None:
        # Lazy: BEGIN goes out with the transaction's first statement, in
        # one round trip (a PostgreSQL BEGIN waits for nothing, unlike
        # SQLite's BEGIN IMMEDIATE, so sending it later changes no outcome).
        assert self._lazy is not None
        self._ensure_writer()
        self._lazy.begin_pending = True

    def _begin_single(self) -> None:
        # The writer's session is in autocommit: a statement sent without
        # BEGIN commits by itself, one round trip where BEGIN + statement
        # and COMMIT take two.
        assert self._lazy is not None
        self._ensure_writer()
        self._lazy.single = True

    def _commit(self) -> None:
        assert self._writer is not None and self._lazy is not None
        if self._lazy.single is not None:  # committed with its statement
            self._lazy.single = None
            return
        if self._lazy.begin_pending:  # nothing ran: nothing to commit
            self._lazy.begin_pending = False
            return
        if self._writer.info.transaction_status == TransactionStatus.INERROR:
            # A statement failed and its caller went on: PostgreSQL would
            # answer COMMIT with a silent ROLLBACK. Say so instead.
            self._rollback()
            raise StoreError(
                "the transaction was aborted by an earlier error in it; nothing was committed"
            )
        try:
            self._writer.execute("COMMIT")
        except psycopg.OperationalError as exc:
            if not _lost(self._writer):
                raise
            # The server may have committed and its answer been lost:
            # never report success, nor claim a rollback.
            raise ConnectionLostError(
                f"the connection to {self.url} ended while committing ({_reason(exc)}); "
                "the outcome is unknown: the transaction may or may not have been committed",
                outcome_unknown=True,
            ) from None

    def _rollback(self) -> None:
        if self._lazy is not None and self._lazy.single is not None:
            # Nothing open: a failed single statement rolled itself back.
            self._lazy.single = None
            return
        if self._lazy is not None and self._lazy.begin_pending:
            self._lazy.begin_pending = False
            return
        if self._in_transaction():
            assert self._writer is not None
            try:
                self._writer.execute("ROLLBACK")
            except psycopg.Error:
                # Never leave a session idle in a transaction: closing ends
                # it on the server (a rollback), and the next transaction
                # reconnects. This runs on error paths: the first error is
                # the one to report.
                self._writer.close()

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
        transaction) from the read pool; reads never wait for the writer.
        A pooled connection whose session has ended is dropped before use
        (the pool opens another); one that ends during the read raises
        :class:`ConnectionLostError`."""
        self._check_open()
        readers = self._readers
        if readers is None:
            raise StoreError(f"store {self.url} is closed")

        def run() -> T:
            # After a restart every idle connection of the pool is dead:
            # each is found so without a round trip, and closed (the pool
            # replaces a closed connection when it comes back).
            for _ in range(READERS):
                with readers.connection() as reader:
                    if _alive(reader):
                        return _read(reader, work, self.url)
                    reader.close()
            with readers.connection() as reader:
                return _read(reader, work, self.url)

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
        conn = await anyio.to_thread.run_sync(self._listening)
        try:
            task_status.started()
            while True:
                try:
                    await _relay(conn, callback)
                except psycopg.OperationalError as exc:
                    if not _lost(conn):
                        raise
                    reason = _reason(exc)
                await anyio.to_thread.run_sync(conn.close)
                conn = await self._listen_again(reason)
                callback()  # what was sent while it was away is lost: look once
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(conn.close)

    def _listening(self) -> psycopg.Connection[Any]:
        """A new connection that listens for enqueues (``POSTGRES.listen``)."""
        conn = self._connect()
        try:
            conn.execute(POSTGRES.listen)
        except BaseException:
            conn.close()
            raise
        return conn

    async def _listen_again(self, reason: str) -> psycopg.Connection[Any]:
        """Reconnect and listen, waiting :data:`RECONNECT_FIRST_DELAY`
        doubling to :data:`RECONNECT_MAX_DELAY` between tries while the
        server does not answer; anything else (e.g. a pooler refusing
        LISTEN) raises."""
        started = time.monotonic()
        delay, tries = 0.0, 0
        while True:
            tries += 1
            try:
                conn = await anyio.to_thread.run_sync(self._listening)
            except psycopg.OperationalError as exc:
                reason = _reason(exc)
                delay = _next_delay(delay)
                log.debug("store %s: listening again failed (%s)", self.url, reason)
                await anyio.sleep(delay)
                continue
            self.reconnects["listener"] += 1
            log.warning(
                "store %s: the listener's connection had ended (%s); "
                "listening again (%d tries, %.2fs)",
                self.url,
                reason,
                tries,
                time.monotonic() - started,
            )
            return conn


def _read(reader: psycopg.Connection[Any], work: Callable[[PostgresConn], T], where: str) -> T:
    """``work`` in a read-only snapshot on ``reader``, which is left with
    no transaction open (or closed, and so dropped by the pool)."""
    try:
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        return work(PostgresConn(reader, where))
    except psycopg.OperationalError as exc:
        if not _lost(reader):
            raise
        _raise_lost(exc, where)
    finally:
        if not _lost(reader):
            try:
                reader.execute("ROLLBACK")
            except psycopg.Error:
                reader.close()  # the first error is the one to report


async def _relay(conn: psycopg.Connection[Any], callback: Callable[[], None]) -> NoReturn:
    """Call ``callback`` for each batch of notifications on ``conn`` until
    its session ends (psycopg's OperationalError)."""
    fd = conn.fileno()
    while True:
        # The event loop watches the socket: cancellation is at once,
        # and no thread sits in a timed wait.
        await anyio.wait_readable(fd)
        if _drain_notifications(conn):
            callback()


def _drain_notifications(conn: psycopg.Connection[Any]) -> int:
    """Read what the server sent on an idle listening connection; return how
    many notifications came. Raises psycopg's OperationalError once the
    session has ended (the server went away or ended it)."""
    pgconn = conn.pgconn
    pgconn.consume_input()
    count = 0
    while pgconn.notifies() is not None:
        count += 1
    if pgconn.status != ConnStatus.OK:  # pragma: no cover - consume_input raises first
        raise psycopg.OperationalError("the connection is closed")
    return count
