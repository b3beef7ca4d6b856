"""The SQLite engine: WAL, busy_timeout, ``BEGIN IMMEDIATE`` writes,
``foreign_keys=ON``, one writer connection per process (group commit, see
:mod:`.batching`) and one reader connection."""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.abc

if TYPE_CHECKING:
    import sqlite_utils

from .base import (
    DEFAULT_BUSY_TIMEOUT_SECONDS,
    DURABILITIES,
    Durability,
    Row,
    SchemaError,
    StoreError,
    StoreOptions,
    T,
    Undecodable,
    decode_text,
    parse_target,
    query_in_turn,
)
from .batching import BatchingStore
from .dialect import SQLITE
from .placeholders import to_paramstyle
from .schema import current_version, migrate, require_current
from .transaction import BatchingTransaction

__all__ = [
    "DEFAULT_BUSY_TIMEOUT_SECONDS",
    "DURABILITIES",
    "Durability",
    "SQLiteConn",
    "SQLiteStore",
    "SQLiteTransaction",
    "SchemaError",
    "sqlite_path_from_target",
]

_HEADER: Final = b"SQLite format 3\x00"
DATA_VERSION_POLL_SECONDS: Final = 0.025
"""How often a listening worker asks SQLite whether anyone else committed."""
_WAL_VERSION: Final = 2  # file header bytes 18 and 19 in WAL mode


class SQLiteConn:
    """A :class:`~trio_dispatch.store.base.Conn` over one sqlite3 connection:
    the store's own, or -- ``borrowed`` -- a caller's
    (:mod:`trio_dispatch.sync`), whose settings (text and row factories,
    isolation level, autocommit) it leaves as the caller set them. Rows
    come back as dicts either way."""

    __slots__ = ("_conn", "_db")

    dialect = SQLITE  # BEGIN IMMEDIATE excludes other writers: no row locks

    def __init__(self, conn: sqlite3.Connection, *, borrowed: bool = False) -> None:
        if not borrowed:
            # Text that is not valid UTF-8 reads as Undecodable, never as an
            # error in the middle of a statement (one such row would fail
            # every scan that reaches it). A caller's connection keeps its
            # own text factory: its text may then come back as it says.
            conn.text_factory = decode_text
        self._conn = conn
        self._db: sqlite_utils.Database | None = None

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        cursor = self._conn.execute(*_bound(sql, params))
        try:
            return cursor.rowcount
        finally:
            cursor.close()

    def send(self, sql: str, params: Sequence[Any] = ()) -> None:
        self.execute(sql, params)

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> int:
        if Undecodable.made and any(Undecodable in map(type, row) for row in rows):
            return sum(self.execute(sql, row) for row in rows)
        cursor = self._conn.executemany(sql, rows)
        try:
            return cursor.rowcount
        finally:
            cursor.close()

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        # A cursor of our own, closed whatever happens: a statement left
        # open by an error while fetching (sqlite-utils' generators leave
        # it to the garbage collector) makes every later SAVEPOINT, RELEASE
        # or COMMIT on the connection fail with "SQL statements in progress".
        cursor = self._conn.cursor()
        try:
            cursor.row_factory = None  # a borrowed connection's row factory is the caller's
            cursor.execute(*_bound(sql, params))
            if cursor.description is None:
                return []
            keys = [column[0] for column in cursor.description]
            return [dict(zip(keys, row, strict=True)) for row in cursor.fetchall()]
        finally:
            cursor.close()

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
        """Other processes on the file learn of it on their next tick."""

    @property
    def utils(self) -> sqlite_utils.Database:
        """The sqlite-utils view of this connection (schema introspection),
        made on first use (it refuses a connection in ``autocommit`` mode,
        which a caller's may be). sqlite-utils is imported then too: it
        costs every process that opens a store 60 ms, every command too."""
        import sqlite_utils

        if self._db is None:
            self._db = sqlite_utils.Database(
                self._conn, recursive_triggers=False, execute_plugins=False
            )
        return self._db


def _bound(sql: str, params: Sequence[Any]) -> tuple[str, Sequence[Any]]:
    """``sql`` and ``params`` as SQLite is given them: a value read as
    :class:`~.base.Undecodable` (stored text that is not valid UTF-8) is
    bound as its own bytes, compared as text, so a statement about that row
    (its id in a fence, say) finds it."""
    if not Undecodable.made or Undecodable not in map(type, params):
        return sql, params
    spoiled = frozenset(i for i, value in enumerate(params) if type(value) is Undecodable)
    return to_paramstyle(sql, "qmark", as_text=spoiled), [
        value.raw if i in spoiled else value for i, value in enumerate(params)
    ]


def _uri(path: str, mode: str, *, immutable: bool = False) -> str:
    # A file: URI so that the open mode is explicit (ro / rw / rwc) and a
    # path holding "?" or "#" is still one path.
    return f"{Path(path).absolute().as_uri()}?mode={mode}{'&immutable=1' if immutable else ''}"


def _connect(
    path: str, *, mode: str, durability: Durability, busy_timeout: float, wal: bool = True
) -> sqlite3.Connection:
    """A connection to ``path`` (``mode`` ``rwc`` may create the file, ``rw``
    may not) with busy_timeout, foreign keys and the durability pragma; in
    WAL mode when ``wal`` (a persistent change of the file: only once the
    file is known to be, or to become, an outbox)."""
    # isolation_level=None: we issue BEGIN/COMMIT ourselves, never implicitly.
    target = path if path == ":memory:" else _uri(path, mode)
    conn = sqlite3.connect(
        target, timeout=busy_timeout, isolation_level=None, check_same_thread=False, uri=True
    )
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
        conn.execute("PRAGMA foreign_keys = ON")
        if wal:
            _use_wal(conn, path)
        conn.execute(f"PRAGMA synchronous = {'FULL' if durability == 'full' else 'NORMAL'}")
    except BaseException:
        conn.close()
        raise
    return conn


def begin_immediate(conn: sqlite3.Connection, busy_timeout: float) -> None:
    """``BEGIN IMMEDIATE``, waiting up to ``busy_timeout`` seconds while
    another process writes, trying again every :data:`BEGIN_POLL_SECONDS`
    at most. SQLite's own busy handler sleeps 1, 2, 5, 10 ... then 100 ms
    between tries, so a process that commits and begins again within a few
    milliseconds (a busy worker) kept another process's writer out for
    many of its transactions: beside a writer holding the lock 20 ms of
    every 23, the wait's p99 was 430-1,132 ms with SQLite's handler and
    19 ms trying every 0.5 ms (at most one of its transactions). Two
    worker processes on one file drained 12-25% more rows a second
    (docs/performance.md). After :data:`BEGIN_SHORT_WAIT_SECONDS` the tries
    come every :data:`BEGIN_LONG_POLL_SECONDS` (a writer holding the lock
    that long gains nothing from finer tries)."""
    conn.execute("PRAGMA busy_timeout = 0")
    try:
        started = time.monotonic()
        pause = BEGIN_FIRST_PAUSE_SECONDS
        while True:
            try:
                conn.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                waited = time.monotonic() - started
                if not _busy(exc) or waited >= busy_timeout:
                    raise
            longest = (
                BEGIN_POLL_SECONDS if waited < BEGIN_SHORT_WAIT_SECONDS else BEGIN_LONG_POLL_SECONDS
            )
            time.sleep(min(pause, max(0.0, busy_timeout - waited)))
            pause = min(longest, pause * 2)
    finally:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")


BEGIN_FIRST_PAUSE_SECONDS: Final = 0.0001
BEGIN_POLL_SECONDS: Final = 0.0005
"""The longest pause between two tries of a writer's ``BEGIN IMMEDIATE``
while another process writes (:func:`begin_immediate`), for the first
:data:`BEGIN_SHORT_WAIT_SECONDS` of a wait."""
BEGIN_SHORT_WAIT_SECONDS: Final = 0.1
BEGIN_LONG_POLL_SECONDS: Final = 0.005
"""The longest pause between tries once a wait has lasted
:data:`BEGIN_SHORT_WAIT_SECONDS`."""


def _busy(exc: sqlite3.OperationalError) -> bool:
    """Another connection holds the lock (``SQLITE_BUSY``, any extended code)."""
    return (exc.sqlite_errorcode & 0xFF) == sqlite3.SQLITE_BUSY


def _use_wal(conn: sqlite3.Connection, path: str) -> None:
    if path == ":memory:":
        return
    mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
    if str(mode).lower() != "wal":
        raise StoreError(f"cannot put {path!r} in WAL mode (journal_mode is {mode!r})")


def _file_header(path: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read(100)
    except FileNotFoundError:
        where = "" if Path(path).is_absolute() else f" (no file at {Path(path).absolute()})"
        raise StoreError(f"store {path!r} does not exist{where}") from None
    except IsADirectoryError:
        raise StoreError(f"store {path!r} is a directory, not a SQLite file") from None


def _open_read_only(path: str, busy_timeout: float, *, immutable: bool) -> sqlite3.Connection:
    conn = sqlite3.connect(
        _uri(path, "ro", immutable=immutable),
        timeout=busy_timeout,
        isolation_level=None,
        check_same_thread=False,
        uri=True,
    )
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
        conn.execute("PRAGMA query_only = ON")
        conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()  # opens the file now
    except BaseException:
        conn.close()
        raise
    return conn


def _journal_state(path: str) -> tuple[bool, bool]:
    """(in WAL mode, idle): idle means in WAL mode with no ``-wal`` or
    ``-shm`` file, so no other connection has the database open and every
    commit is in the main file. Raises StoreError for a file that is not
    a SQLite database."""
    header = _file_header(path)
    if header and not header.startswith(_HEADER):
        raise StoreError(f"{path!r} is not a SQLite database")
    wal_mode = len(header) > 18 and header[18] == _WAL_VERSION
    idle = wal_mode and not os.path.exists(f"{path}-wal") and not os.path.exists(f"{path}-shm")
    return wal_mode, idle


def _read_snapshot(path: str, busy_timeout: float, work: Callable[[SQLiteConn], T]) -> T:
    """Run ``work`` on a connection of its own, opened for this read and
    closed after it: ``immutable=1`` while the database is idle (nothing is
    created beside it), ``mode=ro`` while another connection has it open
    (its ``-wal``/``-shm`` files exist already, and its commits are seen).

    A writer may open the database during an immutable read, and a
    checkpoint may then change the main file under it: if the database is
    no longer idle when the read ends (or the read failed), the read runs
    again on a ``mode=ro`` connection, whose answer is consistent."""

    def run(conn: sqlite3.Connection) -> T:
        try:
            conn.execute("BEGIN")
            try:
                return work(SQLiteConn(conn))
            finally:
                conn.execute("COMMIT")
        finally:
            conn.close()

    if _journal_state(path)[1]:
        try:
            result = run(_open_read_only(path, busy_timeout, immutable=True))
        except sqlite3.DatabaseError:
            if _journal_state(path)[1]:
                raise
        else:
            if _journal_state(path)[1]:
                return result
    return run(_connect_read_only(path, busy_timeout=busy_timeout, snapshot=False))


def _connect_read_only(path: str, *, busy_timeout: float, snapshot: bool) -> sqlite3.Connection:
    """A connection that cannot change the file or its journal mode.

    ``mode=ro``: it sees every commit of other connections, as any reader
    of a live database; in WAL mode it needs the ``-shm`` file (creating
    it, and leaving it and an empty ``-wal`` behind, if no other connection
    has the database open).

    ``immutable=1`` reads the main file alone and creates nothing. It is
    right only while no other connection has the database open (no
    ``-wal``/``-shm`` files: every commit is in the main file) and only for
    a short read: a writer that starts meanwhile is not seen. So it serves
    a one-off read (``snapshot``, the CLI's read commands) of an idle
    database, and a user who cannot create the ``-shm`` file (a read-only
    directory) when nothing else has the database open."""
    wal_mode, idle = _journal_state(path)
    wal, shm = f"{path}-wal", f"{path}-shm"
    if snapshot and idle:
        return _open_read_only(path, busy_timeout, immutable=True)
    try:
        return _open_read_only(path, busy_timeout, immutable=False)
    except sqlite3.OperationalError:
        if not wal_mode or os.path.exists(shm):
            raise
        if os.path.exists(wal) and os.path.getsize(wal) > 0:
            raise StoreError(
                f"{path!r} cannot be read by this user: its -wal file holds commits that "
                "need a -shm file this user cannot create; read it as a user who can write "
                "its directory, or while a worker has it open"
            ) from None
        # Nothing else has it open and every commit is in the main file.
        return _open_read_only(path, busy_timeout, immutable=True)


def _migrate(conn: sqlite3.Connection, path: str, busy_timeout: float) -> int | None:
    """:func:`~.schema.migrate` in one IMMEDIATE transaction (which keeps
    other migrators out); return the version found before. A current
    schema is read without that transaction: opening never waits for
    another process's writer then."""
    current = current_version(SQLiteConn(conn))
    if current is not None:
        return current
    begin_immediate(conn, busy_timeout)
    try:
        found = migrate(SQLiteConn(conn), repr(path))
    except BaseException:
        _rollback(conn)
        raise
    _commit(conn)
    return found


def _rollback(conn: sqlite3.Connection | None) -> None:
    # SQLite may already have rolled back by itself (e.g. SQLITE_FULL).
    if conn is not None and conn.in_transaction:
        conn.execute("ROLLBACK")


def _commit(conn: sqlite3.Connection) -> None:
    """COMMIT, or roll back and re-raise if the commit fails."""
    try:
        conn.execute("COMMIT")
    except BaseException:
        _rollback(conn)
        raise


class SQLiteStore(BatchingStore):
    """An open SQLite store. Create it with :func:`trio_dispatch.open_store`.

    One writer connection per process (group commit, ``BEGIN IMMEDIATE``);
    reads use a second connection, a WAL snapshot that never waits for the
    writer. Several processes may share one file: ``BEGIN IMMEDIATE`` plus
    ``busy_timeout`` serialise their writers.
    """

    def __init__(self, path: str, options: StoreOptions | None = None) -> None:
        options = options or StoreOptions()
        if options.read_only and path == ":memory:":
            raise ValueError("a read-only store needs a database file, not ':memory:'")
        url = "sqlite:///:memory:" if path == ":memory:" else f"sqlite:///{path}"
        super().__init__(url, options)
        self.path = path
        self.snapshot = options.snapshot and options.read_only
        """Each read opens a connection of its own and closes it: an idle
        database is read without creating its ``-wal``/``-shm`` files, and a
        commit made meanwhile by another process is seen by the next read
        (see :func:`_read_snapshot`)."""
        self.durability: Durability = options.durability
        self.busy_timeout = options.busy_timeout
        self._writer: sqlite3.Connection | None = None
        self._reader: sqlite3.Connection | None = None
        self._reader_conn: SQLiteConn | None = None
        self._read_limiter = anyio.CapacityLimiter(1)

    def _connect_all(self) -> None:
        where = repr(self.path)
        if self.read_only and self.snapshot:
            # Every read opens its own connection (see read()): this one
            # only checks the schema, and is closed.
            self.found_schema_version = _read_snapshot(
                self.path,
                self.busy_timeout,
                lambda conn: require_current(conn, where),
            )
            return
        if self.read_only:
            reader = _connect_read_only(self.path, busy_timeout=self.busy_timeout, snapshot=False)
            try:
                self.found_schema_version = require_current(SQLiteConn(reader), where)
            except BaseException:
                reader.close()
                raise
            self._reader, self._reader_conn = reader, SQLiteConn(reader)
            return
        writer = _connect(
            self.path,
            mode="rwc" if self.migrate else "rw",
            durability=self.durability,
            busy_timeout=self.busy_timeout,
            wal=False,
        )
        try:
            # Only a file that is (now) an outbox is put in WAL mode, a
            # change the file keeps: a migration refused (a service's own
            # table in the way, a newer schema) leaves the file as it was.
            if self.migrate:
                self.found_schema_version = _migrate(writer, self.path, self.busy_timeout)
            else:
                self.found_schema_version = require_current(SQLiteConn(writer), where)
            _use_wal(writer, self.path)
            if self.path != ":memory:":
                reader = _connect(
                    self.path, mode="rw", durability=self.durability, busy_timeout=self.busy_timeout
                )
                reader.execute("PRAGMA query_only = ON")
                self._reader = reader
                self._reader_conn = SQLiteConn(reader)
        except BaseException:
            writer.close()
            raise
        self._writer = writer
        self._writer_conn = SQLiteConn(writer)

    # -- the engine primitives -------------------------------------------------

    def _begin(self) -> None:
        assert self._writer is not None
        begin_immediate(self._writer, self.busy_timeout)

    def _commit(self) -> None:
        assert self._writer is not None
        self._writer.execute("COMMIT")

    def _rollback(self) -> None:
        _rollback(self._writer)

    def _in_transaction(self) -> bool:
        return self._writer is not None and self._writer.in_transaction

    def _close_connections(self) -> None:
        for conn in (self._reader, self._writer):
            if conn is not None:
                conn.close()
        self._reader = self._writer = None
        self._reader_conn = None

    # -- reads -----------------------------------------------------------------

    async def read(self, work: Callable[[SQLiteConn], T]) -> T:
        self._check_open()
        if self.snapshot:
            return await anyio.to_thread.run_sync(
                _read_snapshot, self.path, self.busy_timeout, work, limiter=self._read_limiter
            )
        if self._reader is None or self._reader_conn is None:
            # ":memory:" has no second connection that could see the data.
            return await self.write(work)  # type: ignore[arg-type]
        reader, conn = self._reader, self._reader_conn

        def run() -> T:
            reader.execute("BEGIN")
            try:
                return work(conn)
            finally:
                reader.execute("COMMIT")

        return await anyio.to_thread.run_sync(run, limiter=self._read_limiter)

    # -- cross-process wake-ups ------------------------------------------------

    def _poller_connection(self) -> sqlite3.Connection:
        # Opened as the store's own reader is: a read-only store's is
        # read-only; otherwise a read-write connection that never writes
        # (a mode=ro one can outlive the -shm file it mapped, and then fail
        # with "disk I/O error" once the last writer closes).
        if self.read_only:
            return _connect_read_only(self.path, busy_timeout=self.busy_timeout, snapshot=False)
        conn = _connect(
            self.path, mode="rw", durability=self.durability, busy_timeout=self.busy_timeout
        )
        conn.execute("PRAGMA query_only = ON")
        return conn

    async def listen(
        self,
        callback: Callable[[], None],
        *,
        on_cancel: Callable[[str | None], None] | None = None,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Call ``callback`` (in the event loop) within
        :data:`DATA_VERSION_POLL_SECONDS` of any commit another connection
        or process makes to this file, until cancelled: a dedicated
        read-only connection polls ``PRAGMA data_version``, which changes
        when anyone else commits -- no table is read. ``on_cancel`` is
        called with None after each such commit (a cancel of a running
        attempt is one; SQLite cannot say which). Both are called once when
        the watch begins: a commit before its first read went unheard. An
        in-memory store has no other connection: it returns only when
        cancelled."""
        if self.path == ":memory:":
            task_status.started()
            await anyio.sleep_forever()
        conn = await anyio.to_thread.run_sync(self._poller_connection)
        limiter = anyio.CapacityLimiter(1)

        def data_version() -> int:
            return int(conn.execute("PRAGMA data_version").fetchone()[0])

        try:
            seen = await anyio.to_thread.run_sync(data_version, limiter=limiter)
            # From here the poll runs in the event loop itself: a few
            # microseconds, where a hop to a worker thread and back cost
            # ~0.7 ms of CPU, 40 times a second (an idle worker spent 3% of
            # a core on it). It never waits: the connection's busy timeout
            # is 0, and a busy answer (a checkpoint restarting the WAL) is
            # taken as a change -- a wake too many, never one too few.
            await anyio.to_thread.run_sync(conn.execute, "PRAGMA busy_timeout = 0")
            task_status.started()
            heard = callback if on_cancel is None else partial(_both, callback, on_cancel)
            heard()  # what committed before the first read went unheard: look once
            while True:
                await anyio.sleep(DATA_VERSION_POLL_SECONDS)
                try:
                    version = data_version()
                except sqlite3.OperationalError:
                    heard()
                    continue
                if version != seen:
                    seen = version
                    heard()
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(conn.close, limiter=limiter)


def _both(callback: Callable[[], None], on_cancel: Callable[[str | None], None]) -> None:
    callback()
    on_cancel(None)


SQLiteTransaction = BatchingTransaction
"""A caller-owned transaction on a SQLite store."""


def sqlite_path_from_target(target: str | Path) -> str:
    """The file path (or ``":memory:"``) that ``target`` names; ValueError
    for a target that is not a SQLite one."""
    if isinstance(target, Path):
        return str(target)
    engine, location = parse_target(target)
    if engine != "sqlite":
        raise ValueError(f"not a SQLite store: {target.split('://', 1)[0]}://...")
    return location
