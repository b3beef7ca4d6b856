"""Schema version 11 (docs/controls.md): a database of version 10, whose
status CHECK and finished-age index know six statuses, admits ``superseded``
and ``cancelled`` after the migration, keeps every row, and still refuses
a status outside the enum; read back on both engines."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from trio_dispatch import enqueue_dispatch, get_dispatch, prune_dispatches
from trio_dispatch import lifecycle as lc
from trio_dispatch.store import open_store
from trio_dispatch.store.schema import FINISHED_INDEX, MIGRATIONS, SCHEMA_VERSION

from ..conftest import PostgresRaw, RawDB

pytestmark = pytest.mark.anyio

SIX = ("pending", "delivering", "delivered", "acked", "dead_letter", "expired")
OLD_CHECK = "status IN ('pending', 'delivering', 'delivered', 'acked', 'dead_letter', 'expired')"
OLD_FINISHED = "status IN ('delivered', 'acked', 'dead_letter', 'expired')"
STATUS_VERSION = next(
    n + 1 for n, steps in enumerate(MIGRATIONS) if any(callable(step) for step in steps)
)


def _as_version_10(engine: str, target: str, raw: RawDB) -> None:
    """Put the schema back as version 10 wrote it: the six-status CHECK and
    finished-age index, and no record of the later versions."""
    if engine == "sqlite":
        conn = sqlite3.connect(target, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            sql = conn.execute(
                "SELECT sql FROM sqlite_master WHERE name = 'dispatch_outbox'"
            ).fetchone()[0]
            assert lc.STATUS_CHECK_SQL in sql
            version = conn.execute("PRAGMA schema_version").fetchone()[0]
            conn.execute("PRAGMA writable_schema = ON")
            conn.execute(
                "UPDATE sqlite_master SET sql = ? WHERE name = 'dispatch_outbox'",
                (sql.replace(lc.STATUS_CHECK_SQL, OLD_CHECK),),
            )
            conn.execute(f"PRAGMA schema_version = {version + 1}")
            conn.execute("PRAGMA writable_schema = OFF")
            conn.execute("COMMIT")
        finally:
            conn.close()
    else:
        raw.execute("ALTER TABLE dispatch_outbox DROP CONSTRAINT dispatch_outbox_status_check")
        raw.execute(
            f"ALTER TABLE dispatch_outbox ADD CONSTRAINT dispatch_outbox_status_check "
            f"CHECK ({OLD_CHECK})"
        )
    raw.execute(f"DROP INDEX {FINISHED_INDEX}")
    raw.execute(
        f"CREATE INDEX {FINISHED_INDEX} ON dispatch_outbox "
        f"(status, COALESCE(updated_at, created_at)) WHERE {OLD_FINISHED}"
    )
    raw.execute("DELETE FROM trio_dispatch_schema WHERE version >= ?", (STATUS_VERSION,))


def _raw_for(engine: str, target: str) -> RawDB:
    return RawDB(Path(target)) if engine == "sqlite" else PostgresRaw(target)


async def test_a_version_10_database_admits_the_new_statuses_and_keeps_its_rows(
    engine: str, fresh_target: str
) -> None:
    raw = _raw_for(engine, fresh_target)
    async with open_store(fresh_target) as db:
        ids = [await enqueue_dispatch(db, kind="k", deliver_to=f"d{i}") for i in range(3)]
    _as_version_10(engine, fresh_target, raw)
    with pytest.raises(raw.error):  # version 10 refuses the new statuses
        raw.execute("UPDATE dispatch_outbox SET status = 'cancelled' WHERE id = ?", (ids[0],))

    async with open_store(fresh_target) as db:  # migrates
        assert [(await get_dispatch(db, i) or {}).get("status") for i in ids] == ["pending"] * 3
    assert raw.scalar("SELECT MAX(version) FROM trio_dispatch_schema") == SCHEMA_VERSION
    assert raw.scalar("SELECT COUNT(*) FROM dispatch_outbox") == 3

    raw.execute(
        "UPDATE dispatch_outbox SET status = 'cancelled', updated_at = 1 WHERE id = ?", (ids[0],)
    )
    raw.execute(
        "UPDATE dispatch_outbox SET status = 'superseded', updated_at = 1 WHERE id = ?", (ids[1],)
    )
    with pytest.raises(raw.error):  # still closed: only the enum's statuses
        raw.execute("UPDATE dispatch_outbox SET status = 'lost' WHERE id = ?", (ids[2],))
    if engine == "sqlite":
        assert raw.scalar("PRAGMA integrity_check") == "ok"
        index = raw.scalar(f"SELECT sql FROM sqlite_master WHERE name = '{FINISHED_INDEX}'")
    else:
        index = raw.scalar(f"SELECT pg_get_indexdef('{FINISHED_INDEX}'::regclass)")
    for status in lc.FINISHED_STATUSES:
        assert f"'{status}'" in index

    # Retention treats the new statuses as finished: both pruned by age.
    async with open_store(fresh_target) as db:
        assert await prune_dispatches(db, older_than=60) == 2
        assert (await get_dispatch(db, ids[2]) or {}).get("status") == "pending"

    # Migrating again changes nothing.
    async with open_store(fresh_target):
        pass
    assert (
        raw.scalar("SELECT COUNT(*) FROM trio_dispatch_schema WHERE version = ?", (STATUS_VERSION,))
        == 1
    )


def test_every_status_of_the_enum_is_new_or_one_of_the_six() -> None:
    assert set(lc.STATUSES) - set(SIX) == {"superseded", "cancelled"}
    assert {"superseded", "cancelled"} <= set(lc.FINISHED_STATUSES)
