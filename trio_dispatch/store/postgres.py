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

A network that goes silent (a partition; a NAT, pooler or load balancer
that stops forwarding without a reset) is noticed by a deadline on every
round trip, not by TCP: a round trip with no answer after ``busy_timeout +
network_timeout`` seconds is cut by a :class:`~.watchdog.Watchdog` (its
socket shut down) and fails with :class:`~.base.ConnectionLostError`, said
once in a WARNING until the server answers again. The writer then waits
``network_timeout`` before it tries to connect again, and writes that come
meanwhile fail at once, so nothing waits behind a dead link (a worker stops
within its grace plus one deadline). On the server, each of the store's
sessions ends a transaction left idle, or a statement running, half a
network timeout before that deadline (``idle_in_transaction_session_timeout``,
``statement_timeout``), so a row lock held by a session whose client went
silent is let go, and a slow statement fails as an error on a connection
that lives on rather than as a lost connection. Connecting
waits ``network_timeout`` (libpq's ``connect_timeout``, at least 2 s), and
TCP keepalives and ``tcp_user_timeout`` are set from it unless the URL sets
them. An idle listener checks its session with a round trip every
:data:`LISTEN_CHECK_FACTOR` network timeouts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Final, NoReturn

import anyio

from ..redact import mask_url, register_secrets, scrubbed_logger, url_secrets
from .base import (
    ConnectionLostError,
    StoreError,
    StoreOptions,
    T,
)
from .batching import BatchingStore
from .dialect import CANCEL_CHANNEL, POSTGRES
from .pg_session import (
    PostgresConn,
    alive,
    configure,
    connection_parameters,
    error_text,
    lost,
    raise_lost,
    store_schema,
)
from .schema import current_version, migrate, require_current
from .watchdog import Watch, Watchdog

try:  # an optional dependency: `pip install trio_dispatch[postgres]`
    import psycopg
    from psycopg.pq import ConnStatus, TransactionStatus
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

LISTEN_CHECK_FACTOR: Final = 6
"""An idle listener sends a round trip after this many network timeouts
without a word from the server (30 s by default): a session a silent
network cut would otherwise never be noticed, and enqueues never wake."""

log = scrubbed_logger("trio_dispatch.store")


def _next_delay(delay: float) -> float:
    return min(RECONNECT_MAX_DELAY, max(RECONNECT_FIRST_DELAY, delay * 2))


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
        self.network_timeout = options.network_timeout
        self.deadline = options.busy_timeout + options.network_timeout
        """Seconds a round trip may go unanswered before it is cut."""
        self._parameters = connection_parameters(url, options.network_timeout)
        self._dog = Watchdog(f"trio_dispatch watchdog {id(self):#x}", self._noticed)
        self._silent = False  # a round trip was cut; no connection has answered since
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

    async def open(self) -> None:
        try:
            await super().open()
        except BaseException:
            self._dog.stop()  # connecting failed: nothing is watched again
            raise

    def _noticed(self, seconds: float) -> None:
        """The watchdog is about to cut a round trip (its thread, under its
        lock): said once an outage."""
        if self._silent:
            return
        self._silent = True
        log.warning(
            "store %s: no answer from the server in %gs; its connection is dropped, and "
            "work on the store fails until the server answers again",
            self.url,
            seconds,
        )

    def _watched(self, conn: psycopg.Connection[Any]) -> PostgresConn:
        """``conn`` as a :class:`PostgresConn` whose round trips have the deadline."""
        return PostgresConn(conn, self.url, self._dog, self.deadline)

    def _configure(self, conn: psycopg.Connection[Any]) -> None:
        with self._watched(conn).watched():
            configure(
                conn,
                durability=self.durability,
                lock_timeout=self.busy_timeout,
                server_deadline=max(self.busy_timeout, self.deadline - self.network_timeout / 2),
                read_only=self.read_only,
                schema=self.schema,
            )

    def _connect(self) -> psycopg.Connection[Any]:
        conn = psycopg.connect(self._dsn, autocommit=True, **self._parameters)
        try:
            self._configure(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _read_pool(self) -> ConnectionPool[Any]:
        return ConnectionPool(
            self._dsn,
            min_size=1,
            max_size=READERS,
            kwargs={"autocommit": True, **self._parameters},
            configure=self._configure,
            timeout=self.deadline,
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
            current = current_version(PostgresConn(writer)) if self.migrate else None
            if current is not None:
                # Nothing to migrate: no migration lock and no checks (a
                # store's open and close went from 17.7 to 11.1 ms).
                self.found_schema_version = current
            elif self.migrate:
                with writer.transaction():  # one migrator at a time, on any host
                    conn = PostgresConn(writer)
                    # Building an index on a large table may take minutes.
                    conn.execute("SET LOCAL statement_timeout = 0")
                    conn.execute(POSTGRES.migration_lock)
                    self.found_schema_version = migrate(conn, self._where, self.schema)
            else:
                self.found_schema_version = require_current(PostgresConn(writer), self._where)
            readers = self._read_pool()
        except BaseException:
            writer.close()
            raise
        self._writer, self._readers = writer, readers
        self._writer_conn = self._lazy = self._watched(writer)

    def _ensure_writer(self) -> None:
        """Replace the writer connection if its session has ended; on
        failure raise :class:`ConnectionLostError` (the next try waits out
        the backoff first, at most :data:`RECONNECT_MAX_DELAY`)."""
        assert self._lazy is not None
        writer = self._writer
        if writer is not None and alive(writer):
            return
        now = time.monotonic()
        if self._lost_at is None:
            self._lost_at, self._tries, self._delay, self._next_try_at = now, 0, 0.0, now
            if self._silent:  # cut by its deadline: the network, not the server
                self._delay = self.network_timeout
                self._next_try_at = now + self._delay
            if writer is not None:
                writer.close()
        if self._next_try_at > now:
            if self._silent:
                # Nothing waits behind a silent network: every write fails
                # at once until the next try (a worker stopping meanwhile
                # releases what it can and leaves the rest to their leases).
                raise ConnectionLostError(
                    f"the server at {self.url} has not answered since "
                    f"{now - self._lost_at:.1f}s ago; the next try to connect is in "
                    f"{self._next_try_at - now:.1f}s"
                )
            time.sleep(self._next_try_at - now)
        self._tries += 1
        try:
            writer = self._connect()
        except psycopg.Error as exc:
            self._delay = _next_delay(self._delay)
            if self._silent:
                self._delay = max(self._delay, self.network_timeout)
            self._next_try_at = time.monotonic() + self._delay
            raise ConnectionLostError(
                f"the connection to {self.url} ended and reconnecting failed "
                f"({error_text(exc)}); the next try waits {self._delay:g}s"
            ) from None
        self._writer = self._lazy._conn = writer
        self.reconnects["writer"] += 1
        self._silent = False
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
        self._lazy.held_keys = set()

    def _begin_single(self) -> None:
        # The writer's session is in autocommit: a statement sent without
        # BEGIN commits by itself, one round trip where BEGIN + statement
        # and COMMIT take two.
        assert self._lazy is not None
        self._ensure_writer()
        self._lazy.single = True
        self._lazy.held_keys = set()

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
        watch: Watch | None = None
        try:
            with self._lazy.watched() as watch:
                self._writer.execute("COMMIT")
            if self._silent:  # the server answers again
                self._silent = False
        except psycopg.OperationalError as exc:
            if not lost(self._writer):
                raise
            # The server may have committed and its answer been lost:
            # never report success, nor claim a rollback.
            raise ConnectionLostError(
                f"the connection to {self.url} ended while committing "
                f"({self._lazy.why(exc, watch)}); the outcome is unknown: the transaction "
                "may or may not have been committed",
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
            assert self._writer is not None and self._lazy is not None
            try:
                with self._lazy.watched():
                    self._writer.execute("ROLLBACK")
            except psycopg.Error:
                # Never leave a session idle in a transaction: closing ends
                # it on the server (a rollback), and the next transaction
                # reconnects. This runs on error paths: the first error is
                # the one to report.
                self._writer.close()

    def _keys_wait(self) -> None:
        # Not composed by the group commit: its key locks wait in the order
        # they are asked for, as on a caller's own connection.
        assert self._lazy is not None
        self._lazy.held_keys = None

    def _settled_error(self, exc: BaseException) -> BaseException | None:
        if isinstance(exc, psycopg.errors.DeadlockDetected | psycopg.errors.SerializationFailure):
            return None  # the server aborted this transaction to let another go on
        if isinstance(exc, psycopg.Error):
            error = StoreError(f"store {self.url}: {error_text(exc)}")
            error.__cause__ = exc
            return error
        return exc

    def _in_transaction(self) -> bool:
        if self._lazy is not None and self._lazy.begin_pending:
            return True
        return self._writer is not None and self._writer.info.transaction_status in (
            TransactionStatus.INTRANS,
            TransactionStatus.INERROR,
            TransactionStatus.ACTIVE,
        )

    def _close_connections(self) -> None:
        try:
            if self._readers is not None:
                self._readers.close()
            if self._writer is not None:
                self._writer.close()
        finally:
            self._readers, self._writer, self._lazy = None, None, None
            self._dog.stop()

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
                    if alive(reader):
                        return _read(self._watched(reader), work)
                    reader.close()
            with readers.connection() as reader:
                return _read(self._watched(reader), work)

        return await anyio.to_thread.run_sync(run, limiter=self._read_limiter)

    # -- cross-process wake-ups --------------------------------------------------

    async def listen(
        self,
        callback: Callable[[], None],
        *,
        on_cancel: Callable[[str | None], None] | None = None,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Call ``callback`` (in the event loop) whenever any process commits
        an enqueue to this database, and once listening (re)starts, since
        what was sent before went unheard, until cancelled. With
        ``on_cancel``, the same connection also listens for cancels of
        running attempts (:data:`~.dialect.CANCEL_CHANNEL`) and calls it
        with each one's dispatch id -- and with None once listening
        (re)starts. Raises if notifications are
        unavailable (e.g. behind a transaction-mode pooler); the caller
        then relies on its tick."""
        cancels = on_cancel is not None
        conn = await anyio.to_thread.run_sync(self._listening, cancels)
        try:
            task_status.started()
            callback()  # what was sent before it listened went unheard: look once
            if on_cancel is not None:
                on_cancel(None)
            while True:
                try:
                    await _relay(
                        conn,
                        callback,
                        on_cancel,
                        self._watched(conn),
                        self.network_timeout * LISTEN_CHECK_FACTOR,
                    )
                except psycopg.OperationalError as exc:
                    if not lost(conn):
                        raise
                    reason = error_text(exc)
                await anyio.to_thread.run_sync(conn.close)
                conn = await self._listen_again(reason, cancels)
                callback()  # what was sent while it was away is lost: look once
                if on_cancel is not None:
                    on_cancel(None)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(conn.close)

    def _listening(self, cancels: bool = False) -> psycopg.Connection[Any]:
        """A new connection that listens for enqueues (``POSTGRES.listen``)
        and, with ``cancels``, for cancels (``POSTGRES.cancel_listen``)."""
        conn = self._connect()
        try:
            with self._watched(conn).watched():
                if cancels:
                    conn.execute(POSTGRES.cancel_listen)
                conn.execute(POSTGRES.listen)
        except BaseException:
            conn.close()
            raise
        return conn

    async def _listen_again(self, reason: str, cancels: bool) -> psycopg.Connection[Any]:
        """Reconnect and listen, waiting :data:`RECONNECT_FIRST_DELAY`
        doubling to :data:`RECONNECT_MAX_DELAY` between tries while the
        server does not answer; anything else (e.g. a pooler refusing
        LISTEN) raises."""
        started = time.monotonic()
        delay, tries = 0.0, 0
        while True:
            tries += 1
            try:
                conn = await anyio.to_thread.run_sync(self._listening, cancels)
            except psycopg.OperationalError as exc:
                reason = error_text(exc)
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


def _read(watched: PostgresConn, work: Callable[[PostgresConn], T]) -> T:
    """``work`` in a read-only snapshot on ``watched``'s connection, which
    is left with no transaction open (or closed, and so dropped by the
    pool). The whole read has one deadline."""
    reader = watched._conn
    watch: Watch | None = None
    try:
        with watched.watched() as watch:
            reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            return work(PostgresConn(reader, watched.where))
    except psycopg.OperationalError as exc:
        if not lost(reader):
            raise
        raise_lost(watched.why(exc, watch), watched.where)
    finally:
        if not lost(reader):
            try:
                with watched.watched():
                    reader.execute("ROLLBACK")
            except psycopg.Error:
                reader.close()  # the first error is the one to report


async def _relay(
    conn: psycopg.Connection[Any],
    callback: Callable[[], None],
    on_cancel: Callable[[str | None], None] | None,
    watched: PostgresConn,
    check_every: float,
) -> NoReturn:
    """Call ``callback`` for each batch of enqueue notifications on
    ``conn``, and ``on_cancel`` with the payload of each cancel
    notification, until its session ends (psycopg's OperationalError).
    After ``check_every`` seconds without a word, a round trip with the
    deadline checks that the session still answers."""
    fd = conn.fileno()
    heard: list[psycopg.Notify] = []
    conn.add_notify_handler(heard.append)  # what arrives during a check
    while True:
        # The event loop watches the socket: cancellation is at once,
        # and no thread sits in a timed wait.
        with anyio.move_on_after(check_every) as quiet:
            await anyio.wait_readable(fd)
        if quiet.cancelled_caught:
            await anyio.to_thread.run_sync(_check, watched)
            arrived = [(notice.channel, notice.payload) for notice in heard]
            heard.clear()
        else:
            arrived = _drain_notifications(conn)
        _route(arrived, callback, on_cancel)


def _route(
    arrived: list[tuple[str, str]],
    callback: Callable[[], None],
    on_cancel: Callable[[str | None], None] | None,
) -> None:
    """Enqueues wake once per batch; each cancel is told by its id."""
    if any(channel != CANCEL_CHANNEL for channel, _ in arrived):
        callback()
    if on_cancel is not None:
        for channel, payload in arrived:
            if channel == CANCEL_CHANNEL:
                on_cancel(payload or None)


def _check(watched: PostgresConn) -> None:
    """One round trip on an idle listening connection, with the deadline
    (raises psycopg's OperationalError if it is cut or the session ended)."""
    with watched.watched():
        watched._conn.execute("SELECT 1")


def _drain_notifications(conn: psycopg.Connection[Any]) -> list[tuple[str, str]]:
    """Read what the server sent on an idle listening connection; return the
    notifications that came, as (channel, payload). Raises psycopg's
    OperationalError once the session has ended (the server went away or
    ended it)."""
    pgconn = conn.pgconn
    pgconn.consume_input()
    found: list[tuple[str, str]] = []
    while (notice := pgconn.notifies()) is not None:
        found.append((notice.relname.decode(), notice.extra.decode()))
    if pgconn.status != ConnStatus.OK:  # pragma: no cover - consume_input raises first
        raise psycopg.OperationalError("the connection is closed")
    return found
