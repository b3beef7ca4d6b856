"""The one forward-only migration routine, for every engine, and the checks
it makes before writing anything: the recorded version, and tables of a
service's own in the way of the outbox's foreign keys.

What each version adds is in :mod:`.migrations`; its names (the indexes a
query hints or repeats the term of, :data:`SCHEMA_VERSION`,
:func:`statements`) are imported from here too.
"""

from __future__ import annotations

import re
import time
from typing import Final

from ..priority import SETTINGS_TABLE
from .base import Conn, SchemaError, check_schema_version
from .dialect import MIGRATION_LOCK as MIGRATION_LOCK
from .dialect import Dialect, quoted
from .migrations import COALESCE_INDEX as COALESCE_INDEX
from .migrations import COALESCE_WAITING_TERM as COALESCE_WAITING_TERM
from .migrations import DESTINATION_CHANGES_TABLE as DESTINATION_CHANGES_TABLE
from .migrations import DESTINATION_HOLDS_TABLE as DESTINATION_HOLDS_TABLE
from .migrations import DESTINATION_INDEX as DESTINATION_INDEX
from .migrations import DESTINATIONS_TABLE as DESTINATIONS_TABLE
from .migrations import DUE_INDEX as DUE_INDEX
from .migrations import EXPIRY_INDEX as EXPIRY_INDEX
from .migrations import EXPIRY_TERM as EXPIRY_TERM
from .migrations import FINISHED_INDEX as FINISHED_INDEX
from .migrations import FINISHED_STATUSES_SQL as FINISHED_STATUSES_SQL
from .migrations import HEADS_INDEX as HEADS_INDEX
from .migrations import HELD_BACK_DESTINATION_INDEX as HELD_BACK_DESTINATION_INDEX
from .migrations import HELD_BACK_INDEX as HELD_BACK_INDEX
from .migrations import MIGRATIONS as MIGRATIONS
from .migrations import ORDERING_INDEX as ORDERING_INDEX
from .migrations import ORDERING_LIVE_INDEX as ORDERING_LIVE_INDEX
from .migrations import ORDERING_SEQ_INDEX as ORDERING_SEQ_INDEX
from .migrations import SCHEDULE_TICK_INDEX as SCHEDULE_TICK_INDEX
from .migrations import SCHEDULES_TABLE as SCHEDULES_TABLE
from .migrations import SCHEMA_VERSION as SCHEMA_VERSION
from .migrations import Step as Step
from .migrations import statements as statements

SCHEMA_VERSION_TABLE: Final = "trio_dispatch_schema"

_ADDED_COLUMN: Final = re.compile(r"ALTER TABLE (\w+) ADD COLUMN (\w+) ")
"""A migration statement that adds a column: skipped where the column is
there already, as ``IF NOT EXISTS`` skips a table or an index."""

_SCHEMA_EXISTS: Final = "SELECT 1 AS found FROM pg_namespace WHERE nspname = ?"

_VERSION_TABLE_DDL: Final = (
    f"CREATE TABLE IF NOT EXISTS {SCHEMA_VERSION_TABLE} "
    "(version INTEGER NOT NULL, applied_at FLOAT NOT NULL)"
)


REFERENCED_TABLES: Final = (
    ("sessions", "dispatch_outbox.session_id"),
    ("schedule_runs", "dispatch_outbox.schedule_run_id"),
)
"""The tables the outbox's foreign keys point at, created with the outbox's
own: a table of one of these names that is there before ``dispatch_outbox``
is someone else's and is refused (see :func:`check_referenced_tables`)."""
OWN_TABLES: Final = (
    "dispatch_outbox",
    "status_transitions",
    "sessions",
    "schedule_runs",
    SCHEDULES_TABLE,
    DESTINATIONS_TABLE,
    DESTINATION_CHANGES_TABLE,
    DESTINATION_HOLDS_TABLE,
    SETTINGS_TABLE,
    SCHEMA_VERSION_TABLE,
)
"""Every table the outbox creates."""


def _own_schema_hint(dialect: Dialect, own_connection: bool) -> str:
    """How to keep the outbox's tables apart from a service's own."""
    if not dialect.schemas:
        return "give the outbox a database file of its own, or rename your table"
    if own_connection:
        return (
            "give the outbox a schema of its own: on this connection CREATE SCHEMA outbox "
            "and SET search_path TO outbox, public (or SET LOCAL, per transaction) before "
            "install_schema and every enqueue, and give the worker the store option "
            "schema: outbox"
        )
    return (
        "give the outbox a schema of its own: the store option schema (schema: outbox in "
        "the configuration), and SET search_path TO outbox, public on connections of "
        "yours that enqueue"
    )


def check_referenced_tables(conn: Conn, where: str, *, own_connection: bool = False) -> None:
    """Raise :class:`~trio_dispatch.store.base.SchemaError` (one line, naming
    the table and the fix) for the first ``sessions``/``schedule_runs``
    table in the way of the outbox's foreign keys; reads only.

    Before ``dispatch_outbox`` exists, any table of those names is a
    service's own: adopting it would point the outbox's foreign key at the
    service's rows, and deleting one a dispatch names would then fail
    wherever foreign keys are enforced. Once ``dispatch_outbox`` exists its
    keys point where they point (a store the outbox made, or one adopted
    from an earlier implementation), and only a table that has changed so
    that they cannot (no unique ``id``, say) is refused. ``own_connection``:
    the caller's own connection (:mod:`trio_dispatch.sync`), whose fix is a
    ``search_path`` rather than a store option."""
    dialect = conn.dialect
    outbox = conn.query_one(dialect.column_exists, ("dispatch_outbox", "id")) is not None
    for table, column in REFERENCED_TABLES:
        problem = dialect.key_problem(conn, table)
        if problem is not None:
            raise SchemaError(
                f'{where}: table "{table}" exists but {problem}, and the outbox\'s '
                f"{column} references it; {_own_schema_hint(dialect, own_connection)}"
            )
        if not outbox and conn.query_one(dialect.column_exists, (table, "id")) is not None:
            raise SchemaError(
                f'{where}: table "{table}" exists without the outbox\'s dispatch_outbox: a '
                f"table of yours, which {column} would reference (deleting a row of it that a "
                f"dispatch names would then fail); {_own_schema_hint(dialect, own_connection)}"
            )


def schema_version(conn: Conn) -> int | None:
    """The recorded schema version, or None if the database has none."""
    found = conn.query_one(conn.dialect.table_exists, (SCHEMA_VERSION_TABLE,))
    if found is None or not found["found"]:
        return None
    row = conn.query_one(f"SELECT MAX(version) AS version FROM {SCHEMA_VERSION_TABLE}")
    return int(row["version"] or 0) if row else 0


def migrate(
    conn: Conn, where: str, schema: str | None = None, *, own_connection: bool = False
) -> int | None:
    """Bring the schema to :data:`SCHEMA_VERSION`, forward only; return the
    version found before (None: there was no outbox schema). Runs inside the
    caller's write transaction, which must exclude other migrators (SQLite:
    ``BEGIN IMMEDIATE``; PostgreSQL: an advisory lock). PostgreSQL: the
    tables go in the first existing schema of the connection's
    ``search_path``; ``schema`` (already on that path) is created first if
    absent. A newer schema, or a ``sessions``/``schedule_runs`` table in the
    way of the foreign keys (:func:`check_referenced_tables`; its hint for
    ``own_connection``, a caller's own), raises
    :class:`~trio_dispatch.store.base.SchemaError` before anything of the
    outbox is written."""
    if schema is not None and conn.query_one(_SCHEMA_EXISTS, (schema,)) is None:
        # Only when absent: CREATE SCHEMA IF NOT EXISTS needs the right to
        # create schemas even when there is nothing to create.
        conn.execute(f"CREATE SCHEMA {quoted(schema)}")
    dialect = conn.dialect
    if dialect.schemas:
        current = conn.query_one("SELECT current_schema() AS name")
        if current is None or current["name"] is None:
            raise SchemaError(
                f"{where}: the connection's search_path names no schema that exists, so "
                "there is nowhere to create the outbox's tables: create the schema first, "
                "or set search_path to one that exists"
            )
    recorded = schema_version(conn)
    check_schema_version(recorded, where, SCHEMA_VERSION, migrating=True)
    check_referenced_tables(conn, where, own_connection=own_connection)
    conn.execute(dialect.ddl(_VERSION_TABLE_DDL))
    for version in range(recorded or 0, SCHEMA_VERSION):
        for statement in MIGRATIONS[version]:
            if callable(statement):
                statement(conn)
                continue
            added = _ADDED_COLUMN.match(statement)
            if added and conn.query_one(dialect.column_exists, added.groups()) is not None:
                continue  # adopted from a database that has it already
            conn.execute(dialect.ddl(statement))
        conn.execute(
            f"INSERT INTO {SCHEMA_VERSION_TABLE} (version, applied_at) VALUES (?, ?)",
            (version + 1, time.time()),
        )
    return recorded


def current_version(conn: Conn) -> int | None:
    """The recorded version when it is :data:`SCHEMA_VERSION` (nothing to
    migrate: a store opening for writes skips the migration's lock and
    checks, which the schema passed when it was made), else None. Reads
    only, outside any transaction of its own."""
    recorded = schema_version(conn)
    return recorded if recorded == SCHEMA_VERSION else None


def require_current(conn: Conn, where: str) -> int | None:
    """The recorded version, if it is the current one; else
    :class:`~trio_dispatch.store.base.SchemaError` naming ``migrate``."""
    recorded = schema_version(conn)
    check_schema_version(recorded, where, SCHEMA_VERSION, migrating=False)
    return recorded
