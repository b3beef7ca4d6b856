"""The SQLite engine: WAL, busy_timeout, ``BEGIN IMMEDIATE`` writes,
``foreign_keys=ON``, one writer connection per process (group commit, see
:mod:`.batching`) and one reader connection."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, Literal

import anyio
import sqlite_utils

from .base import Row, T
from .batching import BatchingStore, BatchingTransaction
from .schema import MIGRATIONS, SCHEMA_VERSION, SCHEMA_VERSION_TABLE

Durability = Literal["full", "normal"]
DURABILITIES: Final = ("full", "normal")
DEFAULT_BUSY_TIMEOUT_SECONDS: Final = 10.0


class SchemaError(RuntimeError):
    """The database's schema cannot be used by this version."""


class SQLiteConn:
    """A :class:`~trio_dispatch.store.base.Conn` over one sqlite3 connection."""

    __slots__ = ("_conn", "_db")

    lock_clause = ""  # BEGIN IMMEDIATE already excludes other writers
    row_key = "rowid"

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

    def announce_enqueue(self) -> None:
        """Other processes on the file learn of it on their next tick."""

    @property
    def utils(self) -> sqlite_utils.Database:
        """The sqlite-utils view of this connection (schema introspection)."""
        return self._db


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

    def __init__(
        self,
        path: str,
        *,
        durability: Durability = "full",
        busy_timeout: float = DEFAULT_BUSY_TIMEOUT_SECONDS,
    ) -> None:
        if durability not in DURABILITIES:
            raise ValueError(f"durability must be one of {DURABILITIES}, got {durability!r}")
        super().__init__()
        self.path = path
        self.url = "sqlite:///:memory:" if path == ":memory:" else f"sqlite:///{path}"
        self.durability: Durability = durability
        self.busy_timeout = busy_timeout
        self._writer: sqlite3.Connection | None = None
        self._reader: sqlite3.Connection | None = None
        self._reader_conn: SQLiteConn | None = None
        self._read_limiter = anyio.CapacityLimiter(1)

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
                    self._reader_conn = SQLiteConn(reader)
            except BaseException:
                writer.close()
                raise
            self._writer = writer
            self._writer_conn = SQLiteConn(writer)

        await self._in_writer(open_all)

    # -- the engine primitives -------------------------------------------------

    def _begin(self) -> None:
        assert self._writer is not None
        self._writer.execute("BEGIN IMMEDIATE")

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


SQLiteTransaction = BatchingTransaction
"""A caller-owned transaction on a SQLite store."""


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
