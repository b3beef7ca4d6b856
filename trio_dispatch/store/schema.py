"""Schema DDL and the one forward-only migration routine, for every engine.

Version 1 is the table of ADR D1 exactly (every column, default, CHECK and
both partial indexes), the ``status_transitions`` history, and minimal
``sessions`` / ``schedule_runs`` tables for the provenance foreign keys. Every
statement is idempotent (``IF NOT EXISTS``), so a database created by an
earlier implementation of the same design is adopted without touching its
rows. Version 2 appends ``created_at`` to the ADR's partial due index, so
the claim order comes from the index alone (the index still serves every
query the ADR's two-column one does). Version 3 adds a partial index of the
due rows by destination, so a claim that leaves out destinations at their
cap finds the others' rows without reading the capped ones.

The status lists in the DDL come from :mod:`trio_dispatch.lifecycle`; the
statements are written once, in SQLite's spelling, and a :class:`Dialect`
says how an engine spells the few things that differ.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Final

from ..lifecycle import DUE_SQL, FINISHED_SQL, STATUS_CHECK_SQL, Status
from .base import Conn, SchemaError, check_schema_version

SCHEMA_VERSION_TABLE: Final = "trio_dispatch_schema"
MIGRATION_LOCK: Final = 727_274_001
"""The PostgreSQL advisory lock key a migrator holds: one at a time."""
FINISHED_STATUSES_SQL: Final = FINISHED_SQL
"""A query that wants the finished-age index must repeat this term verbatim."""

_V1: Final = (
    """
    CREATE TABLE IF NOT EXISTS sessions (
        id TEXT PRIMARY KEY,
        created_at FLOAT
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS schedule_runs (
        id TEXT PRIMARY KEY,
        created_at FLOAT
    )
    """,
    f"""
    CREATE TABLE IF NOT EXISTS dispatch_outbox (
        id               TEXT PRIMARY KEY,
        kind             TEXT NOT NULL,
        deliver_to       TEXT NOT NULL,
        payload          JSON NOT NULL,
        dedup_key        TEXT NULL,
        status           TEXT NOT NULL DEFAULT '{Status.PENDING}'
                         CHECK ({STATUS_CHECK_SQL}),
        attempt          INTEGER NOT NULL DEFAULT 0,
        max_attempts     INTEGER NOT NULL DEFAULT 8,
        next_attempt_at  FLOAT NOT NULL,
        ack_required     INTEGER NOT NULL DEFAULT 0,
        ack_token        TEXT NULL,
        session_id       TEXT NULL REFERENCES sessions(id),
        schedule_run_id  TEXT NULL REFERENCES schedule_runs(id),
        last_error       TEXT NULL,
        created_at       FLOAT NOT NULL,
        expires_at       FLOAT NULL,
        updated_at       FLOAT NULL
    )
    """,
    """
    CREATE UNIQUE INDEX IF NOT EXISTS ux_dispatch_outbox_dedup_key
        ON dispatch_outbox (dedup_key) WHERE dedup_key IS NOT NULL
    """,
    f"""
    CREATE INDEX IF NOT EXISTS ix_dispatch_outbox_status_next_attempt
        ON dispatch_outbox (status, next_attempt_at)
        WHERE {DUE_SQL}
    """,
    # Retention (prune) and stats select finished rows of one status by age.
    # Partial: live rows (the hot path) never pay for it.
    f"""
    CREATE INDEX IF NOT EXISTS ix_dispatch_outbox_finished_age
        ON dispatch_outbox (status, COALESCE(updated_at, created_at))
        WHERE {FINISHED_SQL}
    """,
    """
    CREATE INDEX IF NOT EXISTS ix_dispatch_outbox_created
        ON dispatch_outbox (created_at)
    """,
    """
    CREATE TABLE IF NOT EXISTS status_transitions (
        id               INTEGER PRIMARY KEY,
        entity_type      TEXT NOT NULL,
        entity_id        TEXT NOT NULL,
        previous_status  TEXT NULL,
        status           TEXT NOT NULL,
        reason_code      TEXT NOT NULL,
        reason_summary   TEXT NOT NULL DEFAULT '',
        source           TEXT NOT NULL,
        actor            TEXT NOT NULL,
        evidence_refs    JSON NOT NULL DEFAULT '[]',
        metadata         JSON NOT NULL DEFAULT '{}',
        created_at       FLOAT NOT NULL
    )
    """,
    """
    CREATE INDEX IF NOT EXISTS ix_status_transitions_entity
        ON status_transitions (entity_type, entity_id, id)
    """,
)

_V2: Final = (
    # The due index of ADR D1, with ``created_at`` appended: the scan order
    # of SPEC B5 (``next_attempt_at, created_at``) then comes straight from
    # the index. Without it, rows sharing a due time (every row of one
    # ``enqueue_many`` does) are sorted as one block on every claim, so a
    # single claim behind a bulk enqueue of 20,000 rows cost 6 ms.
    "DROP INDEX IF EXISTS ix_dispatch_outbox_status_next_attempt",
    f"""
    CREATE INDEX ix_dispatch_outbox_status_next_attempt
        ON dispatch_outbox (status, next_attempt_at, created_at)
        WHERE {DUE_SQL}
    """,
)

DESTINATION_INDEX: Final = "ix_dispatch_outbox_destination_due"
"""The due rows by destination (version 3); SQLite is told to use it by
name, since without statistics it prefers the status index."""

_V3: Final = (
    # The due rows of each destination in claim order. A scan that leaves
    # out destinations at their per-destination cap walks the due index
    # past every row of theirs: 200,000 rows of one capped destination made
    # each scan read all of them inside the write transaction (28 ms on
    # SQLite and on PostgreSQL). With this index it reads the head of each
    # destination and the few rows it claims instead.
    f"""
    CREATE INDEX IF NOT EXISTS {DESTINATION_INDEX}
        ON dispatch_outbox (deliver_to, next_attempt_at, created_at)
        WHERE {DUE_SQL}
    """,
)

MIGRATIONS: Final[tuple[tuple[str, ...], ...]] = (_V1, _V2, _V3)
"""``MIGRATIONS[n]`` takes a database from version ``n`` to ``n + 1``."""

SCHEMA_VERSION: Final = len(MIGRATIONS)

_SCHEMA_EXISTS: Final = "SELECT 1 AS found FROM pg_namespace WHERE nspname = ?"

_VERSION_TABLE_DDL: Final = (
    f"CREATE TABLE IF NOT EXISTS {SCHEMA_VERSION_TABLE} "
    "(version INTEGER NOT NULL, applied_at FLOAT NOT NULL)"
)


@dataclasses.dataclass(frozen=True)
class Dialect:
    """What an engine spells differently in the schema and its bookkeeping."""

    name: str
    table_exists: str
    """A query taking a table name, answering one row whose first value is
    true when the table exists."""
    ddl: Callable[[str], str] = lambda statement: statement
    """The engine's spelling of one statement of :data:`MIGRATIONS`."""
    key_problem: Callable[[Conn, str], str | None] = lambda conn, table: None
    """What keeps an existing table's ``id`` from being the target of the
    outbox's foreign keys (None: the table is absent, or it can be)."""


def _quoted(name: str) -> str:
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
    columns = conn.query(f"PRAGMA table_info({_quoted(table)})")
    if not any(str(column["name"]).lower() == "id" for column in columns):
        return 'has no "id" column'
    key = [str(column["name"]).lower() for column in columns if column["pk"]]
    if key == ["id"]:
        return None
    for index in conn.query(f"PRAGMA index_list({_quoted(table)})"):
        if index["unique"] and not index["partial"]:
            parts = conn.query(f"PRAGMA index_info({_quoted(str(index['name']))})")
            if [str(part["name"]).lower() for part in parts] == ["id"]:
                return None
    return 'lacks a unique "id" column (neither its primary key nor a unique index)'


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
    key_problem=_sqlite_key_problem,
)
POSTGRES: Final = Dialect(
    "postgres",
    "SELECT to_regclass(?) IS NOT NULL AS found",
    lambda statement: statement.replace(
        "INTEGER PRIMARY KEY", "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY"
    ),
    _postgres_key_problem,
)

REFERENCED_TABLES: Final = (
    ("sessions", "dispatch_outbox.session_id"),
    ("schedule_runs", "dispatch_outbox.schedule_run_id"),
)
"""The tables the outbox's foreign keys point at, created only if absent:
a table of the same name that is already there must fit them."""
OWN_TABLES: Final = (
    "dispatch_outbox",
    "status_transitions",
    "sessions",
    "schedule_runs",
    SCHEMA_VERSION_TABLE,
)
"""Every table the outbox creates."""


def check_referenced_tables(conn: Conn, dialect: Dialect, where: str) -> None:
    """Raise :class:`~trio_dispatch.store.base.SchemaError` naming the first
    existing ``sessions``/``schedule_runs`` table that the outbox's foreign
    keys cannot point at (a service's own table of the same name, say);
    reads only."""
    for table, column in REFERENCED_TABLES:
        problem = dialect.key_problem(conn, table)
        if problem is not None:
            raise SchemaError(
                f'{where}: table "{table}" exists but {problem}, and the outbox\'s '
                f"{column} references it; give the outbox a database"
                f"{' or a schema (the store option schema)' if dialect is POSTGRES else ''} "
                "of its own"
            )


def schema_version(conn: Conn, dialect: Dialect) -> int | None:
    """The recorded schema version, or None if the database has none."""
    found = conn.query_one(dialect.table_exists, (SCHEMA_VERSION_TABLE,))
    if found is None or not found["found"]:
        return None
    row = conn.query_one(f"SELECT MAX(version) AS version FROM {SCHEMA_VERSION_TABLE}")
    return int(row["version"] or 0) if row else 0


def migrate(conn: Conn, dialect: Dialect, where: str, schema: str | None = None) -> int | None:
    """Bring the schema to :data:`SCHEMA_VERSION`, forward only; return the
    version found before (None: there was no outbox schema). Runs inside the
    caller's write transaction, which must exclude other migrators (SQLite:
    ``BEGIN IMMEDIATE``; PostgreSQL: an advisory lock). PostgreSQL: the
    tables go in the first existing schema of the connection's
    ``search_path``; ``schema`` (already on that path) is created first if
    absent. A newer schema, or an existing ``sessions``/``schedule_runs``
    table the foreign keys cannot use, raises
    :class:`~trio_dispatch.store.base.SchemaError` before anything of the
    outbox is written."""
    if schema is not None and conn.query_one(_SCHEMA_EXISTS, (schema,)) is None:
        # Only when absent: CREATE SCHEMA IF NOT EXISTS needs the right to
        # create schemas even when there is nothing to create.
        conn.execute(f"CREATE SCHEMA {_quoted(schema)}")
    if dialect is POSTGRES:
        current = conn.query_one("SELECT current_schema() AS name")
        if current is None or current["name"] is None:
            raise SchemaError(
                f"{where}: the connection's search_path names no schema that exists, so "
                "there is nowhere to create the outbox's tables: create the schema first, "
                "or set search_path to one that exists"
            )
    recorded = schema_version(conn, dialect)
    check_schema_version(recorded, where, SCHEMA_VERSION, migrating=True)
    check_referenced_tables(conn, dialect, where)
    conn.execute(dialect.ddl(_VERSION_TABLE_DDL))
    for version in range(recorded or 0, SCHEMA_VERSION):
        for statement in MIGRATIONS[version]:
            conn.execute(dialect.ddl(statement))
        conn.execute(
            f"INSERT INTO {SCHEMA_VERSION_TABLE} (version, applied_at) VALUES (?, ?)",
            (version + 1, time.time()),
        )
    return recorded


def require_current(conn: Conn, dialect: Dialect, where: str) -> int | None:
    """The recorded version, if it is the current one; else
    :class:`~trio_dispatch.store.base.SchemaError` naming ``migrate``."""
    recorded = schema_version(conn, dialect)
    check_schema_version(recorded, where, SCHEMA_VERSION, migrating=False)
    return recorded
