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

import contextlib
import math
import select
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, NoReturn

import anyio

from ..redact import (
    AMBIGUOUS_URL_ERROR,
    ambiguous_userinfo,
    known_secrets,
    mask_url,
    one_line,
    register_secrets,
    scrubbed_logger,
    url_secrets,
)
from ..values import show
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
from .watchdog import Watch, Watchdog, shut_socket

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

LISTEN_CHECK_FACTOR: Final = 6
"""An idle listener sends a round trip after this many network timeouts
without a word from the server (30 s by default): a session a silent
network cut would otherwise never be noticed, and enqueues never wake."""
KEEPALIVE_COUNT: Final = 3

log = scrubbed_logger("trio_dispatch.store")


def connection_parameters(url: str, network_timeout: float) -> dict[str, Any]:
    """libpq parameters that bound connecting and a dead peer, from
    ``network_timeout``; a parameter the URL sets itself is left to it."""
    seconds = max(1, math.ceil(network_timeout))
    wanted: dict[str, Any] = {
        "connect_timeout": max(2, seconds),
        "keepalives": 1,
        "keepalives_idle": seconds,
        "keepalives_interval": max(1, math.ceil(network_timeout / KEEPALIVE_COUNT)),
        "keepalives_count": KEEPALIVE_COUNT,
        "tcp_user_timeout": int(network_timeout * 1000),
    }
    given = psycopg.conninfo.conninfo_to_dict(url)
    return {name: value for name, value in wanted.items() if name not in given}


def silence(seconds: float) -> str:
    """What a round trip cut by its deadline says."""
    return (
        f"no answer from the server in {seconds:g}s "
        "(busy_timeout_seconds + network_timeout_seconds); the connection was dropped"
    )


def _shut(conn: psycopg.Connection[Any]) -> None:
    """Cut ``conn``'s socket under whatever call is blocked on it."""
    if conn.closed:
        return
    try:
        fd = conn.pgconn.socket
    except psycopg.OperationalError:
        return
    shut_socket(fd)


def check_url(url: str) -> None:
    """A ``postgresql://`` store URL as libpq would take it, checked before
    anything connects: a user name and password whose pieces libpq would
    split differently, an unknown parameter, a port that is not a number
    are ValueErrors naming the URL masked. Without psycopg only the first
    is checked (opening names the missing extra)."""
    if ambiguous_userinfo(url):  # not even masked: its host may be a piece of it
        raise ValueError(f"invalid store URL: {AMBIGUOUS_URL_ERROR}")
    if psycopg is None:
        return
    # libpq splits a password at its own idea of the URL's pieces and quotes
    # a piece (in "user:pa/ss@host" it reads "user:pa" as host and port):
    # with a password in the URL, libpq's text is not shown.
    has_password = bool(url_secrets(url))
    try:
        params = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.Error as exc:
        reason = (
            "libpq cannot parse it (an unknown query parameter, or a space, @, /, :, "
            "?, # or % in the user name or password that is not percent-encoded)"
            if has_password
            else " ".join(str(exc).split())
        )
        raise ValueError(f"invalid store URL {show(mask_url(url))}: {reason}") from None
    for port in str(params.get("port") or "").split(","):
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            shown = "" if has_password else f" {show(port)}"
            raise ValueError(
                f"invalid store URL {show(mask_url(url))}: the port{shown} is not a number "
                "from 1 to 65535"
            )


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

    __slots__ = ("_conn", "begin_pending", "dog", "held_keys", "seconds", "single", "where")

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        where: str = "the server",
        dog: Watchdog | None = None,
        seconds: float = 0.0,
    ) -> None:
        self._conn = conn
        self.begin_pending = False
        self.single: bool | None = None  # None: not a single; False: its statement went
        self.where = where  # the masked URL, for messages
        self.dog = dog  # cuts a round trip still unanswered after ``seconds``
        self.seconds = seconds
        self.held_keys: set[str] | None = None
        """The ordering keys whose locks this transaction holds, kept where
        the group commit composes the transaction (see
        :func:`~trio_dispatch.outbox.ordering.lock_keys`); None elsewhere."""

    @contextlib.contextmanager
    def watched(self) -> Iterator[Watch | None]:
        """Around one round trip: cut it if no answer comes in time."""
        if self.dog is None:
            yield None
            return
        with self.dog.watch(self.seconds, self._cut) as watch:
            yield watch

    def _cut(self) -> None:
        _shut(self._conn)

    def why(self, exc: BaseException, watch: Watch | None) -> str:
        """Why a round trip failed, in one password-free line."""
        return silence(self.seconds) if watch is not None and watch.fired else _reason(exc)

    def _send(self, send: Callable[[], object], pipelined: bool = True) -> None:
        single = self.single
        if single is False:
            # The first statement has committed: a second would not be
            # atomic with it. A caller's promise broken is a bug, said loudly.
            raise StoreError("a single-statement write ran a second statement")
        if single:
            self.single = False
        watch: Watch | None = None
        try:
            with self.watched() as watch:
                self._send_once(send, pipelined)
        except psycopg.OperationalError as exc:
            if not _lost(self._conn):
                raise
            if single:
                raise ConnectionLostError(
                    f"the connection to {self.where} ended while its statement ran "
                    f"({self.why(exc, watch)}); the outcome is unknown: it may or may not "
                    "have been committed",
                    outcome_unknown=True,
                ) from None
            _raise_lost(self.why(exc, watch), self.where)

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


def _raise_lost(reason: str, where: str) -> NoReturn:
    raise ConnectionLostError(
        f"the connection to {where} ended during this transaction ({reason}): "
        "nothing in it was committed"
    ) from None


def _configure(
    conn: psycopg.Connection[Any],
    *,
    durability: str,
    lock_timeout: float,
    server_deadline: float,
    read_only: bool = False,
    schema: str | None = None,
) -> None:
    # JSON columns come back as their text, as stored (the payload is sent as is).
    conn.adapters.register_loader("json", TextLoader)
    conn.adapters.register_loader("jsonb", TextLoader)
    settings = [
        f"SET synchronous_commit = {'on' if durability == 'full' else 'off'}",
        f"SET lock_timeout = '{int(lock_timeout * 1000)}ms'",
        # A session whose client went silent lets its locks go by the
        # deadline the client gives up at, instead of holding them forever;
        # a slow statement ends on the server a little before the client's
        # deadline, as an error on a connection that lives on.
        f"SET idle_in_transaction_session_timeout = '{math.ceil(server_deadline * 1000)}ms'",
        f"SET statement_timeout = '{math.ceil(server_deadline * 1000)}ms'",
    ]
    if conn.info.server_version >= 110000:  # JIT compiled a 0.1 ms claim scan in 11 ms
        settings.append("SET jit = off")
    if schema is not None:
        # Every outbox statement names its tables unqualified: on every
        # connection of the store they resolve in this schema alone
        # (pg_catalog, always searched first, still serves the built-ins).
        # The name is a checked identifier (store_schema).
        settings.append(f'SET search_path TO "{schema}"')
    if read_only:
        settings.append("SET default_transaction_read_only = on")
    conn.execute("; ".join(settings))  # one round trip (the simple protocol)


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
            _configure(
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
            if self.migrate:
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
        if writer is not None and _alive(writer):
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
                f"({_reason(exc)}); the next try waits {self._delay:g}s"
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
            if not _lost(self._writer):
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

    def _owned_by_caller(self) -> None:
        # The caller composes its own transaction: its key locks wait in
        # the order it asks for them, as on the caller's own connection.
        assert self._lazy is not None
        self._lazy.held_keys = None

    def _settled_error(self, exc: BaseException) -> BaseException | None:
        if isinstance(exc, psycopg.errors.DeadlockDetected | psycopg.errors.SerializationFailure):
            return None  # the server aborted this transaction to let another go on
        if isinstance(exc, psycopg.Error):
            error = StoreError(f"store {self.url}: {_reason(exc)}")
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
                    if _alive(reader):
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
                    await _relay(
                        conn,
                        callback,
                        self._watched(conn),
                        self.network_timeout * LISTEN_CHECK_FACTOR,
                    )
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
            with self._watched(conn).watched():
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
        if not _lost(reader):
            raise
        _raise_lost(watched.why(exc, watch), watched.where)
    finally:
        if not _lost(reader):
            try:
                with watched.watched():
                    reader.execute("ROLLBACK")
            except psycopg.Error:
                reader.close()  # the first error is the one to report


async def _relay(
    conn: psycopg.Connection[Any],
    callback: Callable[[], None],
    watched: PostgresConn,
    check_every: float,
) -> NoReturn:
    """Call ``callback`` for each batch of notifications on ``conn`` until
    its session ends (psycopg's OperationalError). After ``check_every``
    seconds without a word, a round trip with the deadline checks that the
    session still answers."""
    fd = conn.fileno()
    heard: list[object] = []
    conn.add_notify_handler(heard.append)  # what arrives during a check
    while True:
        # The event loop watches the socket: cancellation is at once,
        # and no thread sits in a timed wait.
        with anyio.move_on_after(check_every) as quiet:
            await anyio.wait_readable(fd)
        if quiet.cancelled_caught:
            await anyio.to_thread.run_sync(_check, watched)
            if heard:
                heard.clear()
                callback()
            continue
        if _drain_notifications(conn):
            callback()


def _check(watched: PostgresConn) -> None:
    """One round trip on an idle listening connection, with the deadline
    (raises psycopg's OperationalError if it is cut or the session ended)."""
    with watched.watched():
        watched._conn.execute("SELECT 1")


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
