"""The one place where the engines differ: a :class:`Dialect` per engine.

Every statement the outbox runs is written once, in SQLite's spelling with
``?`` placeholders (each connection turns them into its driver's style);
what an engine spells differently -- its DDL, how a claim locks rows, how a
row is addressed, how it says bulk work in one statement
(:class:`ArrayForms`: PostgreSQL's are :mod:`.pg_statements`), how other
processes are told of an enqueue or of a running attempt's cancel, how
migrators take turns -- is a field here. A connection carries its dialect
(:attr:`~.base.Conn.dialect`), and the state machine asks it instead of
testing for an engine: no module of the outbox spells an array, a cast,
``LATERAL`` or a notice. A new engine
is a connection module plus one :class:`Dialect`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final, Protocol

from .pg_statements import ARRAYS as _POSTGRES_ARRAYS
from .pg_statements import CANCEL_CHANNEL as CANCEL_CHANNEL
from .pg_statements import CHANNEL as CHANNEL
from .placeholders import Replanned as Replanned
from .placeholders import Typed as Typed

if TYPE_CHECKING:
    from .base import Conn
MIGRATION_LOCK: Final = 727_274_001
"""The PostgreSQL advisory lock key a migrator holds: one at a time."""
KEY_LOCK_SEED: Final = 727_274_002
"""The seed of the hash that turns an ordering key into its PostgreSQL
advisory lock key."""


class ArrayForms(Protocol):
    """How an engine whose parameters may be arrays, and whose ``WITH`` may
    write, says a bulk statement in one fixed text (one round trip, prepared
    once, whatever the batch size). The outbox builds its statements from
    these and its own portable pieces; it never spells an array itself.
    Types are named ``text``, ``int8``, ``float8``, ``json``. PostgreSQL's
    are :class:`~.pg_statements.PostgresArrays`."""

    def __hash__(self) -> int:
        """Hashable: the outbox keeps each statement it built per engine."""

    @property
    def transitions(self) -> str:
        """Many ``status_transitions`` rows, one array per column."""

    def any_of(self, column: str) -> str:
        """The many-ids form: ``column`` is one of an array parameter's texts."""

    def rows(self, types: Sequence[str], *, numbered: bool = False) -> str:
        """A row per array element, one array parameter per column."""

    def each(self, alias: str, columns: Sequence[tuple[str, str]], subquery: str, name: str) -> str:
        """A ``FROM`` item running ``subquery`` once per array element."""

    def record_insert(self, insert: str) -> str:
        """An insert, its transition row and the enqueue notice at once."""

    def record_claim(self, claim: str) -> str:
        """A claim's UPDATE and the transition row of each claim at once."""

    def record_finish(self, columns: Sequence[str], types: Sequence[str], update: str) -> str:
        """The finish of many attempts and the transitions of those that applied."""

    def record_supersede(self, term: str, guard: str, status: str, reason: str) -> str:
        """The waiting rows of many coalesce keys superseded, each with its
        transition naming its successor, at once."""

    def record_replace(
        self, term: str, head_start: str, reason: str, enqueued: str, lock: str | None = None
    ) -> str:
        """One replacing enqueue -- the key's waiting row found by its unique
        index, superseded, the new row inserted, both transitions and the
        notice -- in one statement."""


@dataclasses.dataclass(frozen=True)
class Dialect:
    """How one engine spells what differs between engines."""

    name: str
    table_exists: str
    """A query taking a table name, answering one row whose first value is
    true when the table exists."""
    column_exists: str = ""
    """A query taking a table and a column name, answering a row when the
    table has that column (in the schema the outbox's tables are in)."""
    ddl: Callable[[str], str] = lambda statement: statement
    """The engine's spelling of one schema statement."""
    key_problem: Callable[[Conn, str], str | None] = lambda conn, table: None
    """What keeps an existing table's ``id`` from being the target of the
    outbox's foreign keys (None: the table is absent, or it can be)."""
    lock_clause: str = ""
    """Appended to a SELECT whose rows the transaction is about to claim:
    ``" FOR UPDATE SKIP LOCKED"`` where rows lock (PostgreSQL), empty where
    the write transaction already excludes other writers (SQLite)."""
    row_lock: str = ""
    """Appended to a SELECT of one row the transaction must hold until it
    ends, waiting for it: ``" FOR UPDATE"`` where rows lock (PostgreSQL; a
    destination's state row, say), empty where the write transaction
    already excludes other writers (SQLite)."""
    row_key: str = "rowid"
    """The cheapest way to address a ``dispatch_outbox`` row selected earlier
    in the same write transaction: ``rowid`` on SQLite (the table's own
    b-tree, no probe of the random-uuid primary key index), ``id`` on
    PostgreSQL."""
    arrays: ArrayForms | None = None
    """Where a ``WITH`` clause may write and parameters may be arrays, the
    engine's one-statement forms (:class:`ArrayForms`): then an enqueue is
    one statement (row, history and notice), and the delivery path's bulk
    statements take one array per column (fixed SQL text, prepared once)
    instead of a ``VALUES`` row of placeholders per item. None: the
    portable forms."""
    notify: str = ""
    """The statement that tells other processes, once the transaction
    commits, that a dispatch was enqueued (empty: they poll)."""
    listen: str = ""
    """The statement a connection runs to hear :attr:`notify`."""
    cancel_notice: str = ""
    """A statement taking a dispatch id that tells other processes, once the
    transaction commits, that the running attempt of that dispatch was
    cancelled (empty: they watch every commit, as SQLite's workers do)."""
    cancel_listen: str = ""
    """The statement a connection runs to hear :attr:`cancel_notice`."""
    index_hint: str = ""
    """How a statement names the index to read (``{}`` is its name), where
    the planner must be told: SQLite, without statistics, prefers the status
    index to a better one. Empty: the planner chooses (PostgreSQL)."""
    schemas: bool = False
    """Whether tables live in named schemas found through ``search_path``."""
    migration_lock: str = ""
    """A statement that makes concurrent migrators take turns until the
    transaction ends (empty: the write lock already does)."""
    key_locks: str = ""
    """A statement taking an array of ordering keys that holds each key's
    lock until the transaction ends, waiting for it, in code-point order
    (as Python sorts strings: every transaction's one order; empty: the
    write lock already serializes every writer)."""
    key_try_locks: str = ""
    """Like :attr:`key_locks` without waiting: answers the keys (column
    ``key``) it took; a key another transaction holds is left out."""
    replace_check: Callable[[Conn, str, str, str], None] = lambda conn, table, column, term: None
    """``replace_check(conn, table, column, term)`` makes ``term`` the CHECK
    constraint on ``table.column`` in place of the one it has, without
    rewriting the table's rows; only ever to allow more values (a new
    status), so the rows already there satisfy it."""
    clock: str = ""
    """An expression for the store's own time in Unix seconds, where every
    host that shares the store shares its clock (the database server's):
    what a second host must agree on (is this schedule's tick due?) is
    decided by it, not by one host's wall clock. Empty where the process's
    clock is the store's (SQLite: one machine)."""

    def use_index(self, name: str) -> str:
        """The clause that makes a read use index ``name`` (empty where the
        planner chooses by itself)."""
        return self.index_hint.format(name)


def quoted(name: str) -> str:
    """``name`` as an SQL identifier, quoted."""
    return '"' + name.replace('"', '""') + '"'


def _sqlite_key_problem(conn: Conn, table: str) -> str | None:
    # SQLite checks a foreign key's target only when a row is written
    # ("foreign key mismatch"), so the check is ours. Any declared type
    # will do: SQLite compares a key with the target column's affinity.
    found = conn.query_one(
        "SELECT type FROM sqlite_master WHERE type IN ('table', 'view') AND name = ? "
        "COLLATE NOCASE",
        (table,),
    )
    if found is None:
        return None
    if found["type"] != "table":
        return f"is a {found['type']}, not a table"
    columns = conn.query(f"PRAGMA table_info({quoted(table)})")
    if not any(str(column["name"]).lower() == "id" for column in columns):
        return 'has no "id" column'
    key = [str(column["name"]).lower() for column in columns if column["pk"]]
    if key == ["id"]:
        return None
    for index in conn.query(f"PRAGMA index_list({quoted(table)})"):
        if index["unique"] and not index["partial"]:
            parts = conn.query(f"PRAGMA index_info({quoted(str(index['name']))})")
            if [str(part["name"]).lower() for part in parts] == ["id"]:
                return None
    return 'lacks a unique "id" column (neither its primary key nor a unique index)'


_SQLITE_CHECK: Final = r"CHECK\s*\(\s*{column}\s+IN\s*\([^()]*\)\s*\)"


def _sqlite_replace_check(conn: Conn, table: str, column: str, term: str) -> None:
    # SQLite cannot alter a constraint. Allowing more values changes nothing
    # stored on disk, so the table's recorded definition is edited in place
    # (SQLite's documented procedure for such changes: writable_schema and
    # a schema_version bump, so every connection rereads the schema) instead
    # of copying every row into a new table. Runs in the migrator's write
    # transaction: it commits with the rest of the migration or not at all.
    found = conn.query_one(
        "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)
    )
    if found is None:
        return
    old = str(found["sql"])
    pattern = re.compile(_SQLITE_CHECK.format(column=re.escape(column)), re.IGNORECASE)
    new = pattern.sub(lambda _: f"CHECK ({term})", old, count=1)
    if new == old:
        return  # no such constraint (an adopted table without it), or it is the term already
    version = conn.query_one("PRAGMA schema_version")
    assert version is not None
    conn.execute("PRAGMA writable_schema = ON")
    try:
        conn.execute(
            "UPDATE sqlite_master SET sql = ? WHERE type = 'table' AND name = ?", (new, table)
        )
        conn.execute(f"PRAGMA schema_version = {int(version['schema_version']) + 1}")
    finally:
        conn.execute("PRAGMA writable_schema = OFF")


_POSTGRES_CHECKS: Final = r"""
    SELECT conname AS name FROM pg_constraint
    WHERE conrelid = to_regclass(?) AND contype = 'c'
      AND pg_get_constraintdef(oid) ~ ('\m' || ? || '\M')
"""


def _postgres_replace_check(conn: Conn, table: str, column: str, term: str) -> None:
    for constraint in conn.query(_POSTGRES_CHECKS, (table, column)):
        name = quoted(str(constraint["name"]))
        conn.execute(f"ALTER TABLE {quoted(table)} DROP CONSTRAINT {name}")
    conn.execute(
        f"ALTER TABLE {quoted(table)} ADD CONSTRAINT {quoted(f'{table}_{column}_check')} "
        f"CHECK ({term})"
    )


_POSTGRES_KEY: Final = """
    SELECT c.relkind::text AS kind,
           a.attnum IS NOT NULL AS has_id,
           format_type(a.atttypid, a.atttypmod) AS id_type,
           a.atttypid IN ('text'::regtype, 'varchar'::regtype) AS text_id,
           EXISTS (
               SELECT 1 FROM pg_index i
               WHERE i.indrelid = c.oid AND i.indisunique AND i.indimmediate
                 AND i.indpred IS NULL AND i.indexprs IS NULL
                 AND i.indnkeyatts = 1 AND i.indkey[0] = a.attnum
           ) AS unique_id
    FROM pg_class c
    LEFT JOIN pg_attribute a
           ON a.attrelid = c.oid AND a.attname = 'id' AND a.attnum > 0 AND NOT a.attisdropped
    WHERE c.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
      AND c.relname = ?
"""
_POSTGRES_KINDS: Final = {
    "v": "view",
    "m": "materialized view",
    "f": "foreign table",
    "S": "sequence",
    "i": "index",
    "I": "index",
    "c": "composite type",
}


def _postgres_key_problem(conn: Conn, table: str) -> str | None:
    # Where CREATE TABLE IF NOT EXISTS looks: the first schema of the
    # search_path that exists, not every schema a name resolves through.
    found = conn.query_one(_POSTGRES_KEY, (table,))
    if found is None:
        return None
    if found["kind"] not in ("r", "p"):
        return f"is a {_POSTGRES_KINDS.get(found['kind'], 'relation')}, not a table"
    if not found["has_id"]:
        return 'has no "id" column'
    if not found["text_id"]:
        return f'has an "id" column of type {found["id_type"]}, not text'
    if not found["unique_id"]:
        return 'lacks a unique "id" column (neither its primary key nor a unique constraint)'
    return None


SQLITE: Final = Dialect(
    "sqlite",
    "SELECT COUNT(*) AS found FROM sqlite_master WHERE type = 'table' AND name = ?",
    "SELECT 1 AS found FROM pragma_table_info(?) WHERE name = ?",
    key_problem=_sqlite_key_problem,
    index_hint=" INDEXED BY {}",
    replace_check=_sqlite_replace_check,
)
POSTGRES: Final = Dialect(
    "postgres",
    "SELECT to_regclass(?) IS NOT NULL AS found",
    "SELECT 1 AS found FROM information_schema.columns "
    "WHERE table_schema = current_schema() AND table_name = ? AND column_name = ?",
    lambda statement: statement.replace(
        "INTEGER PRIMARY KEY", "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY"
    ),
    _postgres_key_problem,
    lock_clause=" FOR UPDATE SKIP LOCKED",
    row_lock=" FOR UPDATE",
    row_key="id",
    arrays=_POSTGRES_ARRAYS,
    schemas=True,
    notify=f"NOTIFY {CHANNEL}",
    listen=f"LISTEN {CHANNEL}",
    cancel_notice=f"SELECT pg_notify('{CANCEL_CHANNEL}', ?) AS sent",
    cancel_listen=f"LISTEN {CANCEL_CHANNEL}",
    migration_lock=f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK}) AS locked",
    key_locks=(
        f"SELECT COUNT(pg_advisory_xact_lock(hashtextextended(k, {KEY_LOCK_SEED}))) AS locked "
        'FROM (SELECT DISTINCT k COLLATE "C" AS k FROM unnest(?::text[]) AS u(k) '
        "ORDER BY k) AS sorted"
    ),
    key_try_locks=(
        'SELECT k AS key FROM (SELECT DISTINCT k COLLATE "C" AS k FROM unnest(?::text[]) '
        "AS u(k) ORDER BY k) "
        f"AS sorted WHERE pg_try_advisory_xact_lock(hashtextextended(k, {KEY_LOCK_SEED}))"
    ),
    replace_check=_postgres_replace_check,
    # clock_timestamp(), not now(): the time the statement runs, not the
    # time its transaction began.
    clock="EXTRACT(EPOCH FROM clock_timestamp())::float8",
)
DIALECTS: Final = {dialect.name: dialect for dialect in (SQLITE, POSTGRES)}
