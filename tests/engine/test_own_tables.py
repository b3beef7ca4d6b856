"""The outbox's tables beside a service's own (issue: a service's own
``sessions`` table): an existing ``sessions``/``schedule_runs`` table the
foreign keys cannot point at is refused by ``open_store``,
``sync.install_schema`` and ``trio-dispatch migrate`` before anything is
created, one that fits is adopted; on PostgreSQL a schema of the outbox's
own keeps every table apart from the service's."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any, cast

import anyio
import pytest

from trio_dispatch import Delivery, DispatchWorker, enqueue_dispatch, open_store
from trio_dispatch import sync as outbox
from trio_dispatch.store import SchemaError
from trio_dispatch.store.schema import OWN_TABLES

from ..helpers import assert_one_line_error, run_cli, wait_for


def connect(engine: str, target: str, *, autocommit: bool = False) -> Any:
    if engine == "sqlite":
        return sqlite3.connect(target, isolation_level=None if autocommit else "DEFERRED")
    import psycopg

    return psycopg.connect(target, autocommit=autocommit)


def run(engine: str, target: str, *statements: str) -> None:
    conn = connect(engine, target, autocommit=True)
    try:
        for statement in statements:
            conn.execute(statement)
    finally:
        conn.close()


def tables(engine: str, target: str) -> set[str]:
    """Every table and view in the database, schema-qualified on PostgreSQL."""
    conn = connect(engine, target, autocommit=True)
    try:
        if engine == "sqlite":
            query = "SELECT name FROM sqlite_master WHERE type IN ('table', 'view')"
        else:
            query = (
                "SELECT table_schema || '.' || table_name FROM information_schema.tables "
                "WHERE table_schema NOT IN ('pg_catalog', 'information_schema')"
            )
        return {str(row[0]) for row in conn.execute(query).fetchall()}
    finally:
        conn.close()


async def open_and_close(target: str, **options: Any) -> None:
    async with open_store(target, **options):
        pass


def install(engine: str, target: str) -> None:
    """``sync.install_schema`` on a caller's connection; the caller's
    transaction stays usable after a refusal."""
    conn = connect(engine, target)
    try:
        with pytest.raises(SchemaError) as info:
            outbox.install_schema(conn)
        conn.execute("SELECT 1")  # still usable
        conn.rollback()
        raise info.value
    finally:
        conn.close()


# A service's own table of a name the outbox uses, and what the refusal names.
INCOMPATIBLE = {
    "no id": ("sessions", "CREATE TABLE sessions (name TEXT)", 'has no "id" column'),
    "an id without a key": ("sessions", "CREATE TABLE sessions (id TEXT)", 'unique "id"'),
    "an id in a composite key": (
        "schedule_runs",
        "CREATE TABLE schedule_runs (id TEXT, part INTEGER, PRIMARY KEY (id, part))",
        'unique "id"',
    ),
    "a partial unique index": (
        "sessions",
        "CREATE TABLE sessions (id TEXT, live INTEGER); "
        "CREATE UNIQUE INDEX sessions_live ON sessions (id) WHERE live = 1",
        'unique "id"',
    ),
    "a view": ("sessions", "CREATE VIEW sessions AS SELECT 'x' AS id", "is a view, not a table"),
}


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])  # what is checked is the database's
@pytest.mark.parametrize("via", ["open_store", "install_schema", "migrate"])
@pytest.mark.parametrize("case", list(INCOMPATIBLE))
async def test_an_existing_table_the_foreign_keys_cannot_use_is_refused_before_anything_is_created(
    engine: str, fresh_target: str, via: str, case: str
) -> None:
    table, ddl, lacks = INCOMPATIBLE[case]
    run(engine, fresh_target, *ddl.split("; "))
    before = tables(engine, fresh_target)
    if via == "migrate":
        done = await anyio.to_thread.run_sync(lambda: run_cli("--db", fresh_target, "migrate"))
        line = assert_one_line_error(done, 2, f'table "{table}" exists but', lacks)
    else:
        with pytest.raises(SchemaError) as info:
            if via == "open_store":
                await open_and_close(fresh_target)
            else:
                await anyio.to_thread.run_sync(install, engine, fresh_target)
        line = str(info.value)
        assert "\n" not in line and f'table "{table}" exists but' in line and lacks in line
    assert "database" in line and (engine == "sqlite" or "schema" in line)
    assert tables(engine, fresh_target) == before  # nothing of the outbox


@pytest.mark.postgres_only
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_an_id_that_is_not_text_is_refused_on_postgres(fresh_target: str) -> None:
    run("postgres", fresh_target, "CREATE TABLE sessions (id BIGINT PRIMARY KEY)")
    expected = r'"sessions" exists but has an "id" column of type bigint, not text'
    with pytest.raises(SchemaError, match=expected):
        await open_and_close(fresh_target)
    assert tables("postgres", fresh_target) == {"public.sessions"}


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.parametrize(
    "ddl",
    [
        "CREATE TABLE sessions (id TEXT PRIMARY KEY, user_name TEXT NOT NULL)",
        # Another primary key, and id unique beside it.
        "CREATE TABLE sessions (n INTEGER PRIMARY KEY, id VARCHAR(64) NOT NULL UNIQUE, "
        "user_name TEXT NOT NULL)",
    ],
)
async def test_a_sessions_table_whose_id_fits_is_adopted(
    engine: str, fresh_target: str, ddl: str
) -> None:
    run(
        engine,
        fresh_target,
        ddl,
        "INSERT INTO sessions (id, user_name) VALUES ('s-1', 'ada')"
        if "n INTEGER" not in ddl
        else "INSERT INTO sessions (n, id, user_name) VALUES (7, 's-1', 'ada')",
    )
    async with open_store(fresh_target) as db:
        dispatch_id = await enqueue_dispatch(db, kind="k", deliver_to="x", session_id="s-1")
        with pytest.raises(ValueError, match="session_id 'ghost' does not exist"):
            await enqueue_dispatch(db, kind="k", deliver_to="x", session_id="ghost")
    conn = connect(engine, fresh_target)
    try:
        outbox.install_schema(conn)  # idempotent, and checks the same table
        second = outbox.enqueue_dispatch(conn, kind="k", deliver_to="x", session_id="s-1")
        conn.commit()
        mark = "?" if engine == "sqlite" else "%s"
        rows = conn.execute(
            f"SELECT session_id FROM dispatch_outbox WHERE id IN ({mark}, {mark})",
            (dispatch_id, second),
        ).fetchall()
        assert [row[0] for row in rows] == ["s-1", "s-1"]
        assert conn.execute("SELECT user_name FROM sessions").fetchall() == [("ada",)]
    finally:
        conn.close()


# -- PostgreSQL: a schema of the outbox's own ------------------------------------------------


def public_sessions_of_the_service(target: str) -> None:
    run(
        "postgres",
        target,
        "CREATE TABLE sessions (name TEXT, started TIMESTAMPTZ)",
        "INSERT INTO sessions (name) VALUES ('the service''s own')",
    )


@pytest.mark.postgres_only
@pytest.mark.anyio
@pytest.mark.parametrize("how", ["option", "url"])
async def test_a_schema_of_its_own_holds_every_table_and_a_worker_delivers_from_it(
    fresh_target: str, how: str
) -> None:
    public_sessions_of_the_service(fresh_target)  # an incompatible table in public
    target, schema = fresh_target, cast("str | None", "outbox_x")
    if how == "url":
        target, schema = f"{fresh_target}?options=-csearch_path%3Doutbox_x", None
    delivered: list[str] = []

    async def send(delivery: Delivery) -> None:
        delivered.append(delivery.dispatch_id)

    async with open_store(target, schema=schema) as db, anyio.create_task_group() as tg:
        await tg.start(DispatchWorker(db, transport=send, tick_seconds=3600).run)
        dispatch_id = await enqueue_dispatch(db, kind="k", deliver_to="x", dedup_key="d")
        assert await enqueue_dispatch(db, kind="k", deliver_to="x", dedup_key="d") == dispatch_id
        await wait_for(lambda: delivered, timeout=30)
        tg.cancel_scope.cancel()
    assert delivered == [dispatch_id]
    assert tables("postgres", fresh_target) == {"public.sessions"} | {
        f"outbox_x.{table}" for table in OWN_TABLES
    }
    conn = connect("postgres", fresh_target, autocommit=True)
    try:
        status = conn.execute("SELECT status FROM outbox_x.dispatch_outbox").fetchall()
        assert status == [("delivered",)]
        assert conn.execute("SELECT name FROM public.sessions").fetchall() == [
            ("the service's own",)
        ]
    finally:
        conn.close()


@pytest.mark.postgres_only
def test_migrate_and_the_read_commands_use_the_configured_schema(
    fresh_target: str, tmp_path: Path
) -> None:
    public_sessions_of_the_service(fresh_target)
    config = tmp_path / "trio-dispatch.yaml"
    config.write_text(f"store: {fresh_target}\nschema: outbox_y\n")
    done = run_cli("--config", str(config), "check-config")
    assert done.returncode == 0 and "schema outbox_y" in done.stdout, done
    done = run_cli("--config", str(config), "migrate")
    assert done.returncode == 0, done.stderr
    assert "schema outbox_y" in done.stdout
    assert {t for t in tables("postgres", fresh_target) if t.startswith("outbox_y.")} == {
        f"outbox_y.{table}" for table in OWN_TABLES
    }
    conn = connect("postgres", fresh_target)
    try:
        conn.execute("SET search_path TO outbox_y")  # a caller's own connection
        dispatch_id = outbox.enqueue_dispatch(conn, kind="k", deliver_to="x")
        conn.commit()
    finally:
        conn.close()
    done = run_cli("--config", str(config), "ls")
    assert done.returncode == 0 and dispatch_id in done.stdout, done
    # Without the schema the same database has no outbox (public's sessions
    # is the service's), and the read commands say so.
    assert_one_line_error(run_cli("--db", fresh_target, "ls"), 2, "trio-dispatch migrate")
    url = f"{fresh_target}?options=-csearch_path%3Doutbox_y"
    done = run_cli("--db", url, "ls")
    assert done.returncode == 0 and dispatch_id in done.stdout, done


@pytest.mark.postgres_only
def test_install_schema_uses_the_callers_search_path(fresh_target: str) -> None:
    public_sessions_of_the_service(fresh_target)
    conn = connect("postgres", fresh_target)
    try:
        conn.execute("SET search_path TO not_there")
        with pytest.raises(SchemaError, match="search_path names no schema that exists"):
            outbox.install_schema(conn)
        conn.rollback()
        conn.execute("CREATE SCHEMA app_outbox")
        conn.execute("SET search_path TO app_outbox")
        outbox.install_schema(conn)
        dispatch_id = outbox.enqueue_dispatch(conn, kind="k", deliver_to="x")
        conn.commit()
    finally:
        conn.close()
    assert {t for t in tables("postgres", fresh_target) if not t.startswith("public.")} == {
        f"app_outbox.{table}" for table in OWN_TABLES
    }
    conn = connect("postgres", fresh_target, autocommit=True)
    try:
        found = conn.execute("SELECT id FROM app_outbox.dispatch_outbox").fetchall()
        assert found == [(dispatch_id,)]
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"schema": "Outbox"}, "schema must be a lowercase identifier"),
        ({"schema": "pg_outbox"}, "schema must be a lowercase identifier"),
        ({"schema": 'x"; DROP TABLE t; --'}, "schema must be a lowercase identifier"),
    ],
)
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_schema_name_the_outbox_cannot_use_is_refused_naming_it(
    engine: str, fresh_target: str, options: dict[str, Any], message: str
) -> None:
    expected = message if engine == "postgres" else "applies to a PostgreSQL store only"
    with pytest.raises(ValueError, match=expected):
        await open_and_close(fresh_target, **options)
    assert tables(engine, fresh_target) == set()


@pytest.mark.postgres_only
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_url_search_path_and_a_schema_that_disagree_are_refused(
    fresh_target: str,
) -> None:
    url = f"{fresh_target}?options=-c%20search_path%3Da_one,public"
    with pytest.raises(ValueError, match="'b_one' and the URL's search_path 'a_one'"):
        await open_and_close(url, schema="b_one")
    with pytest.raises(ValueError, match=r"the URL's search_path .* got '\$user'"):
        await open_and_close(f"{fresh_target}?options=-csearch_path%3D%22%24user%22")
    assert tables("postgres", fresh_target) == set()
